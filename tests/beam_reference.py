"""A plain beam search over transformers' full next-token logprobs, as vLLM defines beam search: the reference the
beam-search tests (tests/model/test_beam_search.py, tests/server/test_beam_search_server.py) compare voltllm to."""
from __future__ import annotations

import torch

MARGIN = 1e-4  # the reference's decisions must not hinge on closer calls than this (the engines differ by ~1e-6)


class Reference:
    """Beam search as vLLM defines it, over transformers' log-softmax of the whole vocabulary."""

    def __init__(self, model):
        self.model = model
        self.cache: dict[tuple, torch.Tensor] = {}

    def next_logprobs(self, tokens: list[int]) -> torch.Tensor:
        key = tuple(tokens)
        if key not in self.cache:
            with torch.no_grad():
                self.cache[key] = self.model(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)
        return self.cache[key]

    def search(self, prompt: list[int], width: int, max_tokens: int, eos: set[int], length_penalty: float = 1.0,
               ignore_eos: bool = False) -> list[tuple[list[int], float]]:
        live, done = [(list(prompt), 0.0)], []
        for _ in range(max_tokens):
            candidates = []
            for tokens, cum in live:
                row = self.next_logprobs(tokens)
                top = torch.topk(row, 2 * width + 1)
                assert top.values[2 * width - 1] - top.values[2 * width] > MARGIN  # the candidate set is clear
                for lp, t in zip(top.values[:2 * width].tolist(), top.indices[:2 * width].tolist()):
                    (done if t in eos and not ignore_eos else candidates).append((tokens + [t], cum + lp))
            candidates.sort(key=lambda c: -c[1])
            if len(candidates) > width:
                assert candidates[width - 1][1] - candidates[width][1] > MARGIN  # which beams live on is clear
            live = candidates[:width]
            if not live:
                break
        final = sorted(done + live, key=lambda c: -self.score(c, eos, length_penalty))
        scores = [self.score(c, eos, length_penalty) for c in final[:width + 1]]
        # the ranking is clear: a logprob error of MARGIN moves a score by MARGIN / length ** length_penalty
        slack = MARGIN / max(len(prompt), 1) ** length_penalty
        assert all(a - b > slack for a, b in zip(scores, scores[1:]))
        return final[:width]

    @staticmethod
    def score(c: tuple[list[int], float], eos: set[int], length_penalty: float) -> float:
        tokens, cum = c  # the length counts the prompt, not a final EOS (also under ignore_eos: vLLM's rule)
        length = len(tokens) - (1 if tokens[-1] in eos else 0)
        return cum / length ** length_penalty
