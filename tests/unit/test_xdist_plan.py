"""tests/xdist_plan.py (used by tests/conftest.py): how many xdist workers, their threads, the units of work."""
import pytest

import xdist_plan
from test_gpu_workers import _gpus  # (a fake sysfs GPU list; this directory is on the path)
from xdist_plan import SHARED_FILES, auto_workers, selects_gpu_tests, share_cores, unit_of


def test_gpu_selection():
    assert selects_gpu_tests("gpu") and selects_gpu_tests("gpu and not slow")
    assert not selects_gpu_tests("not gpu") and not selects_gpu_tests("") and not selects_gpu_tests("slow")


@pytest.mark.parametrize("cores,gpus,cpu_workers,gpu_workers", [(1, 0, 0, 0), (2, 1, 2, 0), (16, 2, 2, 2),
                                                                 (16, 8, 2, 8)])
def test_auto_workers(tmp_path, monkeypatch, cores, gpus, cpu_workers, gpu_workers):
    monkeypatch.setattr(xdist_plan, "usable_cores", lambda: cores)
    gpus_dir = _gpus(tmp_path, gpus)
    assert auto_workers("not gpu", gpus_dir) == cpu_workers  # the CPU suite: one per core, at most 2
    assert auto_workers("gpu", gpus_dir) == gpu_workers  # the GPU suite: one per GPU, in-process on one
    assert auto_workers("gpu", str(tmp_path / "none")) == 0


def test_share_cores(monkeypatch):
    monkeypatch.setattr(xdist_plan, "usable_cores", lambda: 4)
    env = {"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "2"}
    assert share_cores(env) == 2 and env["OMP_NUM_THREADS"] == "2"
    env = {"PYTEST_XDIST_WORKER": "gw0", "PYTEST_XDIST_WORKER_COUNT": "8"}
    assert share_cores(env) == 1 and env["OMP_NUM_THREADS"] == "1"
    env = {"PYTEST_XDIST_WORKER": "gw0", "PYTEST_XDIST_WORKER_COUNT": "2", "OMP_NUM_THREADS": "3"}
    assert share_cores(env) is None and env["OMP_NUM_THREADS"] == "3"  # a choice made is kept
    env = {}
    assert share_cores(env) is None and env == {}  # not under xdist


def test_units():
    assert unit_of("tests/server/test_openai_server.py::test_models") == "server"
    assert unit_of("tests/model/test_smollm2.py::test_x[a::b]") == "smollm2_transformers"
    assert unit_of("tests/unit/test_kv_cache.py::test_abort_frees_everything") == "tests/unit/test_kv_cache.py"
    listed = [p for paths in SHARED_FILES.values() for p in paths]
    assert len(listed) == len(set(listed))
