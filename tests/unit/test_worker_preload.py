"""Tensor-parallel workers are forks of a forkserver that imported WORKER_PRELOAD (voltllm/distributed/executor.py).
A fork can use CUDA only if its parent never initialised it, so importing those modules must not ask torch.cuda or
Triton's driver anything (tests/gpu/test_worker_forkserver_cuda.py runs a worker forked that way on a GPU)."""
import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, sys
import torch
calls = []
def watch(mod, name):
    f = getattr(mod, name, None)
    if f is None:
        return
    def w(*a, **k):
        calls.append(f"{mod.__name__}.{name}")
        return f(*a, **k)
    setattr(mod, name, w)
for name in ("is_available", "device_count", "get_device_properties", "get_device_capability", "init", "_lazy_init",
             "current_device", "get_device_name", "is_bf16_supported", "mem_get_info", "set_device"):
    watch(torch.cuda, name)
watch(torch._C, "_cuda_getDeviceCount")
from triton.runtime import driver
cls = type(driver)
seen = cls.__getattribute__
def looked_up(self, name):
    if name == "active":
        calls.append("triton.runtime.driver.active")
    return seen(self, name)
cls.__getattribute__ = looked_up
from voltllm.distributed.executor import WORKER_PRELOAD
for m in WORKER_PRELOAD:
    __import__(m)
print(json.dumps({"calls": calls, "loaded": [m for m in WORKER_PRELOAD if m in sys.modules]}))
"""


def test_the_preloaded_modules_never_touch_the_gpu():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["calls"] == []
    from voltllm.distributed.executor import WORKER_PRELOAD

    assert got["loaded"] == list(WORKER_PRELOAD)
