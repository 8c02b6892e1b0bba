"""The engine core's grammar matchers: one per constrained request, advanced by the tokens the scheduler appends.

The engine learns each request's tokens in Scheduler.update, so the matchers live here, in the engine core: a
request's matcher accepts every token appended to it (the tokens never change, so preemption and recompute keep
the matcher as it is), and is dropped when the request finishes or is aborted. Before a step runs, each constrained
request that samples in it gets its row of allowed tokens (`masks`); such steps wait for the step in flight
(Request.needs_host_history), since the mask depends on the request's previous token.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import torch

from voltllm.engine.request import Request, RequestStatus
from voltllm.engine.request_checks import InvalidRequestError

logger = logging.getLogger("voltllm")

COMPILED_CACHE_SIZE = 128  # compiled grammars kept by key (a schema's compiled form is ~KBs to MBs)


@dataclass
class GrammarMasks:
    """One step's allowed-token rows (host int32, xgrammar's bitmask layout) of its constrained sampling requests."""

    rows: dict[str, int]  # request id -> row of `bitmask`
    bitmask: torch.Tensor  # [len(rows), words]

    def for_requests(self, request_ids: list[str]) -> Optional[tuple[list[int], torch.Tensor]]:
        """For sampling rows of these requests, in this order: the rows that are constrained and their bitmask rows
        (host int32 [len(rows), words]); None when none is."""
        picks = [(i, self.rows[rid]) for i, rid in enumerate(request_ids) if rid in self.rows]
        if not picks:
            return None
        dst, src = zip(*picks)
        words = self.bitmask if list(src) == list(range(len(self.rows))) else self.bitmask[list(src)]
        return list(dst), words


class GrammarMatchers:
    """Compiles constraints (cached by key) against the model's vocabulary and keeps the live matchers.

    tokenizer_loader: returns the HF tokenizer (loaded on the first constrained request; None when the engine has
    none). vocab_size: the model's logits width, which may exceed the tokenizer's."""

    def __init__(self, tokenizer_loader, vocab_size: int):
        self._load_tokenizer = tokenizer_loader
        self.vocab_size = vocab_size
        self._compiler: Any = None
        self._compiled: OrderedDict = OrderedDict()
        self.live: dict[str, Any] = {}  # request id -> xgrammar GrammarMatcher

    def __len__(self) -> int:
        return len(self.live)

    def _compiler_or_fail(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            tokenizer = self._load_tokenizer()
            if tokenizer is None:
                raise InvalidRequestError("structured outputs need the model's tokenizer (the engine was started "
                                          "with --skip-tokenizer-init)", "structured_outputs")
            try:
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
            except Exception as e:  # a tokenizer xgrammar cannot read: refuse the request, keep the engine
                raise InvalidRequestError(f"structured outputs are not available with this tokenizer: {e}",
                                          "structured_outputs") from None
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # cached here, by key
        return self._compiler

    def _compile(self, key: tuple[str, str]) -> Any:
        compiled = self._compiled.get(key)
        if compiled is not None:
            self._compiled.move_to_end(key)
            return compiled
        from voltllm.sampling.structured import StructuredOutputsError
        from voltllm.structured.grammar import grammar_for

        compiler = self._compiler_or_fail()
        try:
            compiled = compiler.compile_grammar(grammar_for(key))
        except (StructuredOutputsError, RuntimeError, ValueError) as e:
            raise InvalidRequestError(f"structured outputs: {e}", "structured_outputs") from None
        self._compiled[key] = compiled
        if len(self._compiled) > COMPILED_CACHE_SIZE:
            self._compiled.popitem(last=False)
        return compiled

    def attach(self, req: Request) -> None:
        """Give a constrained request its matcher (InvalidRequestError if its constraint does not compile). Its stop
        tokens are the request's EOS ids when it has them, so a finished grammar ends with a token the engine stops
        on."""
        import xgrammar as xgr

        sp = req.sampling_params
        compiled = self._compile(sp.structured_outputs.key)
        stops = list(sp._eos_token_ids) or None
        self.live[req.request_id] = req.grammar = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)

    def release(self, req: Request) -> None:
        if req.grammar is not None:
            req.grammar = None
            self.live.pop(req.request_id, None)

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
        """Allowed-token rows for the constrained requests that sample in this step (ScheduledRequest list)."""
        if not self.live:
            return None
        reqs = [s.request for s in scheduled if s.samples and s.request.grammar is not None]
        if not reqs:
            return None
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(reqs), self.vocab_size)
        for i, r in enumerate(reqs):
            r.grammar.fill_next_token_bitmask(bitmask, i)
        return GrammarMasks({r.request_id: i for i, r in enumerate(reqs)}, bitmask)
