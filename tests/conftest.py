"""Fixtures shared by the whole test suite."""
import os
import sys

import pytest

# Tests import the package from this checkout, whether or not it is pip-installed.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path of the real SmolLM2-135M-Instruct Q4_1 GGUF, through the same cache users get (fetched once)."""
    from voltllm.model.loader.default_model import ensure_default_model

    return ensure_default_model()
