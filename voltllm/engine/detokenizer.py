"""Incremental detokenization with stop strings.

Text is decoded over a small sliding window of ids (prefix offset .. end) so each new token costs O(1)
work and multi-byte characters split across tokens are only emitted once complete (a window that
decodes to a trailing U+FFFD waits for the next token).

Two decodes per token for every running request make this the API process's main per-token cost, so a fast
tokenizer without clean-up is decoded by its `tokenizers` backend directly (what transformers' decode calls
then; ~0.9 vs ~2.5 us a call on the CI machine); other tokenizers go through `tokenizer.decode`.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False, min_tokens: int = 0):
        """min_tokens: stop strings are not looked for until more output tokens than this have come (vLLM's rule:
        text ending within the first min_tokens tokens never stops the request)."""
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens
        self.num_tokens = 0
        self.skip_special = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-6:])  # a little context for leading-space handling
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = list(stop)
        self.include_stop = include_stop_str_in_output
        self.stop_holdback = max((len(s) for s in self.stop), default=1) - 1

        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if backend is not None and not getattr(
            tokenizer, "clean_up_tokenization_spaces", True) else None

    def _decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token_ids: Sequence[int], stop_terminated: bool = False) -> Optional[str]:
        """Append tokens; return the stop string that matched (text then ends there), else None. stop_terminated:
        the last token stopped the request (EOS / stop_token_ids): its text is left out unless
        include_stop_str_in_output (vLLM's rule)."""
        if stop_terminated and not self.include_stop and token_ids:
            token_ids = token_ids[:-1]
        for tid in token_ids:
            self.ids.append(tid)
            self.num_tokens += 1
            prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
                new = full[len(prefix_text):]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
                if self.num_tokens <= self.min_tokens:
                    self.text += new
                    continue
                matched = self._append_checking_stop(new)
                if matched is not None:
                    return matched
        return None

    def _append_checking_stop(self, new: str) -> Optional[str]:
        start = max(len(self.text) - self.stop_holdback, 0)
        self.text += new
        hits = [(idx, s) for s in self.stop if (idx := self.text.find(s, start)) >= 0]
        if not hits:
            return None
        idx, s = min(hits)  # the earliest stop string wins
        self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
        return s

    def visible_text(self, finished: bool) -> str:
        """Text safe to show now: while running, hold back what could be the start of a stop string."""
        if finished or not self.stop or self.stop_holdback == 0:
            return self.text
        return self.text[: max(len(self.text) - self.stop_holdback, 0)]
