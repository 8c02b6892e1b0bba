from pathlib import Path

import pytest

from interp_util import run_interp_scripts

KINDS = ("qwen2", "qwen3")


@pytest.fixture(scope="module")
def runs() -> dict:
    """One interpreter process per model kind, side by side."""
    script = Path(__file__).parent / "_norm_fold_interp_check.py"
    return dict(zip(KINDS, run_interp_scripts([(script, (kind,)) for kind in KINDS])))


@pytest.mark.parametrize("kind", KINDS)
def test_norm_folded_layers_match_unfused_under_interpreter(runs, kind):
    r = runs[kind]
    assert r.returncode == 0 and f"ok norm fold {kind}" in r.stdout, r.stdout + r.stderr[-3000:]
