"""Request state inside the engine core."""
from __future__ import annotations

import enum
import itertools
import time
from typing import Optional, Sequence

import torch

from voltllm.engine.types import EngineCoreRequest, PositionLogprobs
from voltllm.sampling.params import SamplingParams
from voltllm.sampling.repetition import RepetitionDetector

# what a pooling request's sampling fields read as: it samples nothing, so nothing of it asks the sampler for anything
_POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # structured outputs: its grammar is compiling (not schedulable)
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_REPETITION = "repetition"  # repetition_detection found a repeated pattern (vLLM's finish reason)

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "repetition")


_creation_order = itertools.count()  # ties in (priority, arrival time): the request created first goes first


class Request:
    """A request's tokens and how many of them have KV in the cache (num_computed_tokens).

    The scheduler's one rule: each step, computed tokens catch up with all_token_ids.
    """

    def __init__(self, req: EngineCoreRequest, max_model_len: int):
        self.request_id = req.request_id
        self.prompt_token_ids = list(req.prompt_token_ids)
        # a pooling request (pooling engines only) runs its prompt once and finishes with the pooled hidden state
        self.pooling_params = req.pooling_params
        self.is_pooling = req.pooling_params is not None
        self.sampling_params: SamplingParams = _POOLING_SAMPLING if self.is_pooling else req.sampling_params
        self.arrival_time = req.arrival_time or time.monotonic()
        self.cache_salt = req.cache_salt
        # --enable-lora: its adapter (voltllm.lora) and the engine's key of that adapter's load (set by EngineCore when
        # the LoRA manager took it), in its block hashes so that no prefix is shared across adapters (or loads of one)
        # or with the base model
        self.lora_request = req.lora_request
        self.lora_key: Optional[tuple] = None
        # a prompt with images: the runner encodes them and gives their tokens M-RoPE positions; a prompt given as
        # embedding rows: the runner puts them in place of its placeholder ids' embeddings (engine/prompt_embeds.py).
        # Either way (start, end, content hash) spans of its tokens key the prefix-cache blocks they fall in
        self.multi_modal = req.multi_modal
        self.prompt_embeds = req.prompt_embeds
        self.content_spans: tuple[tuple[int, int, bytes], ...] = req.prompt_embeds_spans if req.multi_modal is None \
            else tuple((im.offset, im.end, im.content_hash) for im in req.multi_modal.images)
        self.priority = req.priority
        # --scheduling-policy priority: the waiting queue admits the lowest key first, and the running request with
        # the highest key is the one preempted (engine/request_queue.py, Scheduler)
        self.priority_key = (self.priority, self.arrival_time, next(_creation_order))
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # tokens being sampled by a step in flight (async scheduling): their KV positions are scheduled
        # before their ids are known on the host; the runner takes the ids from the device
        self.num_pending = 0
        self.num_cached_tokens = -1  # prefix-cache hit tokens at first scheduling (-1: not yet)
        self.status = RequestStatus.WAITING
        self.stop_reason: Optional[int | str] = None  # a stop token's id, or "repetition_detected"
        self.block_hashes: list[bytes] = []
        self.spec_token_ids: list[int] = []  # speculation: drafts proposed for the step being scheduled
        self.ngram_index = None  # speculation: the n-gram proposer's index of this request's tokens
        self.suffix_state = None  # speculation: suffix decoding's automaton of them (suffix_decoding.SuffixState)
        sp = self.sampling_params
        room = max_model_len - self.num_prompt_tokens
        self.max_tokens = min(sp.max_tokens, room) if sp.max_tokens is not None else room
        if self.is_pooling:  # (it produces no token; 1 keeps the scheduler from taking it for done before its end)
            self.max_tokens = 1
        self.argmax_only = sp.argmax_only  # (the params are final here) the sampler's fast path, per step
        # penalties count the earlier tokens' ids, multi-token bad words compare the latest ones, prompt logprobs
        # need the prompt pass's rows: such a step waits for the one in flight (min_tokens needs only their number:
        # SamplingRow). Structured outputs' masks depend on the previous token too, but only the sampling needs
        # them: such a step launches its forward first, then waits (EngineCore._step)
        self.needs_host_history = (sp.has_penalties or sp.bad_words_history > 0
                                   or sp.prompt_logprobs is not None)
        self.grammar = None  # structured outputs: its xgrammar matcher (structured/matchers.py), while it runs
        # a thinking budget or a grammar after the reasoning: where it stands in its reasoning (reasoning_state.py)
        self.reasoning = None
        self.generator: Optional[torch.Generator] = None
        # repetition_detection: the detector the scheduler feeds each output token (None: no check, no cost)
        self.repetition = RepetitionDetector(sp.repetition_detection) if sp.repetition_detection else None
        self.prompt_logprobs: list[Optional[PositionLogprobs]] = []
        self.new_logprobs: list[PositionLogprobs] = []
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None
        self.scheduled_time: Optional[float] = None
        self.num_preemptions = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.all_token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    def sampling_history(self) -> Sequence[int]:
        """The generated ids the sampler reads this step: all of them for penalties, the latest
        bad_words_history for bad words (a copy of that many), none otherwise. Complete only when no step is in
        flight (needs_host_history makes the engine wait for it)."""
        sp = self.sampling_params
        if sp.has_penalties:
            return self.output_token_ids
        k = sp.bad_words_history
        if k == 0:
            return ()
        return self.all_token_ids[max(self.num_prompt_tokens, len(self.all_token_ids) - k):]

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

