"""tests/gpu_workers.py (used by tests/conftest.py): under pytest-xdist on a machine with several GPUs each worker gets one card."""
from gpu_workers import one_gpu_per_xdist_worker


def _gpus(tmp_path, n):
    d = tmp_path / "gpus"
    d.mkdir()
    for i in range(n):
        (d / f"0000:{i:02x}:00.0").mkdir()
    return str(d)


def test_workers_spread_over_the_gpus(tmp_path):
    two = _gpus(tmp_path, 2)
    for worker, gpu in (("gw0", 0), ("gw1", 1), ("gw2", 0), ("gw3", 1)):
        env = {"PYTEST_XDIST_WORKER": worker}
        assert one_gpu_per_xdist_worker(env, two) == gpu and env["CUDA_VISIBLE_DEVICES"] == str(gpu)


def test_left_alone_without_xdist_one_gpu_or_a_choice_made(tmp_path):
    env = {}
    assert one_gpu_per_xdist_worker(env, _gpus(tmp_path, 2)) is None and env == {}  # not under xdist
    env = {"PYTEST_XDIST_WORKER": "gw1", "CUDA_VISIBLE_DEVICES": "3"}
    assert one_gpu_per_xdist_worker(env, str(tmp_path / "gpus")) is None and env["CUDA_VISIBLE_DEVICES"] == "3"
    one = tmp_path / "one"
    one.mkdir()
    (one / "0000:01:00.0").mkdir()
    env = {"PYTEST_XDIST_WORKER": "gw1"}
    assert one_gpu_per_xdist_worker(env, str(one)) is None and "CUDA_VISIBLE_DEVICES" not in env
    assert one_gpu_per_xdist_worker({"PYTEST_XDIST_WORKER": "gw0"}, str(tmp_path / "none")) is None  # no driver
