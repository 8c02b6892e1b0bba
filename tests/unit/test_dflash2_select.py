"""DFlash2's selector walk kernel under the CPU interpreter against its torch form (fresh random inputs at the public
drafter's sizes and odd ones, ties), and its refusals."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from interp_util import run_interp_script

HELPER = Path(__file__).with_name("_dflash2_select_interp_check.py")


def test_walk_kernel_matches_torch_in_the_interpreter():
    proc = run_interp_script(HELPER, ("cpu",), timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("CHECK ")]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(lines) >= 9, proc.stdout
    bad = [ln for ln in lines if " ok " not in ln]
    assert not bad, bad


def test_walk_refuses_shapes_that_do_not_fit():
    pytest.importorskip("triton")
    from voltllm.kernels.dflash2_select import walk

    cb = torch.zeros(10, 4)
    with pytest.raises(ValueError, match="do not fit"):
        walk(torch.zeros(6, 3, dtype=torch.long), torch.zeros(6, 3), torch.zeros(6, 4), cb, cb, torch.zeros(4))
    with pytest.raises(ValueError, match="codebooks"):
        walk(torch.zeros(6, 3, dtype=torch.long), torch.zeros(6, 3), torch.zeros(6, 4), cb, cb.half(),
             torch.zeros(3))
