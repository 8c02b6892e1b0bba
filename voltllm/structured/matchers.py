"""The engine core's grammar matchers: one per constrained request, advanced by the tokens the scheduler appends.

The engine learns each request's tokens in Scheduler.update, so the matchers live here, in the engine core: a
request's matcher accepts every token appended to it (the tokens never change, so preemption and recompute keep
the matcher as it is), and is dropped when the request finishes or is aborted. Before a step samples, each
constrained request that samples in it gets its row of allowed tokens (`masks`): the mask depends on the request's
previous token, so under async scheduling the engine core launches such a step's forward, then collects the step in
flight (the matchers accept its tokens), then fills the masks and launches the sampling (EngineCore._step).

Compiling happens off the engine loop: the first constrained request's tokenizer load, xgrammar's TokenizerInfo
and GrammarCompiler (seconds for a large vocabulary), and every grammar not in the cache, are built by one
background thread (xgrammar's compile releases the GIL). A request whose grammar is compiling waits outside the
scheduler's queue (Scheduler.waiting_for_grammar) until `poll` hands it its matcher, or its error; a cache hit gets
its matcher at once, without the thread.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from voltllm.engine.reasoning_state import ON, OPEN
from voltllm.engine.request import Request, RequestStatus
from voltllm.engine.request_checks import InvalidRequestError

logger = logging.getLogger("voltllm")

COMPILED_CACHE_SIZE = 128  # compiled grammars kept by key (a schema's compiled form is ~KBs to MBs)


@dataclass
class GrammarMasks:
    """One step's allowed-token rows (host int32, xgrammar's bitmask layout) of its constrained sampling requests,
    and the constrained requests that draft in it (speculation): their verification rows' masks follow the drafts,
    which a drafter on the device makes only as the step runs (`verification`)."""

    rows: dict[str, int]  # request id -> row of `bitmask`
    bitmask: torch.Tensor  # [len(rows), words]
    drafting: dict[str, Request] = field(default_factory=dict)  # request id -> request, its grammar applying

    def for_requests(self, request_ids: list[str]) -> Optional[tuple[list[int], torch.Tensor]]:
        """For sampling rows of these requests, in this order: the rows that are constrained and their bitmask rows
        (host int32 [len(rows), words]); None when none is."""
        picks = [(i, self.rows[rid]) for i, rid in enumerate(request_ids) if rid in self.rows]
        if not picks:
            return None
        dst, src = zip(*picks)
        words = self.bitmask if list(src) == list(range(len(self.rows))) else self.bitmask[list(src)]
        return list(dst), words

    def verification(self, drafts: list[tuple[str, list[int]]]) -> Optional[tuple[list[int], torch.Tensor]]:
        """A verification's masks: `drafts` lists each drafting request's id and drafts in the verification's
        order (its rows: one per draft and the one after). Returns the constrained rows and their bitmask rows
        (host int32), as for_requests; None when none is constrained."""
        picks, at = [], 0
        for rid, d in drafts:
            if rid in self.drafting:
                picks.append((at, self.drafting[rid].grammar, d))
            at += len(d) + 1
        if not picks:
            return None
        words = torch.full((sum(len(d) + 1 for _, _, d in picks), self.bitmask.shape[1]), -1, dtype=torch.int32)
        dst, row = [], 0
        for at, matcher, d in picks:
            draft_masks(matcher, d, words, row)
            dst += range(at, at + len(d) + 1)
            row += len(d) + 1
        return dst, words


def draft_masks(matcher: Any, drafts: list[int], bitmask: torch.Tensor, first: int) -> None:
    """Rows first .. first + len(drafts) of `bitmask` (all-allowed on entry): row j, the tokens the grammar allows
    after drafts[:j]. From a draft the grammar refuses on (or after one that ends it) the rows stay all-allowed: the
    masked verification rejects that draft, so no later row is emitted. The matcher is left as it was."""
    taken = 0
    for j in range(len(drafts) + 1):
        matcher.fill_next_token_bitmask(bitmask, first + j)
        if j == len(drafts) or not matcher.accept_token(drafts[j]):
            break
        taken += 1
        if matcher.is_terminated():
            break
    if taken:
        matcher.rollback(taken)


def valid_drafts(matcher: Any, drafts: list[int]) -> list[int]:
    """The longest prefix of known drafts (n-gram, suffix) the grammar accepts: rows past a refused draft would be
    verified for nothing. The matcher is left as it was."""
    taken = 0
    for tok in drafts:
        if matcher.is_terminated() or not matcher.accept_token(tok):
            break
        taken += 1
    if taken:
        matcher.rollback(taken)
    return drafts[:taken]


def grammar_applies(req: Request) -> bool:
    """The request's grammar masks its next position whatever that token is: it has one and no reasoning comes
    first (none, or it has ended: ReasoningState ON). Such a request may draft (speculative.spec_allowed)."""
    return req.grammar is not None and (req.reasoning is None or req.reasoning.grammar == ON)


class GrammarMatchers:
    """Compiles constraints (cached by key) against the model's vocabulary and keeps the live matchers.

    tokenizer_loader: returns the HF tokenizer (called once, in the compile thread, on the first constrained request
    that needs a compile); None when the engine has no tokenizer (--skip-tokenizer-init: constrained requests are
    refused when they arrive). vocab_size: the model's logits width, which may exceed the tokenizer's.
    json_any_whitespace: JSON grammars take free whitespace (--structured-outputs-config disable_any_whitespace
    false); fixed for the engine, so the compiled cache, per engine, needs no more than the constraint's key."""

    def __init__(self, tokenizer_loader: Optional[Callable[[], Any]], vocab_size: int,
                 json_any_whitespace: bool = False):
        self._load_tokenizer = tokenizer_loader
        self.vocab_size = vocab_size
        self.json_any_whitespace = json_any_whitespace
        self._compiler: Any = None  # (built and read in the compile thread only)
        # why structured outputs cannot work with this tokenizer, once the compile thread has found out: later
        # requests are refused when they arrive
        self._compiler_error: Optional[str] = None
        self._compiled: OrderedDict = OrderedDict()  # (main thread only; the compile thread returns its results)
        self.live: dict[str, Any] = {}  # request id -> xgrammar GrammarMatcher
        self.waiting: dict[str, tuple[tuple[str, str], Request]] = {}  # request id -> (key, request) compiling
        self.compiling: dict[tuple[str, str], concurrent.futures.Future] = {}  # key -> its compile, while awaited
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._wake: Optional[tuple[int, int]] = None  # a pipe written when a compile ends (wake_fd)

    def __len__(self) -> int:
        """Grammar state held for live requests: matchers, and requests waiting for one."""
        return len(self.live) + len(self.waiting)

    # -- compiling (in the background thread) -----------------------------------------------------
    def _compiler_or_fail(self) -> Any:
        if self._compiler_error is not None:  # (requests queued behind the compile that found it out)
            raise InvalidRequestError(self._compiler_error, "structured_outputs")
        if self._compiler is None:
            import xgrammar as xgr

            tokenizer = self._load_tokenizer()
            if tokenizer is None:
                self._compiler_error = "structured outputs need the model's tokenizer"
                raise InvalidRequestError(self._compiler_error, "structured_outputs")
            try:
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
            except Exception as e:  # a tokenizer xgrammar cannot read: refuse the request, keep the engine
                self._compiler_error = f"structured outputs are not available with this tokenizer: {e}"
                raise InvalidRequestError(self._compiler_error, "structured_outputs") from None
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # cached here, by key
        return self._compiler

    def _build(self, key: tuple[str, str]) -> Any:
        """The compiled grammar of a key (runs in the compile thread); InvalidRequestError when it cannot be built."""
        from voltllm.sampling.structured import StructuredOutputsError
        from voltllm.structured.grammar import grammar_for, xgrammar_message

        compiler = self._compiler_or_fail()
        try:
            if key[0] == "structural_tag":  # (from its text: token formats resolve against the vocabulary here)
                grammar_for(key)  # checked as in the API process first: the same messages
                return compiler.compile_structural_tag(key[1])
            return compiler.compile_grammar(grammar_for(key, self.json_any_whitespace))
        except StructuredOutputsError as e:
            raise InvalidRequestError(f"structured outputs: {e}", "structured_outputs") from None
        except (RuntimeError, ValueError) as e:
            what = "invalid structural tag: " if key[0] == "structural_tag" else ""
            raise InvalidRequestError(f"structured outputs: {what}{xgrammar_message(e)}",
                                      "structured_outputs") from None

    def _submit(self, key: tuple[str, str]) -> concurrent.futures.Future:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="voltllm-grammar")
        fut = self._pool.submit(self._build, key)
        fut.add_done_callback(self._signal)
        return fut

    # -- waking the engine loop -------------------------------------------------------------------
    @property
    def wake_fd(self) -> int:
        """A file descriptor that becomes readable when a compile ends (the engine process polls it beside its
        input socket while it has nothing else to do); `poll` drains it."""
        if self._wake is None:
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            self._wake = (r, w)
        return self._wake[0]

    def _signal(self, _fut: concurrent.futures.Future) -> None:
        if self._wake is not None:
            try:
                os.write(self._wake[1], b"\0")
            except (BlockingIOError, OSError):  # full (the loop is awake anyway) or closed (shutting down)
                pass

    def drain_wake(self) -> None:
        if self._wake is not None:
            try:
                while os.read(self._wake[0], 4096):
                    pass
            except (BlockingIOError, OSError):
                pass

    def wait(self, timeout: float) -> None:
        """Block until one of the compiles awaited ends, or `timeout` seconds."""
        if self.compiling:
            concurrent.futures.wait(list(self.compiling.values()), timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._wake is not None:
            wake, self._wake = self._wake, None
            for fd in wake:
                os.close(fd)

    # -- requests (engine loop) -------------------------------------------------------------------
    def attach(self, req: Request) -> bool:
        """Give a constrained request its matcher: True when it has it now (a cached grammar); False when its grammar
        is compiling (the request waits: `poll` gives it its matcher later). InvalidRequestError when the request
        cannot be served and that is known now (no tokenizer, or one xgrammar could not read). Its stop tokens are
        the request's EOS ids when it has them, so a finished grammar ends with a token the engine stops on."""
        if self._load_tokenizer is None:
            raise InvalidRequestError("structured outputs need the model's tokenizer (the engine was started with "
                                      "--skip-tokenizer-init)", "structured_outputs")
        if self._compiler_error is not None:
            raise InvalidRequestError(self._compiler_error, "structured_outputs")
        key = req.sampling_params.structured_outputs.key
        compiled = self._compiled.get(key)
        if compiled is not None:
            self._compiled.move_to_end(key)
            self._start(req, compiled)
            return True
        if key not in self.compiling:
            self.compiling[key] = self._submit(key)
        self.waiting[req.request_id] = (key, req)
        return False

    def _start(self, req: Request, compiled: Any) -> None:
        import xgrammar as xgr

        stops = list(req.sampling_params._eos_token_ids) or None
        self.live[req.request_id] = req.grammar = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)

    def poll(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """The waiting requests whose compile has ended: those that now have their matcher, and those whose compile
        failed, with the error message."""
        self.drain_wake()
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        for key, fut in list(self.compiling.items()):
            if not fut.done():
                continue
            del self.compiling[key]
            compiled = error = None
            try:
                compiled = fut.result()
            except InvalidRequestError as e:
                error = str(e)
            except Exception as e:  # noqa: BLE001 - one request's failure, not the engine's
                logger.exception("structured outputs: compiling %s failed", key[0])
                error = f"structured outputs: compiling the {key[0]} constraint failed: {type(e).__name__}: {e}"
            if compiled is not None:
                self._compiled[key] = compiled
                if len(self._compiled) > COMPILED_CACHE_SIZE:
                    self._compiled.popitem(last=False)
            for rid, (k, req) in list(self.waiting.items()):
                if k != key:
                    continue
                del self.waiting[rid]
                if compiled is not None:
                    self._start(req, compiled)
                    ready.append(req)
                else:
                    failed.append((req, error))
        return ready, failed

    def release(self, req: Request) -> None:
        """Drop a finished or aborted request's matcher, or its place in a compile's queue (the compile is cancelled
        when nobody else waits for it; one already running ends in its thread and its result is dropped)."""
        if req.grammar is not None:
            req.grammar = None
            self.live.pop(req.request_id, None)
        entry = self.waiting.pop(req.request_id, None)
        if entry is not None:
            key = entry[0]
            if not any(k == key for k, _ in self.waiting.values()):
                self.compiling.pop(key).cancel()

    def accept(self, req: Request, token: int) -> Optional[RequestStatus]:
        """Advance the request's matcher by its new token; FINISHED_STOPPED when the grammar has ended (or, which the
        mask should make impossible, refuses the token), else None."""
        matcher = req.grammar
        if not matcher.accept_token(token):
            logger.warning("request %s: token %d is outside its grammar (min_tokens banning the grammar's end?); "
                           "finishing it", req.request_id, token)
            return RequestStatus.FINISHED_STOPPED
        return RequestStatus.FINISHED_STOPPED if matcher.is_terminated() else None

    def masks(self, scheduled: list) -> Optional[GrammarMasks]:
        """Allowed-token rows for the requests that sample in this step and are constrained at this position
        (ScheduledRequest list): a grammar's (with the reasoning's first token beside it where the first output
        token may open the reasoning), or a single forced token (a thinking budget's end:
        engine/reasoning_state.py). A request inside its reasoning, and a budget request short
        of its budget, get none. Constrained requests that draft are listed for their verification instead."""
        rows: list[tuple[Request, Optional[int], Optional[int]]] = []  # (request, forced token, extra token)
        drafting: dict[str, Request] = {}
        for s in scheduled:
            if not s.samples:
                continue
            r = s.request
            if s.spec_tokens:  # (masked in its verification: GrammarMasks.verification)
                if grammar_applies(r):
                    drafting[r.request_id] = r
                continue
            st = r.reasoning
            if st is None:
                if r.grammar is not None:
                    rows.append((r, None, None))
                continue
            forced = st.forced()
            if forced is not None:
                rows.append((r, forced, None))
            elif r.grammar is not None and st.grammar in (OPEN, ON):
                rows.append((r, None, st.start[0] if st.grammar == OPEN else None))
        if not rows and not drafting:
            return None
        bitmask = torch.full((len(rows), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        for i, (r, forced, extra) in enumerate(rows):
            if forced is not None:
                bitmask[i] = 0
                _allow(bitmask, i, forced)
                continue
            r.grammar.fill_next_token_bitmask(bitmask, i)
            if extra is not None:
                _allow(bitmask, i, extra)
        return GrammarMasks({r.request_id: i for i, (r, _, _) in enumerate(rows)}, bitmask, drafting)


def _allow(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Set token's bit in a row of an int32 bitmask (xgrammar's layout: bit j of word w is token 32 * w + j)."""
    word, bit = divmod(token, 32)
    value = (1 << bit) - (1 << 32 if bit == 31 else 0)  # (as a signed int32)
    bitmask[row, word] = int(bitmask[row, word]) | value
