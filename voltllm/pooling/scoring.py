"""Scoring text pairs, as vLLM does, in its two kinds (shared by LLM.score and the server's /score and /rerank routes):
- a classifier (cross-encoder): each (text_1, text_2) pair is one prompt, its score the classifier's one output
  (sigmoid of its logit by default);
- an embedding model (bi-encoder): each text is embedded on its own, as /v1/embeddings embeds it, and a pair's score
  is the cosine similarity of its two embeddings.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch.nn.functional as F

from voltllm.engine.outputs import PoolingOutput, PoolingRequestOutput
from voltllm.pooling.classifier import ClassifierConfig


class ScoreInputError(ValueError):
    """Score inputs of the wrong shape (an HTTP 400; the message names the field)."""


def score_inputs(data_1: Union[str, list], data_2: Union[str, list], names: tuple[str, str] = ("text_1", "text_2")
                 ) -> tuple[list[str], list[str]]:
    """The two sides as lists of texts, checked against vLLM's pairing rule: 1:1, 1:N (the one text_1 with each
    text_2) or N:N (position by position)."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    for name, values in zip(names, (first, second)):
        if not values:
            raise ScoreInputError(f"{name}: at least one text must be given")
        for v in values:
            if not isinstance(v, str):
                raise ScoreInputError(f"{name}: texts only (strings), got {type(v).__name__}")
    if len(first) > 1 and len(first) != len(second):
        raise ScoreInputError(f"{names[0]} has {len(first)} texts and {names[1]} {len(second)}: give one {names[0]} "
                              f"(scored against each {names[1]}) or as many as {names[1]} (1:1, 1:N or N:N)")
    return first, second


def score_pairs(data_1: Union[str, list], data_2: Union[str, list], names: tuple[str, str] = ("text_1", "text_2")
                ) -> list[tuple[str, str]]:
    """The (text_1, text_2) pairs under vLLM's pairing rule (score_inputs)."""
    first, second = score_inputs(data_1, data_2, names)
    if len(first) == 1:
        first = first * len(second)
    return list(zip(first, second))


def cosine_scores(firsts: Sequence[PoolingRequestOutput], seconds: Sequence[PoolingRequestOutput],
                  pad_token_id: Optional[int]) -> list[PoolingRequestOutput]:
    """vLLM's bi-encoder scores: one output per pair (a single first embedding paired with each second), its data the
    cosine similarity of the two embeddings (float32, a 0-d tensor), its prompt tokens both texts' tokens with the
    tokenizer's pad token between them when it has one (what vLLM counts as the pair's usage)."""
    if len(firsts) == 1:
        firsts = list(firsts) * len(seconds)
    if len(firsts) != len(seconds):
        raise ValueError(f"{len(firsts)} first embeddings for {len(seconds)} second ones")
    pad = [] if pad_token_id is None else [pad_token_id]
    scored = []
    for a, b in zip(firsts, seconds):
        if a.outputs is None or b.outputs is None:
            raise ValueError(f"request {(a if a.outputs is None else b).request_id} has no embedding: it was aborted")
        score = F.cosine_similarity(a.outputs.data.float(), b.outputs.data.float(), dim=0)
        scored.append(PoolingRequestOutput(f"{a.request_id}_{b.request_id}", PoolingOutput(score),
                                           list(a.prompt_token_ids) + pad + list(b.prompt_token_ids), True,
                                           num_cached_tokens=a.num_cached_tokens + b.num_cached_tokens))
    return scored


def pair_token_ids(tokenizer: Any, classifier: ClassifierConfig, text_1: str, text_2: str) -> list[int]:
    """One pair's prompt as vLLM builds it: a causal LM converted to a reranker (classifier_from_token) reads
    text_1 + text_2 as one text (the caller writes the model's template into them, e.g. Qwen3-Reranker's); a
    sequence-classification checkpoint reads them as the tokenizer's text pair (its separator tokens, if any)."""
    if classifier.pair_form == "concat":
        return list(tokenizer(text_1 + text_2)["input_ids"])
    return list(tokenizer(text=text_1, text_pair=text_2)["input_ids"])


def first_tokens_text(tokenizer: Any, text: str, limit: int) -> str:
    """vLLM's max_tokens_per_query / max_tokens_per_doc: the text up to the end of its first `limit` tokens (special
    tokens not counted), cut at that token's last character so the rest of the prompt tokenizes as written (no
    decode round trip); a text of `limit` tokens or fewer unchanged."""
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:  # (a slow tokenizer has no offsets: its first tokens decoded instead)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return text if len(ids) <= limit else tokenizer.decode(ids[:limit])
    if len(enc["input_ids"]) <= limit:
        return text
    return text[:enc["offset_mapping"][limit - 1][1]]


def check_token_limit(name: str, value: int, max_model_len: int) -> int:
    """max_tokens_per_query / max_tokens_per_doc as vLLM checks them: 0 (no cut) or a token count below the context
    length; a ScoreInputError (its message starts with the name) otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ScoreInputError(f"{name} must be a non-negative integer (0: no limit), got {value}")
    if value >= max_model_len:
        raise ScoreInputError(f"{name} ({value}) must be less than max_model_len ({max_model_len})")
    return value


def cut_texts(tokenizer: Any, first: list[str], second: list[str], per_query: int, per_doc: int
              ) -> tuple[list[str], list[str]]:
    """Each first text (query) cut to its first per_query tokens and each second text (document) to its first
    per_doc (0: not cut), before the pair prompt is made (first_tokens_text)."""
    if per_query:
        first = [first_tokens_text(tokenizer, t, per_query) for t in first]
    if per_doc:
        second = [first_tokens_text(tokenizer, t, per_doc) for t in second]
    return first, second


def single_score(data: Any, request_id: str) -> float:
    """A pooled classifier output as one score (vLLM's score task needs a one-label classifier)."""
    if data.numel() != 1:
        raise ValueError(f"request {request_id}: the classifier has {data.numel()} labels; scores need a one-label "
                         "classifier (its probabilities are served by classify)")
    return float(data.reshape(()).item())
