from pathlib import Path

import pytest

from interp_util import run_interp_scripts

HERE = Path(__file__).parent
SCRIPTS = {"skinny": (HERE / "_gemv_interp_check.py", ("norm / accumulate", "gated")),
           "batch": (HERE / "_batch_gemm_interp_check.py", ("batch_gemm",))}


@pytest.fixture(scope="module")
def runs() -> dict:
    """The skinny GEMM's and the decode-batch GEMM's interpreter checks, side by side."""
    return dict(zip(SCRIPTS, run_interp_scripts([(script, ()) for script, _ in SCRIPTS.values()], timeout=300)))


@pytest.mark.parametrize("name", SCRIPTS)
def test_skinny_and_batch_gemm_match_references_under_interpreter(runs, name):
    r = runs[name]
    assert r.returncode == 0 and all(f"ok {p}" in r.stdout for p in SCRIPTS[name][1]), r.stdout + r.stderr
