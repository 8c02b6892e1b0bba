"""How the CPU suite runs under pytest-xdist (`-n auto --dist loadgroup`, from pyproject's addopts; tests/conftest.py
calls these).

- workers: `-n auto` is one worker per usable core, at most MAX_CPU_WORKERS, for the CPU suite. A run that selects
  the GPU tests (`-m gpu`) gets one worker per GPU where there are several (tests/gpu_workers.py gives each its own
  card) and none on a one-GPU machine: that run stays in one process, as before. An explicit `-n N` is kept.
- threads: the workers split the cores (OMP_NUM_THREADS, set before torch loads, reaches the servers, tensor-parallel
  ranks and interpreter scripts the tests start too): two workers with two torch threads each on two cores spend
  much of their time waiting for each other's threads.
- scheduling: each test file is one unit of work (its module fixtures are built once), and the files that share an
  expensive session fixture (a `voltllm serve` of SmolLM2, the tiny server, transformers' SmolLM2) are one unit
  together. The longest units start first (LONGEST_FIRST), so no worker is left with a long file at the end.
"""
import os
from typing import Optional

MAX_CPU_WORKERS = 2  # measured on CI's 2 cores; each worker can hold several GB (the test engines, the gate)

# session fixtures whose users must share a worker (each worker would build its own: a server start, a model load)
SHARED_SESSION_FIXTURES = ("server", "tiny_server", "smollm2_transformers")

# the slowest units in a 2-worker run (seconds, a fresh clone on CI's 2 cores; rough): started first, longest first
LONGEST_FIRST = {
    "tests/unit/test_sm70_gate.py": 540,  # cross-compiles every registered kernel (in two processes of its own)
    "tests/model/test_hybrid_speculation.py": 380,
    "tests/model/test_mtp_speculation.py": 350,
    "server": 340,  # tests/server files on the shared SmolLM2 server (conftest.py `server`)
    "tests/model/test_tensor_parallel_drafters.py": 230,
    "tests/model/test_draft_model_speculation.py": 230,
    "tests/model/test_fp8_kv_engine.py": 220,
    "tests/model/test_parity.py": 140,
    "tests/unit/test_make_random_quantized.py": 140,
    "tests/model/test_quantized_hybrids.py": 120,
    "smollm2_transformers": 110,  # tests/model/test_smollm2.py, test_gguf_loader.py
    "tests/model/test_tensor_parallel_hybrid.py": 110,
    "tests/unit/test_gdn_chunk_interp.py": 100,
    "tests/model/test_dflash_speculation.py": 95,
    "tests/model/test_tensor_parallel_speculative.py": 85,
    "tests/model/test_tensor_parallel.py": 80,
    "tests/unit/test_fused_decode_interp.py": 70,
    "tests/unit/test_gemv_interp.py": 65,
    "tiny_server": 60,  # tests/server files on the tiny server (conftest.py `tiny_server`)
    "tests/unit/test_moe_kernels.py": 55,
    "tests/unit/test_make_random_gguf.py": 55,
    "tests/unit/test_gguf_planes.py": 50,
}


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def selects_gpu_tests(markexpr: str) -> bool:
    """Whether a `-m` expression picks the tests marked gpu (`-m gpu`, `-m "gpu and not slow"`; not the default
    `-m "not gpu"`)."""
    return "gpu" in markexpr.replace("not gpu", "")


def auto_workers(markexpr: str, gpus_dir: str = "/proc/driver/nvidia/gpus") -> int:
    """`-n auto`: the GPU suite one worker per GPU if there are several, else in-process (0); the CPU suite one
    worker per usable core, at most MAX_CPU_WORKERS (a single core: in-process)."""
    if selects_gpu_tests(markexpr):
        gpus = len(os.listdir(gpus_dir)) if os.path.isdir(gpus_dir) else 0
        return gpus if gpus > 1 else 0
    n = min(usable_cores(), MAX_CPU_WORKERS)
    return n if n > 1 else 0


def share_cores(env=os.environ) -> Optional[int]:
    """In an xdist worker: OMP_NUM_THREADS = usable cores / workers (at least 1), unless set already. Call before
    torch is imported. Returns the thread count set."""
    workers = int(env.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if not env.get("PYTEST_XDIST_WORKER") or workers < 2 or "OMP_NUM_THREADS" in env:
        return None
    threads = max(1, usable_cores() // workers)
    env["OMP_NUM_THREADS"] = str(threads)
    return threads


def unit_of(item) -> str:
    """The unit of work of a test: its file, or the session fixture it shares with other files."""
    for name in SHARED_SESSION_FIXTURES:
        if name in item.fixturenames:
            return name
    return item.nodeid.split("::", 1)[0]


def plan(items: list, mark) -> None:
    """Reorder `items` in place, longest unit first, and mark each test that is not a GPU test with its unit as its
    xdist_group (`mark(name)` makes the marker). A file some of whose tests use a shared fixture goes whole with
    that fixture's unit. GPU tests keep their place and their own scheduling."""
    cpu = [it for it in items if it.get_closest_marker("gpu") is None]
    unit_of_file: dict[str, str] = {}
    for it in cpu:
        path, unit = it.nodeid.split("::", 1)[0], unit_of(it)
        if unit != path or path not in unit_of_file:
            unit_of_file[path] = unit
    units: dict[str, list] = {}
    for it in cpu:
        unit = unit_of_file[it.nodeid.split("::", 1)[0]]
        units.setdefault(unit, []).append(it)
        it.add_marker(mark(unit))
    order = sorted(units, key=lambda u: -LONGEST_FIRST.get(u, 0))  # stable: the others in collection order
    items[:] = [it for u in order for it in units[u]] + [it for it in items if it.get_closest_marker("gpu")]
