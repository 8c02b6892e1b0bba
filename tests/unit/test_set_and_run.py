"""benchmarks/set_and_run.py (A / B runs): it sets existing module constants before handing the rest to the CLI,
and refuses names that do not exist (a typo would otherwise measure the plain run twice)."""
from pathlib import Path

import pytest
from interp_util import load_script


def _tool():
    return load_script(Path(__file__).resolve().parents[2] / "benchmarks" / "set_and_run.py")


def test_sets_the_constant_then_runs_the_cli(capsys):
    import voltllm.kernels.batch_gemm as B

    old = B.BATCH_PREFETCH_K
    try:
        with pytest.raises(SystemExit) as e:  # `check --help` prints and exits 0
            _tool().main(["voltllm.kernels.batch_gemm:BATCH_PREFETCH_K=256", "--", "check", "--help"])
        assert e.value.code == 0 and B.BATCH_PREFETCH_K == 256
        assert "set voltllm.kernels.batch_gemm.BATCH_PREFETCH_K = 256" in capsys.readouterr().out
    finally:
        B.BATCH_PREFETCH_K = old


def test_refuses_unknown_constants_and_a_missing_separator():
    with pytest.raises(SystemExit, match="no constant 'NO_SUCH_KNOB'"):
        _tool().main(["voltllm.kernels.batch_gemm:NO_SUCH_KNOB=1", "--", "check"])
    with pytest.raises(SystemExit, match="usage"):
        _tool().main(["bench"])
