"""Spreading the GPU suite over several cards under pytest-xdist (called from tests/conftest.py)."""
import os
from typing import Optional


def one_gpu_per_xdist_worker(env=os.environ, gpus_dir: str = "/proc/driver/nvidia/gpus") -> Optional[int]:
    """Under pytest-xdist (`-n N`) on a machine with several GPUs, worker gwI sees only GPU I mod (GPUs), so
    `pytest -m gpu -n <GPUs>` spreads the GPU suite over the cards (engines size their KV cache from the free
    memory of their card and would starve each other on a shared one). Counts the cards from the driver's /proc
    entries, so CUDA is not initialised here; a CUDA_VISIBLE_DEVICES already set is kept. Returns the GPU chosen."""
    worker = env.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or "CUDA_VISIBLE_DEVICES" in env or not os.path.isdir(gpus_dir):
        return None
    count = len(os.listdir(gpus_dir))
    if count < 2:
        return None
    gpu = int(worker[2:]) % count
    env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return gpu
