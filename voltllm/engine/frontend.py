"""The text side of the engine, in the caller's (API) process: tokenize (prompts, and bad_words into token ids),
fan out n > 1, detokenize, stop strings, logprob decoding, and RequestOutput assembly.
"""
from __future__ import annotations

import json
import operator
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from voltllm.engine.detokenizer import IncrementalDetokenizer
from voltllm.engine.outputs import (CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestMetrics,
                                    RequestOutput)
from voltllm.engine.request_checks import InvalidRequestError, kept_prompt
from voltllm.engine.types import EngineCoreOutput, EngineCoreRequest, PositionLogprobs
from voltllm.pooling.params import PoolingParams
from voltllm.sampling.bad_words import bad_words_token_ids
from voltllm.sampling.params import SamplingParams

PromptType = Union[str, Sequence[int], dict]


class InvalidPromptError(ValueError):
    def __init__(self, message: str, param: str = "prompt"):
        super().__init__(message)
        self.param = param  # the request field at fault (an HTTP 400's param)


def eos_token_ids(tokenizer: Any, model_path: str) -> tuple[int, ...]:
    """EOS ids from the tokenizer and, when present, the checkpoint's generation_config.json."""
    ids = set()
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    path = os.path.join(model_path, "generation_config.json") if os.path.isdir(model_path) else None
    if path and os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return tuple(sorted(ids))


GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(model_path: str, mode: str = "auto", override: Optional[dict] = None) -> dict:
    """Default sampling values from the checkpoint's generation_config.json (--generation-config auto or
    a folder holding one); 'vllm' means none (the plain SamplingParams defaults). `override`
    (--override-generation-config) is merged on top, key by key, whatever the mode."""
    return {**_file_defaults(model_path, mode), **(override or {})}


def _file_defaults(model_path: str, mode: str) -> dict:
    if mode == "vllm":
        return {}
    folder = model_path if mode == "auto" else mode
    path = os.path.join(folder, "generation_config.json") if os.path.isdir(folder) else None
    if path is None or not os.path.isfile(path):
        if mode not in ("auto",):
            raise ValueError(f"--generation-config {mode}: no generation_config.json there")
        return {}
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("do_sample") is False:
        return {"temperature": 0.0}
    return {k: cfg[k] for k in GENERATION_DEFAULT_KEYS if cfg.get(k) is not None}


def child_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


@dataclass
class _Child:
    index: int
    detok: Optional[IncrementalDetokenizer]
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[dict[int, Logprob]]] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


@dataclass
class _RequestState:
    request_id: str
    prompt: Optional[str]
    prompt_ids: list[int]
    params: Union[SamplingParams, PoolingParams]
    children: dict[str, _Child]
    metrics: RequestMetrics
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None
    num_cached_tokens: int = 0
    pooling: bool = False  # an embedding request (one child, no text): its result is `pooled`
    pooled: Any = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


def _token_ids(value: Any) -> list[int]:
    """A token-id prompt as a list of ints (numpy / torch integers accepted), else InvalidPromptError."""
    try:
        ids = [None if isinstance(t, bool) else operator.index(t) for t in value]
    except TypeError:
        ids = [None]
    if None in ids:
        raise InvalidPromptError("a token-id prompt must be a list of integers")
    return ids


def _engine_times(m: RequestMetrics, out: EngineCoreOutput) -> None:
    """Fold one output's engine timestamps into its parent's: earliest scheduling and first token, latest token."""
    if out.scheduled_time is not None and (m.scheduled_time is None or out.scheduled_time < m.scheduled_time):
        m.scheduled_time = out.scheduled_time
    t = out.first_token_time
    if t is not None and (m.engine_first_token_time is None or t < m.engine_first_token_time):
        m.engine_first_token_time = t
    t = out.last_token_time
    if t is not None and (m.engine_last_token_time is None or t > m.engine_last_token_time):
        m.engine_last_token_time = t


class Frontend:
    """Turns prompts into EngineCoreRequests and EngineCoreOutputs into RequestOutputs."""

    def __init__(self, tokenizer: Any, model_path: str, max_model_len: int, pooler: Any = None,
                 model_name: str = "", reasoning: Any = None, prompt_embeds_width: Optional[int] = None,
                 block_size: int = 16):
        """pooler: a pooling engine's PoolerConfig (its requests' defaults and checks); model_name: the name its
        errors give the model; reasoning: the engine's ReasoningConfig (--reasoning-parser / --reasoning-config);
        prompt_embeds_width: the hidden size prompt embeddings must have (None: --enable-prompt-embeds is off);
        block_size: the KV cache's (prompt embeddings are hashed in spans that never cross its blocks)."""
        self.tokenizer = tokenizer
        self.prompt_embeds_width = prompt_embeds_width
        self.block_size = block_size
        self.reasoning = reasoning
        self.eos_ids = eos_token_ids(tokenizer, model_path)
        self.max_model_len = max_model_len
        self.pooler = pooler
        self.model_name = model_name
        self.states: dict[str, _RequestState] = {}
        self.child_to_parent: dict[str, str] = {}

    # -- inputs ---------------------------------------------------------------------------------
    def tokenize(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, dict):
            if "prompt_embeds" in prompt:
                raise InvalidPromptError("prompt_embeds are taken by generation requests only (not by pooling, "
                                         "beam search or tokenization)")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _token_ids(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise InvalidPromptError("a dict prompt needs 'prompt' (text) or 'prompt_token_ids'")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidPromptError("the prompt is empty")
            if self.tokenizer is None:
                raise InvalidPromptError("text prompts need a tokenizer (started with --skip-tokenizer-init)")
            return prompt, self.tokenizer.encode(prompt)
        return None, _token_ids(prompt)

    def make_requests(self, request_id: str, prompt: PromptType, params: SamplingParams,
                      cache_salt: Optional[str] = None, priority: int = 0,
                      lora_request: Any = None, multi_modal: Any = None) -> list[EngineCoreRequest]:
        if request_id in self.states:
            raise InvalidPromptError(f"request id {request_id!r} is already in use")
        embeds, spans = None, ()
        if isinstance(prompt, dict) and "prompt_embeds" in prompt:
            # (imported here: prompt_embeds imports this module's InvalidPromptError)
            from voltllm.engine.prompt_embeds import PLACEHOLDER_ID, check_prompt_embeds, embeds_spans

            if self.prompt_embeds_width is None:
                raise InvalidPromptError("prompt_embeds need the engine started with --enable-prompt-embeds",
                                         "prompt_embeds")
            embeds = check_prompt_embeds(prompt["prompt_embeds"], self.prompt_embeds_width)
            if params.prompt_logprobs is not None:
                raise InvalidPromptError("prompt_logprobs are not computed for prompt_embeds (a prompt of embeddings "
                                         "has no token ids to score)")
            text, ids = None, [PLACEHOLDER_ID] * embeds.shape[0]
        else:
            text, ids = self.tokenize(prompt)
        if not ids:
            raise InvalidPromptError("the prompt is empty")
        kept = kept_prompt(ids, params.truncate_prompt_tokens, self.max_model_len)  # (vLLM's offline truncation)
        if len(kept) < len(ids):
            if multi_modal is not None:
                raise InvalidPromptError("truncate_prompt_tokens cannot cut a prompt with images (their tokens and "
                                         "positions are laid out for the whole prompt)")
            text, ids = None, kept
            embeds = embeds[-len(kept):] if embeds is not None else None
        if embeds is not None:
            spans = embeds_spans(embeds, self.block_size)
        if multi_modal is not None and multi_modal.rope_positions.shape[-1] != len(ids):
            raise InvalidPromptError(f"the images' positions cover {multi_modal.rope_positions.shape[-1]} tokens, the "
                                     f"prompt has {len(ids)}")
        params = params.clone(_eos_token_ids=self.eos_ids, _bad_words_token_ids=self._bad_words_ids(params),
                              **self._reasoning_fields(params))
        now = time.monotonic()
        children: dict[str, _Child] = {}
        reqs = []
        for i in range(params.n):
            cid = child_id(request_id, i, params.n)
            # each child of a seeded request gets its own stream: seed + index
            # (wrapped into int64, so the last seeds' children stay valid seeds)
            child_params = params.clone(n=1, seed=None if params.seed is None
                                        else (params.seed + i + 2**63) % 2**64 - 2**63)
            detok = None
            if params.detokenize and self.tokenizer is not None:
                # (an embeddings prompt's placeholder ids are no text to lead the first token's spacing)
                detok = IncrementalDetokenizer(self.tokenizer, ids if embeds is None else [],
                                               params.skip_special_tokens, params.stop,
                                               params.include_stop_str_in_output, params.min_tokens)
            children[cid] = _Child(i, detok, logprobs=[] if params.logprobs is not None else None,
                                   cumulative_logprob=0.0 if params.logprobs is not None else None)
            reqs.append(EngineCoreRequest(cid, ids, child_params, arrival_time=now, cache_salt=cache_salt,
                                          priority=priority, lora_request=lora_request, multi_modal=multi_modal,
                                          prompt_embeds=embeds, prompt_embeds_spans=spans))
        self.states[request_id] = _RequestState(request_id, text, ids, params, children, RequestMetrics(now))
        for cid in children:
            self.child_to_parent[cid] = request_id
        return reqs

    def _bad_words_ids(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """bad_words as token-id sequences (the engine gets only these)."""
        if not params.bad_words:
            return ()
        if self.tokenizer is None:
            raise InvalidRequestError("bad_words need the tokenizer (started with --skip-tokenizer-init)",
                                      "bad_words")
        return bad_words_token_ids(params.bad_words,
                                   lambda text: self.tokenizer.encode(text, add_special_tokens=False))

    def _reasoning_fields(self, params: SamplingParams) -> dict:
        """The reasoning's delimiters for a request with a thinking budget or a grammar (engine/reasoning_state.py);
        InvalidRequestError (a 400) for a budget the server cannot apply."""
        r = self.reasoning
        budget = params.thinking_token_budget
        if budget is not None and r is None:
            raise InvalidRequestError("thinking_token_budget is set but the server knows no reasoning delimiters: "
                                      "start it with --reasoning-parser (or --reasoning-config) to use "
                                      "thinking_token_budget" + (" (and with its tokenizer: not --skip-tokenizer-init)"
                                                                 if self.tokenizer is None else ""),
                                      "thinking_token_budget")
        grammar = params.structured_outputs is not None
        if r is None or (budget is None and not grammar):
            return {}
        if budget is not None and grammar and not r.grammar_after_reasoning:
            raise InvalidRequestError(
                "thinking_token_budget cannot be combined with structured outputs whose grammar constrains the "
                "reasoning too (its forced end would break the grammar): the server needs --reasoning-parser, "
                "without --structured-outputs-config enable_in_reasoning true", "thinking_token_budget")
        after = grammar and r.grammar_after_reasoning
        if budget is None and not after:
            return {}
        return {"_reasoning_start_ids": r.start_ids, "_reasoning_end_ids": r.end_ids,
                "_grammar_after_reasoning": after}

    def make_pooling_request(self, request_id: str, prompt: PromptType, params: Optional[PoolingParams] = None,
                             cache_salt: Optional[str] = None, priority: int = 0) -> EngineCoreRequest:
        """An embedding request (pooling engines): the prompt tokenized and cut to its truncate_prompt_tokens, its
        params resolved against the engine's pooler (PoolingParamsError for a bad one)."""
        if self.pooler is None:
            raise InvalidPromptError("this engine runs a generative model: it computes no embeddings (start it with "
                                     "--runner pooling)")
        if request_id in self.states:
            raise InvalidPromptError(f"request id {request_id!r} is already in use")
        params = self.pooler.resolve(params, self.model_name)
        text, ids = self.tokenize(prompt)
        if not ids:
            raise InvalidPromptError("the prompt is empty")
        kept = kept_prompt(ids, params.truncate_prompt_tokens, self.max_model_len)
        if len(kept) < len(ids):
            text, ids = None, kept
        now = time.monotonic()
        self.states[request_id] = _RequestState(request_id, text, ids, params, {request_id: _Child(0, None)},
                                                RequestMetrics(now), pooling=True)
        self.child_to_parent[request_id] = request_id
        return EngineCoreRequest(request_id, ids, None, arrival_time=now, cache_salt=cache_salt, priority=priority,
                                 pooling_params=params)

    def child_ids(self, request_id: str) -> list[str]:
        st = self.states.get(request_id)
        return list(st.children) if st else []

    def forget(self, request_id: str) -> None:
        st = self.states.pop(request_id, None)
        if st:
            for cid in st.children:
                self.child_to_parent.pop(cid, None)

    # -- outputs --------------------------------------------------------------------------------
    def _decode_logprobs(self, lp: PositionLogprobs) -> dict[int, Logprob]:
        """`lp`: the chosen token and the top-k, each with its vocabulary rank (the engine's order: vLLM's)."""
        dec = self.tokenizer.decode if self.tokenizer is not None else (lambda ids: None)
        return {tid: Logprob(v, rank=r, decoded_token=dec([tid])) for tid, (v, r) in lp.items()}

    def update(self, outputs: list[EngineCoreOutput]) -> tuple[list[_RequestState], list[str]]:
        """Apply engine outputs. Returns the touched parents' states and child ids to abort (stop strings);
        `build(state)` makes a state's cumulative RequestOutput when someone reads it (each build copies the
        token ids and logprobs so far, so building every request every step would cost O(length) per token);
        a finished state is already forgotten here."""
        touched: dict[str, _RequestState] = {}
        to_abort: list[str] = []
        for out in outputs:
            parent = self.child_to_parent.get(out.request_id)
            if parent is None:
                continue
            st = self.states[parent]
            child = st.children[out.request_id]
            if child.finish_reason is not None:
                continue
            st.num_cached_tokens = max(st.num_cached_tokens, out.num_cached_tokens)
            if out.pooled is not None:
                st.pooled = out.pooled
            if out.prompt_logprobs is not None and st.prompt_logprobs is None:
                st.prompt_logprobs = [None if p is None else self._decode_logprobs(p) for p in out.prompt_logprobs]
            if out.first_token_time is not None and st.metrics.first_token_time is None:
                st.metrics.first_token_time = time.monotonic()
            _engine_times(st.metrics, out)
            child.token_ids.extend(out.new_token_ids)
            if out.new_logprobs and child.logprobs is not None:
                for tid, lp in zip(out.new_token_ids, out.new_logprobs):
                    child.logprobs.append(self._decode_logprobs(lp))
                    child.cumulative_logprob += lp[tid][0]
            if child.detok is not None and out.new_token_ids:
                matched = child.detok.add(out.new_token_ids, self._stopped_on_token(st.params, out))
                if matched is not None and out.finish_reason is None:
                    child.finish_reason, child.stop_reason = "stop", matched
                    to_abort.append(out.request_id)
                elif matched is not None:
                    child.finish_reason, child.stop_reason = "stop", matched
            if child.finish_reason is None and out.finish_reason is not None:
                child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
            st.metrics.last_token_time = time.monotonic()
            touched[parent] = st
        for st in touched.values():
            if st.finished:
                st.metrics.finished_time = time.monotonic()
                self.forget(st.request_id)
        return list(touched.values()), to_abort

    @staticmethod
    def _stopped_on_token(params: SamplingParams, out: EngineCoreOutput) -> bool:
        """Whether the engine stopped the request on its last token (EOS or a stop_token_ids entry): that token's
        text is left out unless include_stop_str_in_output (vLLM's rule; the id stays in token_ids / logprobs)."""
        if out.finish_reason != "stop" or not out.new_token_ids:
            return False
        last = out.new_token_ids[-1]
        return last in params._eos_token_ids or last in (params.stop_token_ids or ())

    def build(self, st: _RequestState) -> Union[RequestOutput, PoolingRequestOutput]:
        if st.pooling:
            return PoolingRequestOutput(st.request_id, PoolingOutput(st.pooled) if st.pooled is not None else None,
                                        st.prompt_ids, st.finished, st.prompt, st.num_cached_tokens, st.metrics)
        comps = []
        for c in sorted(st.children.values(), key=lambda c: c.index):
            done = c.finish_reason is not None
            text = c.detok.visible_text(done) if c.detok else ""
            comps.append(CompletionOutput(index=c.index, text=text, token_ids=list(c.token_ids),
                                          cumulative_logprob=c.cumulative_logprob,
                                          logprobs=list(c.logprobs) if c.logprobs is not None else None,
                                          finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return RequestOutput(request_id=st.request_id, prompt=st.prompt, prompt_token_ids=st.prompt_ids,
                             outputs=comps, finished=st.finished, prompt_logprobs=st.prompt_logprobs,
                             num_cached_tokens=st.num_cached_tokens, metrics=st.metrics)
