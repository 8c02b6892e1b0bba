import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_fused_decode_layers_match_unfused_under_interpreter():
    here = os.path.dirname(__file__)
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(here)), os.path.dirname(here),
                                          os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, os.path.join(here, "_fused_decode_interp_check.py")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok fused decode" in r.stdout, r.stdout + r.stderr[-3000:]
