"""User-facing outputs, shaped like vLLM's RequestOutput / CompletionOutput."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[dict[int, Logprob]]] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """A request's timestamps, all time.monotonic() (CLOCK_MONOTONIC: one clock for the API and engine processes).

    arrival / first_token / last_token / finished: the API process, as outputs reach it (what a client sees).
    scheduled / engine_first_token / engine_last_token: the engine, over all of a request's choices (earliest
    scheduling and first token, latest token); the queue, prefill and decode phases of GET /metrics come from them.
    """
    arrival_time: float
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    scheduled_time: Optional[float] = None
    engine_first_token_time: Optional[float] = None
    engine_last_token_time: Optional[float] = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None
    num_cached_tokens: int = 0
    metrics: Optional[RequestMetrics] = None
    extra: dict = field(default_factory=dict)


@dataclass
class PoolingOutput:
    """vLLM's: a pooling request's result, its embedding as a CPU float32 torch tensor."""
    data: Any


@dataclass
class PoolingRequestOutput:
    """vLLM's output of LLM.encode (and of the server's embedding requests). `outputs` is None when the request was
    aborted before its prompt was computed (e.g. a prompt the KV cache can never hold)."""
    request_id: str
    outputs: Optional[PoolingOutput]
    prompt_token_ids: list[int]
    finished: bool
    prompt: Optional[str] = None
    num_cached_tokens: int = 0
    metrics: Optional[RequestMetrics] = None


@dataclass
class EmbeddingOutput:
    """vLLM's: an embedding as a list of floats."""
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """vLLM's output of LLM.embed: `.outputs.embedding`."""
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        if out.outputs is None:
            raise ValueError(f"request {out.request_id} has no embedding: it was aborted")
        return cls(out.request_id, EmbeddingOutput(out.outputs.data.tolist()), out.prompt_token_ids, out.finished)


@dataclass
class ClassificationOutput:
    """vLLM's: a classifier's outputs for one prompt, one value per label (probabilities unless use_activation was
    false)."""
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """vLLM's output of LLM.classify: `.outputs.probs`."""
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "ClassificationRequestOutput":
        if out.outputs is None:
            raise ValueError(f"request {out.request_id} has no result: it was aborted")
        return cls(out.request_id, ClassificationOutput(out.outputs.data.tolist()), out.prompt_token_ids, out.finished)


@dataclass
class ScoringOutput:
    """vLLM's: one text pair's score."""
    score: float


@dataclass
class ScoringRequestOutput:
    """vLLM's output of LLM.score: `.outputs.score`."""
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "ScoringRequestOutput":
        from voltllm.pooling.scoring import single_score

        if out.outputs is None:
            raise ValueError(f"request {out.request_id} has no score: it was aborted")
        return cls(out.request_id, ScoringOutput(single_score(out.outputs.data, out.request_id)),
                   out.prompt_token_ids, out.finished)
