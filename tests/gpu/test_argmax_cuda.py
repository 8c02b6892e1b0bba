"""The Triton row argmax on CUDA against torch.argmax (fp16 / bf16 / fp32, ties, banned rows, NaN)."""
from __future__ import annotations

import pytest
import torch

from interp_util import load_script
from pathlib import Path

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_row_argmax_matches_torch_on_cuda():
    check = load_script(Path(__file__).parents[1] / "unit" / "_argmax_interp_check.py")
    bad = [(name, detail) for name, ok, detail in check.run("cuda") if not ok]
    assert not bad, bad
