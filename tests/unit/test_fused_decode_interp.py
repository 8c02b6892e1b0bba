from pathlib import Path

from interp_util import run_interp_script


def test_fused_decode_layers_match_unfused_under_interpreter():
    r = run_interp_script(Path(__file__).parent / "_fused_decode_interp_check.py")
    assert r.returncode == 0 and "ok fused decode" in r.stdout, r.stdout + r.stderr[-3000:]
