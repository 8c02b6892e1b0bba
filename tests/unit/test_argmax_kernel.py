"""Greedy sampling's Triton row argmax under the CPU interpreter, against torch.argmax (ties, banned rows, NaN,
strided rows), and the sampler's use of it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from interp_util import run_interp_script

HELPER = Path(__file__).with_name("_argmax_interp_check.py")


def test_row_argmax_matches_torch_in_the_interpreter():
    proc = run_interp_script(HELPER, ("cpu",), timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("CHECK ")]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(lines) >= 13, proc.stdout
    bad = [ln for ln in lines if " ok " not in ln]
    assert not bad, bad


def test_row_argmax_refuses_what_it_cannot_read():
    pytest.importorskip("triton")
    from voltllm.kernels.argmax import row_argmax

    with pytest.raises(ValueError):
        row_argmax(torch.zeros(3, dtype=torch.float16))
    with pytest.raises(ValueError):
        row_argmax(torch.zeros(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError):
        row_argmax(torch.zeros(4, 4, dtype=torch.float16).t())


def test_greedy_tokens_on_the_cpu_is_torch_argmax():
    from voltllm.sampling.sampler import greedy_tokens

    x = torch.randn(5, 333)
    assert torch.equal(greedy_tokens(x), x.argmax(dim=-1))
