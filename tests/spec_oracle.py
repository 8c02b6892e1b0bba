"""Oracle drafts for speculative-decoding tests: tiny random models hardly ever repeat themselves, so n-gram drafts
are almost never accepted and a draft model almost never agrees. These patches draft from a plain run's own tokens
instead, with every position p where p % 5 == 3 replaced by a wrong token: windows of 4 drafts then see every
outcome (all accepted, some, none) at every offset."""
from __future__ import annotations

from typing import Any


def oracle_table(prompts: list, outputs: list) -> dict:
    """Each request's true continuation (prompt + plain output), keyed by its prompt token ids."""
    return {tuple(p): list(p) + list(o) for p, o in zip(prompts, outputs)}


def oracle_drafts(full: list[int], at: int, k: int, vocab: int) -> list[int]:
    """k drafts for a request whose next token is full[at]: the true tokens, wrong at positions p % 5 == 3."""
    return [(t + 1) % vocab if (at + j) % 5 == 3 else t for j, t in enumerate(full[at:at + k])]


def patch_ngram(monkeypatch: Any, table: dict, vocab: int) -> None:
    """Scheduler._propose drafts from `table` (as many drafts as the n-gram proposer may take)."""
    from voltllm.engine.scheduler import Scheduler
    from voltllm.engine.speculative import spec_allowed

    def propose(self, req, max_new):
        k = spec_allowed(req, min(self._step_drafts, max_new))  # (the dynamic schedule's cap too)
        full = table.get(tuple(req.prompt_token_ids))
        if k <= 0 or full is None:
            return []
        return oracle_drafts(full, len(req.all_token_ids), k, vocab)

    monkeypatch.setattr(Scheduler, "_propose", propose)


def patch_draft_model(monkeypatch: Any, table: dict, vocab: int) -> None:
    """The draft model's proposal passes run as usual, then their drafts are replaced by the oracle's (greedy
    requests: the drafts the verification reads and the step's input ids both come from DraftRunner._drafts)."""
    import torch

    from voltllm.worker.draft_runner import DraftRunner

    orig = DraftRunner._passes

    def passes(self, catch_up, rows):
        orig(self, catch_up, rows)
        if self._drafts is None:
            return
        for i, s in enumerate(rows):
            full = table.get(tuple(s.request.prompt_token_ids))
            if full is not None:
                want = oracle_drafts(full, s.start + 1, len(s.spec_tokens), vocab)
                self._drafts[:len(want), i] = torch.tensor(want, dtype=torch.long)

    monkeypatch.setattr(DraftRunner, "_passes", passes)


def patch_dflash(monkeypatch: Any, table: dict, vocab: int) -> None:
    """The DFlash drafter's block forward runs as usual, then its drafts (DFlashRunner._drafts [drafts, requests],
    read by the step's input ids and the greedy verification) are replaced by the oracle's."""
    from voltllm.worker.dflash_runner import DFlashRunner

    patch_device_proposals(monkeypatch, DFlashRunner, table, vocab)


def patch_device_proposals(monkeypatch: Any, runner_cls: Any, table: dict, vocab: int) -> None:
    """A device drafter's `propose` (DFlash's, MTP's, EAGLE-3's) runs as usual, then its drafts (`_drafts` [drafts,
    requests]) are replaced by the oracle's for the requests `table` knows."""
    import torch

    orig = runner_cls.propose

    def propose(self, sched):
        orig(self, sched)
        if self._drafts is None:
            return
        for i, s in enumerate(s for s in sched.scheduled if s.spec_tokens):
            full = table.get(tuple(s.request.prompt_token_ids))
            if full is not None:
                want = oracle_drafts(full, s.start + 1, len(s.spec_tokens), vocab)
                self._drafts[:len(want), i] = torch.tensor(want, dtype=torch.long)

    monkeypatch.setattr(runner_cls, "propose", propose)


# text prompts with something to repeat (and one without), for the host-side drafters (n-gram, suffix)
TEXT_PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
                "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
                "0123456789 0123456789 0123",
                "Hi"]


def text_outputs(llm: Any, prompts: list, sps: Any) -> list:
    """Token ids of each request (text prompts), after the engine's books check out."""
    outs = llm.generate(prompts, sps)
    llm.engine.check_integrity()
    return [o.outputs[0].token_ids for o in outs]


def run_checked(llm: Any, prompts: list, sps: Any) -> list:
    """Token ids of each request (prompts as token id lists), after the engine's books check out and every KV block
    is back."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps)
    llm.engine.check_integrity()
    assert llm.engine.kv.usage() == 0.0
    return [o.outputs[0].token_ids for o in outs]


class PlainRuns:
    """Plain decoding's outputs with engine arguments `base` (+ per-call ones), cached: several tests compare
    with the same ones."""

    def __init__(self, base: dict):
        self.base, self.cache = base, {}

    def __call__(self, path: str, prompts: list, sp: Any, **kw: Any) -> list:
        from voltllm import LLM

        key = (path, repr(prompts), repr(sp), tuple(sorted(kw.items())))
        if key not in self.cache:
            self.cache[key] = run_checked(LLM(path, **{**self.base, **kw}), prompts, sp)
        return self.cache[key]
