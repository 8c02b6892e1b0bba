"""The offline LLM's progress bar, as vLLM draws it: sequences completed out of those submitted, with the input and
output token rates so far in the postfix, on stderr (tqdm's default)."""
from __future__ import annotations

from typing import Any, Callable, Union

from tqdm.auto import tqdm

from voltllm.engine.outputs import RequestOutput

UseTqdm = Union[bool, Callable[..., Any]]  # vLLM's: False, True (tqdm) or a tqdm-like factory


def _rates(input_rate: float, output_rate: float) -> str:
    return f"est. speed input: {input_rate:.2f} toks/s, output: {output_rate:.2f} toks/s"


class ProgressBar:
    """Counts each finished request's n sequences; its prompt tokens count once per sequence (vLLM's rates)."""

    def __init__(self, use_tqdm: UseTqdm, total: int):
        factory = use_tqdm if callable(use_tqdm) else tqdm
        self.total = total
        self.bar = factory(total=total, desc="Processed prompts", dynamic_ncols=True, postfix=_rates(0.0, 0.0))
        self.input_tokens = self.output_tokens = 0

    def finished(self, out: Any) -> None:
        """out: a RequestOutput, or a pooling request's output (one sequence, no output tokens)."""
        choices = out.outputs if isinstance(out, RequestOutput) else []
        n = len(choices) or 1
        self.input_tokens += len(out.prompt_token_ids) * n
        self.output_tokens += sum(len(c.token_ids) for c in choices)
        elapsed = max(self.bar.format_dict["elapsed"], 1e-6)  # (0 on a coarse clock right after the start)
        self.bar.postfix = _rates(self.input_tokens / elapsed, self.output_tokens / elapsed)
        self.bar.update(n)
        if self.bar.n == self.total:  # the last update may fall within tqdm's refresh interval
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
