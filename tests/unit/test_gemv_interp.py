import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_skinny_and_batch_gemm_match_references_under_interpreter():
    here = os.path.dirname(__file__)
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(here)), os.path.dirname(here),
                                          os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, os.path.join(here, "_gemv_interp_check.py")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok norm / accumulate" in r.stdout and "ok batch_gemm" in r.stdout, r.stdout + r.stderr
