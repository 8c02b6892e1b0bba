"""How the CPU suite runs under pytest-xdist (`-n auto --dist loadfile`, from pyproject's addopts; tests/conftest.py
calls these).

- workers: `-n auto` is one worker per usable core, at most MAX_CPU_WORKERS, for the CPU suite. A run that selects
  the GPU tests (`-m gpu`) gets one worker per GPU where there are several (tests/gpu_workers.py gives each its own
  card) and none on a one-GPU machine: that run stays in one process, as before. An explicit `-n N` is kept.
- threads: the workers split the cores (OMP_NUM_THREADS, set before torch loads, reaches the servers, tensor-parallel
  ranks and interpreter scripts the tests start too): two workers with two torch threads each on two cores spend
  much of their time waiting for each other's threads.
- scheduling (UnitScheduling): each test file is one unit of work (its module fixtures are built once), and the
  files that share an expensive session fixture (SHARED_FILES: a `voltllm serve` of SmolLM2, the tiny server,
  transformers' SmolLM2) are one unit together. The longest units start first (LONGEST_FIRST; plan() orders the
  collection, which the scheduler keeps), so no worker is left with a long file at the end. A GPU run keeps xdist's
  per-test `load` unless `--dist` is given on its command line.
  (xdist's own `loadgroup` does not group under pytest 9.2: it renames item._nodeid, which pytest no longer reads.)
"""
import os
from typing import Optional

MAX_CPU_WORKERS = 2  # measured on CI's 2 cores; each worker can hold several GB (the test engines, the gate)

# the files that use an expensive session fixture, by fixture: one unit each (else every worker that runs one of them
# builds its own: a server start, a model load). plan() warns about a file that uses one and is not listed.
SHARED_FILES = {
    "server": ("tests/server/test_acceleration_endpoint.py", "tests/server/test_cors.py", "tests/server/test_errors.py",
               "tests/server/test_openai_server.py", "tests/server/test_sagemaker_metrics_server.py"),
    "tiny_server": ("tests/server/test_beam_search_server.py", "tests/server/test_bench_server.py",
                    "tests/server/test_client_shapes_server.py",
                    "tests/server/test_lora_server.py", "tests/server/test_messages_server.py",
                    "tests/server/test_priority_server.py", "tests/server/test_reasoning_server.py",
                    "tests/server/test_repetition_detection_server.py",
                    "tests/server/test_responses_server.py", "tests/server/test_sleep_mode_server.py",
                    "tests/server/test_structured_outputs_server.py", "tests/server/test_tool_choice_server.py",
                    "tests/server/test_vllm_params_server.py"),
    "smollm2_transformers": ("tests/model/test_gguf_loader.py", "tests/model/test_smollm2.py"),
    "embed_server": ("tests/server/test_embeddings_server.py", "tests/server/test_embedding_score_server.py",
                     "tests/server/test_pooling_server.py"),
}
UNIT_OF_FILE = {path: unit for unit, paths in SHARED_FILES.items() for path in paths}

# the slowest units (seconds in a 2-worker run on a 2-core machine, before the workers split the cores; rough: only
# their order matters): started first, longest first
LONGEST_FIRST = {
    "tests/unit/test_sm70_gate.py": 540,  # cross-compiles every registered kernel (in two processes of its own)
    "tests/model/test_eagle3_speculation.py": 110,
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
    "tiny_server": 75,  # tests/server files on the tiny server (conftest.py `tiny_server`)
    "tests/unit/test_moe_kernels.py": 55,
    "tests/model/test_gguf_low_bit.py": 65,
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


def unit_of(nodeid: str) -> str:
    """The unit of work of a test: its file, or the shared fixture its file is listed under (SHARED_FILES)."""
    path = nodeid.split("::", 1)[0]
    return UNIT_OF_FILE.get(path, path)


def plan(items: list) -> None:
    """Reorder `items` in place: the CPU tests by unit, longest unit first (the others in collection order), then the
    GPU tests in their order. Warns about a file that uses a SHARED_FILES fixture but is not listed under it."""
    import warnings

    units: dict[str, list] = {}
    for it in items:
        if it.get_closest_marker("gpu") is None:
            units.setdefault(unit_of(it.nodeid), []).append(it)
            for name in SHARED_FILES:
                if name in it.fixturenames and unit_of(it.nodeid) != name:
                    warnings.warn(f"{it.nodeid} uses the session fixture {name!r}: list its file in "
                                  f"tests/xdist_plan.py SHARED_FILES, so that it shares that fixture's worker")
    order = sorted(units, key=lambda u: -LONGEST_FIRST.get(u, 0))  # stable
    items[:] = [it for u in order for it in units[u]] + [it for it in items if it.get_closest_marker("gpu")]


def make_scheduler(config, log):
    """The scheduler of a run under xdist: UnitScheduling for the CPU suite's `loadfile` (addopts); None (xdist's
    choice) otherwise, but per-test `load` for a GPU run not given `--dist` on its command line."""
    explicit = any(a == "--dist" or a.startswith("--dist=") for a in config.invocation_params.args)
    if selects_gpu_tests(config.getoption("markexpr") or ""):
        if explicit:
            return None
        from xdist.scheduler import LoadScheduling

        return LoadScheduling(config, log)
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class UnitScheduling(LoadFileScheduling):
        """loadfile, with the files of a SHARED_FILES fixture in one unit."""

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return UnitScheduling(config, log)
