"""DFlash2's kernels under the CPU interpreter against their torch forms: the selector walk (fresh random inputs at
the public drafter's sizes and odd ones, ties) and the block convolution (blocks side by side, blocks whose positions
continue one another, graph padding rows, partial feature tiles); their refusals."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from interp_util import run_interp_scripts

HERE = Path(__file__).parent


def test_kernels_match_torch_in_the_interpreter():
    procs = run_interp_scripts([(HERE / "_dflash2_select_interp_check.py", ("cpu",)),
                                (HERE / "_dflash2_conv_interp_check.py", ("cpu",))], timeout=300)
    for proc, least in zip(procs, (9, 18)):
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("CHECK ")]
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert len(lines) >= least, proc.stdout
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


def test_conv_refuses_what_does_not_fit():
    pytest.importorskip("triton")
    from voltllm.kernels.dflash2_conv import block_conv

    x, pos, lens = torch.zeros(4, 16), torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="do not fit"):
        block_conv(x, torch.zeros(4, 2, 3), torch.zeros(2, 16), pos, lens)  # 3 groups of 16 features
    with pytest.raises(ValueError, match="do not fit"):
        block_conv(x, torch.zeros(4, 2, 2, dtype=torch.float16), torch.zeros(2, 16), pos, lens)
