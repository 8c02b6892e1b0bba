"""GPU tests (marked gpu, deselected by default): each is skipped on a machine without CUDA."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
