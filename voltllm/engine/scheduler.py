"""Token-budget scheduler with one rule: each request's computed tokens catch up with its tokens.

Prefill, chunked prefill, prefix-cache hits and decode are all "compute the next k tokens of this
request". Running requests go first (oldest first); waiting ones are admitted while the token budget,
--max-num-seqs and free blocks allow. When blocks run out, the newest running request is preempted:
its blocks are freed and it is recomputed later from its tokens (prompt + output so far), so its
output is the same as if it had never been preempted.

--scheduling-policy priority keeps both queues ordered by `Request.priority_key` (priority, arrival):
waiting requests are admitted lowest key first, running ones go lowest key first, and the last running
one, the lowest priority, is the one preempted (vLLM's victim). No running request is preempted to
admit a waiting one (nor is it in vLLM).
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from voltllm.cache.kv_manager import KVCacheManager
from voltllm.config import SchedulerConfig
from voltllm.engine.request import Request, RequestStatus
from voltllm.engine.request_queue import make_waiting_queue
from voltllm.engine.speculative import DRAFT_PLACEHOLDER, NgramIndex, SpeculativeConfig, spec_allowed
from voltllm.engine.suffix_decoding import SuffixProposer
from voltllm.engine.types import EngineCoreOutput, PositionLogprobs, SchedulerStats
from voltllm.sampling.repetition import STOP_REASON as REPETITION_STOP_REASON
from voltllm.structured.matchers import grammar_applies, valid_drafts


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    start: int  # num_computed_tokens before this step
    block_ids: list[int]
    samples: bool  # this step reaches the end of the request's tokens, so a new token is sampled
    block_array: np.ndarray  # block_ids as int32 (the runner copies its block-table row from it)
    spec_tokens: Sequence[int] = ()  # draft tokens after the known ones (speculation)
    pools: bool = False  # a pooling request's last prompt chunk: its hidden state is pooled (it samples nothing)


# steps whose token counts wait for the next stats() at most (the API process takes them every step)
MAX_STEP_TOKENS_KEPT = 4096


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    total_tokens: int = 0
    num_sampled: int = 0  # scheduled rows that sample a token this step
    # requests that finished, were aborted or preempted since the last step: the runner drops their
    # per-request state (recurrent-state slots) before this step runs
    released_ids: list[str] = field(default_factory=list)
    # structured outputs: the allowed tokens of this step's constrained sampling requests (structured.GrammarMasks),
    # set by the engine core once their previous tokens are known
    grammar_masks: Optional[object] = None
    # --kv-offloading-size: the step's copies between GPU blocks and the CPU tier (cache/cpu_offload.py KVTransfers),
    # which every rank runs before the step's forward
    kv_transfers: Optional[object] = None

    @property
    def empty(self) -> bool:
        return not self.scheduled


@dataclass
class RunnerOutput:
    """What the model runner returns for one step, keyed by request id."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[Optional[PositionLogprobs]]] = field(default_factory=dict)
    # speculation: the tokens a verified step emits (accepted drafts, then the model's next token), and for requests
    # that asked for logprobs one entry per emitted token
    verified: dict[str, list[int]] = field(default_factory=dict)
    verified_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    # pooling engines: the embedding of each request whose prompt ended in the step (CPU float32 tensors)
    pooled: dict[str, Any] = field(default_factory=dict)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, spec: Optional[SpeculativeConfig] = None,
                 max_loras: int = 0):
        """max_loras: --enable-lora's --max-loras (0: off): the running batch holds at most that many distinct
        adapters, so each step's adapters fit the runner's GPU slots."""
        self.config = config
        self.kv = kv
        self.spec = spec
        # the most drafts a request may take this step (dynamic speculative decoding: by the running batch's size)
        self._step_drafts = spec.num_speculative_tokens if spec is not None else 0
        # suffix decoding: its cache of recent outputs, and each request's automaton (freed when it finishes)
        self.suffix = None if spec is None or not spec.uses_suffix else SuffixProposer(
            spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
            spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob)
        self.max_loras = max_loras
        self.num_draft_tokens = 0  # speculation: drafts scored, and accepted
        self.num_accepted_tokens = 0
        self.num_drafts = 0  # verifications of a request's drafts (vLLM's spec_decode_num_drafts)
        k = spec.num_speculative_tokens if spec is not None else 0
        self.drafted_per_pos = [0] * k  # drafts scored / accepted at each position (0: the first draft)
        self.accepted_per_pos = [0] * k
        self.waiting = make_waiting_queue(config.policy)
        self._by_priority = config.policy == "priority"  # the running list is kept in priority_key order
        # structured outputs: requests whose grammar is compiling (in the background); they join `waiting` when it
        # is ready (grammar_ready), and are not scheduled before
        self.waiting_for_grammar: dict[str, Request] = {}
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.step_counter = 0
        self._step_tokens: list[int] = []  # each step's scheduled tokens since the last stats() (SchedulerStats)
        self._aborted_outputs: list[EngineCoreOutput] = []
        self._released: list[str] = []
        # structured outputs: the engine core's GrammarMatchers (structured/matchers.py), set when it has one
        self.grammars = None
        # thinking budgets / grammars after the reasoning: the engine core's ReasoningStates (reasoning_state.py)
        self.reasoning = None

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, req: Request, ready: bool = True) -> None:
        """ready: False for a constrained request whose grammar is still compiling (it waits for grammar_ready)."""
        self.requests[req.request_id] = req
        if ready:
            self.waiting.add(req)
        else:
            req.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar[req.request_id] = req

    def grammar_ready(self, req: Request) -> None:
        """A waiting constrained request has its matcher: it joins the queue (at its end; under priority, by its
        key)."""
        del self.waiting_for_grammar[req.request_id]
        req.status = RequestStatus.WAITING
        self.waiting.add(req)

    def drop(self, req: Request) -> None:
        """Finish a request that failed before it ran (its grammar did not compile); the caller reports why, so no
        abort notice is sent."""
        self._finish(req, RequestStatus.FINISHED_ABORTED)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            self._aborted_outputs.append(EngineCoreOutput(rid, [], finish_reason="abort"))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_grammar)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        compiling = req.status is RequestStatus.WAITING_FOR_GRAMMAR
        if compiling:
            del self.waiting_for_grammar[req.request_id]
        elif req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        if req.grammar is not None or compiling:
            self.grammars.release(req)
        if req.reasoning is not None:
            self.reasoning.release(req)
        if req.suffix_state is not None:
            self.suffix.release(req)
        self.requests.pop(req.request_id, None)
        self._released.append(req.request_id)

    # -- scheduling -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        # --long-prefill-token-threshold: one request's share of a step (no cap: the whole budget)
        cap = self.config.long_prefill_token_threshold or budget
        out = SchedulerOutput()
        out.released_ids, self._released = self._released, []
        preempted_now = False
        scheduled_ids: set[str] = set()

        i = 0
        kv, running = self.kv, self.running  # (the loop runs once per running request and step)
        if self.spec is not None and self.spec.draft_schedule:
            self._step_drafts = self.spec.drafts_for_batch(len(running))
        while i < len(running) and budget > 0:
            req = running[i]
            with_pending = len(req.all_token_ids) + req.num_pending
            if with_pending - req.num_prompt_tokens >= req.max_tokens:
                i += 1  # its last token is in flight; it finishes when that arrives
                continue
            computed = req.num_computed_tokens
            if self.spec is not None and with_pending - computed == 1:  # decoding: guess the next tokens
                req.spec_token_ids = self._propose(req, min(budget, cap) - 1)
            num_new = min(with_pending + len(req.spec_token_ids) - computed, budget, cap)
            num_new = kv.cap_new_tokens(req, computed, num_new)  # hybrid snapshot boundaries
            if num_new <= 0:
                i += 1
                continue
            while True:
                if kv.allocate_slots(req, num_new) is not None:
                    self._add(out, req, num_new, with_pending)
                    scheduled_ids.add(req.request_id)
                    budget -= num_new
                    i += 1
                    break
                victim = self.running[-1]  # fcfs: the newest; priority: the largest (priority, arrival)
                if victim.request_id in scheduled_ids:
                    raise RuntimeError("KV cache too small to run even one request at --max-model-len; "
                                       "raise the KV memory or lower --max-model-len")
                self._preempt(victim)
                preempted_now = True
                if victim is req:
                    break

        # --max-loras: a waiting request whose adapter would be one too many is passed over (it keeps its place, as in
        # vLLM); the others may still be admitted
        loras = {r.lora_key for r in running if r.lora_key} if self.max_loras else None
        passed_over: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted_now:
            req = self.waiting.peek()
            if loras is not None and req.lora_key and req.lora_key not in loras and len(loras) >= self.max_loras:
                passed_over.append(self.waiting.pop())
                continue
            hit_blocks, num_hit = ([], 0)
            if req.num_computed_tokens == 0:
                hit_blocks, num_hit = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens_with_pending - req.num_computed_tokens - num_hit, budget, cap)
            num_new = self.kv.cap_new_tokens(req, req.num_computed_tokens + num_hit, num_new)
            if self.kv.allocate_slots(req, num_new, hit_blocks) is None:
                if not self.running:
                    need = -(-req.num_tokens // self.kv.block_size)
                    if need > self.kv.num_blocks:
                        # can never fit: fail it rather than wait forever
                        self.waiting.pop()
                        self._finish(req, RequestStatus.FINISHED_ABORTED)
                        self._aborted_outputs.append(EngineCoreOutput(req.request_id, [], finish_reason="abort",
                                                                      stop_reason="kv cache too small"))
                        continue
                break
            self.waiting.pop()
            req.num_computed_tokens += num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            if self._by_priority:  # (the victim of a preemption is the last: the highest key)
                bisect.insort(self.running, req, key=lambda r: r.priority_key)
            else:
                self.running.append(req)
            self._add(out, req, num_new)
            budget -= num_new
            if loras is not None and req.lora_key:
                loras.add(req.lora_key)
        for req in reversed(passed_over):  # back at the head, in their order (under priority: by their keys)
            self.waiting.requeue(req)
        out.kv_transfers = self.kv.take_transfers()  # (only allocations that scheduled a request make any)
        self.step_counter += 1
        if out.total_tokens:
            self._step_tokens.append(out.total_tokens)
            if len(self._step_tokens) > MAX_STEP_TOKENS_KEPT:  # (an offline LLM never asks for its stats)
                del self._step_tokens[:-MAX_STEP_TOKENS_KEPT]
        return out

    def _propose(self, req: Request, max_new: int) -> list[int]:
        """Drafts for a decoding request (none where speculation cannot keep its output exact): n-gram or suffix
        ones, or placeholders for a draft model's, which the runner fills before the step runs (their slots are
        allocated here, with the step's)."""
        room = self.spec.drafts_room(len(req.all_token_ids))  # (speculative max_model_len: plain beyond it)
        k = spec_allowed(req, min(self._step_drafts, max_new, room if room is not None else max_new))
        reasoning = req.reasoning
        if self.suffix is not None:  # (its automata take every token, also in steps that may not speculate)
            drafts = self.suffix.propose(req, k)
        elif k <= 0:
            return []
        elif self.spec.drafts_on_device:
            # a grammar waiting for the end of reasoning takes only drafts it can check (they may end it)
            return [] if reasoning is not None and reasoning.drafts_must_be_known else [DRAFT_PLACEHOLDER] * k
        else:
            index = req.ngram_index
            if index is None:
                index = req.ngram_index = NgramIndex(self.spec.prompt_lookup_min, self.spec.prompt_lookup_max)
            drafts = index.propose(req.all_token_ids, k)
        if drafts and grammar_applies(req):  # (known drafts past one the grammar refuses would be verified for nothing)
            return valid_drafts(req.grammar, drafts)
        return reasoning.cut_drafts(drafts) if reasoning is not None else drafts

    def _add(self, out: SchedulerOutput, req: Request, num_new: int, with_pending: Optional[int] = None) -> None:
        """with_pending: req.num_tokens_with_pending, when the caller has it."""
        start = req.num_computed_tokens
        with_pending = req.num_tokens_with_pending if with_pending is None else with_pending
        at_end = start + num_new >= with_pending
        pools = at_end and req.is_pooling  # (a pooling request's end is pooled, never sampled)
        samples = at_end and not pools
        spec = ()
        if req.spec_token_ids:  # (most steps have none: no allocation then)
            spec = req.spec_token_ids[: max(0, start + num_new - with_pending)]
            req.spec_token_ids = []
        out.scheduled.append(ScheduledRequest(req, num_new, start, self.kv.block_ids(req), samples,
                                              self.kv.block_array(req), spec, pools))
        out.total_tokens += num_new
        req.num_computed_tokens = start + num_new  # advanced now, so the next step can be scheduled early
        if samples:
            req.num_pending += 1
            out.num_sampled += 1

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0  # a token in flight stays pending and is recomputed with the rest
        self._released.append(req.request_id)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.requeue(req)

    # -- results --------------------------------------------------------------------------------
    def take_abort_notices(self) -> list[EngineCoreOutput]:
        out, self._aborted_outputs = self._aborted_outputs, []
        return out

    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[EngineCoreOutput]:
        # once per step for every running request: locals and positional constructors keep it ~1 us a request
        now = time.monotonic()
        outputs = self.take_abort_notices()
        requests, sampled = self.requests, result.sampled
        logprobs, prompt_lps = result.logprobs, result.prompt_logprobs
        max_len = self.config.max_model_len
        for s in sched.scheduled:
            req = s.request
            rid = req.request_id
            if requests.get(rid) is not req:
                continue  # finished or aborted while the step ran (its id may even be running again, anew)
            if s.pools:  # its prompt is done: it finishes with its embedding, and frees its blocks now
                if rid in result.pooled:
                    outputs.append(self._finish_pooled(req, result.pooled[rid], now))
                continue
            plp = prompt_lps.get(rid) if prompt_lps else None
            if plp:  # entries for prompt tokens start+1, start+2, ...; keep only ones not seen before
                req.prompt_logprobs.extend(plp[len(req.prompt_logprobs) - s.start:])
            token = sampled.get(rid)
            if token is None:
                continue
            req.num_pending -= 1
            tokens = req.all_token_ids
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            if s.spec_tokens:  # a verified speculative step: several tokens, each checked for a stop
                new, status = self._append_verified(req, s.spec_tokens, result.verified[rid], max_len)
                lps = result.verified_logprobs.get(rid)
                lps = lps[:len(new)] if lps else None
            else:
                tokens.append(token)
                new = [token]
                lp = logprobs.get(rid) if logprobs else None
                lps = [lp] if lp is not None else None
                status = self._check_stop(req, token, len(tokens) - req.num_prompt_tokens, len(tokens) >= max_len)
                if req.reasoning is not None or req.grammar is not None:  # (most requests have neither)
                    status = self._constraints_accept(req, token, status)
            num_out = len(tokens) - req.num_prompt_tokens
            out = EngineCoreOutput(rid, new, None, None, lps, None, max(req.num_cached_tokens, 0),
                                   req.first_token_time, now, req.scheduled_time)
            if num_out == 1 and req.wants_prompt_logprobs:
                out.prompt_logprobs = [None] + req.prompt_logprobs[: req.num_prompt_tokens - 1]
            if status is not None:
                out.finish_reason = status.value
                out.stop_reason = req.stop_reason
                self._finish(req, status)
            outputs.append(out)
        return outputs

    def _finish_pooled(self, req: Request, pooled: Any, now: float) -> EngineCoreOutput:
        req.first_token_time = req.last_token_time = now  # (its one result: the prefill phase ends here)
        out = EngineCoreOutput(req.request_id, [], RequestStatus.FINISHED_STOPPED.value, None, None, None,
                               max(req.num_cached_tokens, 0), now, now, req.scheduled_time, pooled)
        self._finish(req, RequestStatus.FINISHED_STOPPED)
        return out

    def _append_verified(self, req: Request, drafts: list[int], verified: list[int],
                         max_len: int) -> tuple[list[int], Optional[RequestStatus]]:
        """Append a speculative step's tokens up to the first stop; the cache keeps the accepted drafts' KV (all
        tokens but the last are computed), the rejected ones' slots are written again later."""
        tokens = req.all_token_ids
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += len(verified) - 1
        self.num_drafts += 1
        for pos in range(len(drafts)):
            self.drafted_per_pos[pos] += 1
        for pos in range(len(verified) - 1):
            self.accepted_per_pos[pos] += 1
        status = None
        for i, tok in enumerate(verified):
            tokens.append(tok)
            status = self._check_stop(req, tok, len(tokens) - req.num_prompt_tokens, len(tokens) >= max_len)
            # (a grammar gets no drafts once it applies: spec_allowed; while it waits, none that end the reasoning
            # before the step's last token: ReasoningState.cut_drafts)
            status = self._constraints_accept(req, tok, status)
            if status is not None:
                verified = verified[: i + 1]
                break
        req.num_computed_tokens = len(tokens) - 1
        return verified, status

    def _constraints_accept(self, req: Request, token: int, status: Optional[RequestStatus]) -> Optional[RequestStatus]:
        """Advance the request's reasoning state and, when the token is its grammar's, its matcher (a grammar after
        the reasoning starts with the token after the reasoning's end); the matcher may finish the request."""
        grammar_token = req.reasoning.accept(token) if req.reasoning is not None else True
        if status is None and req.grammar is not None and grammar_token:
            return self.grammars.accept(req, token)
        return status

    @staticmethod
    def _check_stop(req: Request, token: int, num_out: int, at_max_len: bool) -> Optional[RequestStatus]:
        sp = req.sampling_params
        # (every output token goes to the detector, also those min_tokens holds back from the check, as vLLM
        # checks the whole output)
        repeated = req.repetition is not None and req.repetition.append(token)
        if num_out >= sp.min_tokens:
            if not sp.ignore_eos and token in sp._eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in sp.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_out >= req.max_tokens or at_max_len:
            return RequestStatus.FINISHED_LENGTH
        if repeated and num_out >= sp.min_tokens:  # after the stops and the length, as vLLM's check_stop
            req.stop_reason = REPETITION_STOP_REASON
            return RequestStatus.FINISHED_REPETITION
        return None

    def stats(self) -> SchedulerStats:
        """The current state, and the token counts of the steps scheduled since the last call (handed over once)."""
        steps, self._step_tokens = self._step_tokens, []
        residency = self.kv.pool.residency
        return SchedulerStats(iteration_tokens=steps,
            kv_block_samples=residency.take() if residency is not None else {},
            num_running=len(self.running), num_waiting=len(self.waiting) + len(self.waiting_for_grammar),
            kv_cache_usage=self.kv.usage(),
            prefix_cache_queries=self.kv.prefix_queries, prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.num_preemptions, num_blocks=self.kv.num_blocks, step_counter=self.step_counter,
            extra=self._extra_stats())

    def _extra_stats(self) -> dict:
        """Stats of the optional features: speculation's draft counts, the CPU KV tier's lookups, --enable-lora's
        adapters (running / waiting adapter names, as vLLM's lora_requests_info gauge labels them)."""
        extra: dict = {}
        if self.spec is not None:
            extra.update(spec_draft_tokens=self.num_draft_tokens, spec_accepted_tokens=self.num_accepted_tokens,
                         spec_drafts=self.num_drafts, spec_drafted_per_pos=list(self.drafted_per_pos),
                         spec_accepted_per_pos=list(self.accepted_per_pos))
        if self.kv.cpu is not None:  # --kv-offloading-size: the CPU tier's lookups, as vLLM's KV connector's
            extra.update(external_prefix_cache_queries=self.kv.cpu_queries,
                         external_prefix_cache_hits=self.kv.cpu_hit_tokens)
        if self.max_loras:
            waiting = list(self.waiting) + list(self.waiting_for_grammar.values())
            extra.update(max_lora=self.max_loras,
                         lora_running=sorted({r.lora_request.lora_name for r in self.running if r.lora_key}),
                         lora_waiting=sorted({r.lora_request.lora_name for r in waiting if r.lora_key}))
        return extra
