"""DFlash2's kernels on CUDA against their torch forms: the selector walk (fp32 / fp16 / bf16 codebooks, the public
drafter's sizes, ties) and the block convolution (blocks side by side, padding rows, fp32 / fp16 / bf16)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from interp_util import load_script

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("script, least", [("_dflash2_select_interp_check.py", 13),
                                           ("_dflash2_conv_interp_check.py", 27)])
def test_kernel_matches_torch_on_cuda(script, least):
    results = load_script(Path(__file__).parents[1] / "unit" / script).run("cuda")
    assert len(results) >= least
    bad = [(name, detail) for name, ok, detail in results if not ok]
    assert not bad, bad
