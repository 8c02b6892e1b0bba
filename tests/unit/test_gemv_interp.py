from pathlib import Path

from interp_util import run_interp_script


def test_skinny_and_batch_gemm_match_references_under_interpreter():
    r = run_interp_script(Path(__file__).parent / "_gemv_interp_check.py", timeout=300)
    parts = ("norm / accumulate", "gated", "batch_gemm")
    assert r.returncode == 0 and all(f"ok {p}" in r.stdout for p in parts), r.stdout + r.stderr
