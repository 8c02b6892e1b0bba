"""Messages that cross the engine-core boundary (in-process or over ZMQ): plain, serializable records."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from voltllm.pooling.params import PoolingParams
from voltllm.sampling.params import SamplingParams

# One position's logprobs: {token_id: (logprob, vocabulary rank)}, holding the chosen (sampled or prompt) token
# first, then the top-k ranked 1..k (as vLLM: a chosen token among them keeps its top-k rank).
PositionLogprobs = dict[int, tuple[float, int]]


@dataclass
class EngineCoreRequest:
    """A generation request (sampling_params) or, in a pooling engine, an embedding request (pooling_params, resolved
    by the Frontend: normalize set, dimensions checked; sampling_params None)."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Optional[SamplingParams]
    arrival_time: float = 0.0
    cache_salt: Optional[str] = None  # keeps prefix-cache sharing within one tenant
    priority: int = 0  # --scheduling-policy priority: lower is served first (vLLM's); 0 under fcfs
    pooling_params: Optional[PoolingParams] = None
    lora_request: Optional[Any] = None  # voltllm.lora.request.LoRARequest: the adapter it runs with (None: none)
    # a prompt with images (voltllm.multimodal.inputs.MultiModalPrompt): its placeholders are already expanded in
    # prompt_token_ids
    multi_modal: Optional[Any] = None
    # --enable-prompt-embeds: the prompt's embedding rows [tokens, hidden] (CPU; prompt_token_ids are placeholders,
    # one per row) and their content hashes for the prefix cache (engine/prompt_embeds.py)
    prompt_embeds: Optional[Any] = None
    prompt_embeds_spans: tuple = ()


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" (None while running)
    stop_reason: Union[int, str, None] = None  # the stop token id that ended it, if any
    new_logprobs: Optional[list[PositionLogprobs]] = None  # one per new token
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None  # sent once, first entry None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # engine-side timestamps (time.monotonic() of the engine process; differences are meaningful)
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    scheduled_time: Optional[float] = None
    pooled: Any = None  # a pooling request's embedding (a CPU float32 torch tensor), with its finish

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __reduce__(self) -> tuple:
        # pickled per engine step for every running request (engine -> API process): a positional tuple
        # dumps in ~0.4 us and loads in ~0.3 us, against ~0.65 / ~0.8 us through the default dict state
        return (EngineCoreOutput, (self.request_id, self.new_token_ids, self.finish_reason, self.stop_reason,
                                   self.new_logprobs, self.prompt_logprobs, self.num_cached_tokens,
                                   self.first_token_time, self.last_token_time, self.scheduled_time, self.pooled))


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # prompt tokens found
    num_preemptions: int = 0
    num_blocks: int = 0
    step_counter: int = 0
    extra: dict = field(default_factory=dict)
    # the tokens each step scheduled since the previous stats() (vLLM's iteration_tokens_total histogram)
    iteration_tokens: list = field(default_factory=list)
    # --kv-cache-metrics: sampled blocks' lifetimes, idle times before eviction and reuse gaps (seconds) since the
    # previous stats() ({"lifetime": [...], "idle_before_evict": [...], "reuse_gap": [...]}; empty: off)
    kv_block_samples: dict = field(default_factory=dict)
