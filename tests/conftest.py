"""Fixtures shared by the whole test suite, and the `--compat` option.

`pytest --compat {none,sm70,sm75}` builds every engine of the session (voltllm.LLM / EngineArgs, in this
process) on that route unless a test passes `compat=` itself, so the GPU suite runs on the SM70 route on any
GPU: `PYTHONPATH=$PWD:$PWD/tests python3 -m pytest -q -m gpu tests/gpu --compat sm70 -p no:cacheprovider`.
Under sm70/sm75, engines asked for bf16 (which that route refuses) and tests marked `native_only` skip.
Engines on `device="cpu"` (the references of GPU tests) keep their own route.

The CPU suite runs under pytest-xdist (pyproject's addopts: `-n auto --dist loadfile`; tests/xdist_plan.py: workers,
threads, which tests share a worker, what starts first). `-n auto` on `pytest -m gpu` gives one worker per GPU where
there are several, each with its own card (tests/gpu_workers.py), and none on a one-GPU machine (one process).
"""
import dataclasses
import functools
import os
import sys
from typing import Callable, Optional

import pytest

# Tests import the package from this checkout, whether or not it is pip-installed.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

COMPAT_CHOICES = ("none", "sm70", "sm75")


from gpu_workers import one_gpu_per_xdist_worker  # noqa: E402
from xdist_plan import auto_workers, make_scheduler, plan, share_cores  # noqa: E402

one_gpu_per_xdist_worker()  # at import: before anything in this worker initialises CUDA
share_cores()  # at import: before torch is loaded in this worker


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (addopts): see tests/xdist_plan.py. PYTEST_XDIST_AUTO_NUM_WORKERS, where set, decides."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    return auto_workers(config.getoption("markexpr") or "")


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """Which tests share a worker, in which order (tests/xdist_plan.py)."""
    return make_scheduler(config, log)


def pytest_addoption(parser):
    parser.addoption("--compat", choices=COMPAT_CHOICES, default=None,
                     help="build every engine (voltllm.LLM / EngineArgs) on this route unless a test passes compat "
                          "(default: each engine's own --compat auto)")


def pytest_configure(config):
    config.addinivalue_line("markers", "native_only(reason): needs the native route; skipped under --compat sm70|sm75")
    if not hasattr(config, "workerinput"):  # once, in the controller
        from dependency_floor import out_of_range, runtime_requirements

        wrong = out_of_range(runtime_requirements())
        if wrong:
            pytest.exit("installed packages outside pyproject's ranges (pip install -e . would fix them):\n  "
                        + "\n  ".join(wrong), returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_collection_modifyitems(config, items):
    plan(items)  # the CPU tests by unit of work, longest first: the order xdist hands them out in (tests/xdist_plan.py)
    mode = config.getoption("--compat")
    if mode in (None, "none"):
        return
    for item in items:
        marker = item.get_closest_marker("native_only")
        if marker is not None:
            reason = marker.args[0] if marker.args else marker.kwargs.get("reason", "needs the native route")
            item.add_marker(pytest.mark.skip(reason=f"native only under --compat {mode}: {reason}"))


def install_compat_default(mode: str) -> Callable[[], None]:
    """Make EngineArgs default to compat=mode when the caller does not pass compat (nor device="cpu"); an engine
    asked for bf16 under sm70/sm75 skips the test (that route refuses bf16). Returns the undo function."""
    from voltllm.config import EngineArgs

    original = EngineArgs.__init__
    compat_pos = [f.name for f in dataclasses.fields(EngineArgs)].index("compat")

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        if "compat" not in kwargs and len(args) <= compat_pos and kwargs.get("device") != "cpu":
            if mode != "none" and kwargs.get("dtype") in ("bfloat16", "bf16"):
                pytest.skip(f"native only under --compat {mode}: bf16 engine (the {mode} route refuses bf16)")
            kwargs["compat"] = mode
        original(self, *args, **kwargs)

    EngineArgs.__init__ = __init__

    def undo() -> None:
        EngineArgs.__init__ = original

    return undo


@pytest.fixture(scope="session", autouse=True)
def _compat_default(request):
    """--compat: every engine of the session defaults to that route (see install_compat_default)."""
    mode: Optional[str] = request.config.getoption("--compat")
    if mode is None:
        yield None
        return
    undo = install_compat_default(mode)
    try:
        yield mode
    finally:
        undo()


@pytest.fixture(autouse=True)
def _worker_forkserver_env():
    """Stop the forkservers a test started for workers with its own environment (tp_eager_graphs.worker_env; by now
    monkeypatch has put the usual one back)."""
    yield
    import tp_eager_graphs

    tp_eager_graphs.stop_fresh_forkservers()


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path of the real SmolLM2-135M-Instruct Q4_1 GGUF, through the same cache users get (fetched once)."""
    from voltllm.model.loader.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def smollm2_transformers(smollm2_gguf):
    """transformers' model of the same GGUF (fp32, eval), loaded once: its GGUF dequantization takes ~15 s on the CPU,
    and two test files compare against it (the loader's weights, greedy tokens). Tests only read it."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    pytest.importorskip("accelerate")  # transformers needs it for GGUF loading
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf),
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models: one intra-op thread is fastest, and immune to a busy machine's oversubscription.
    Modules ask for it with pytestmark = pytest.mark.usefixtures("one_torch_thread")."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
