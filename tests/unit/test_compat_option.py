"""The suite's `--compat {none,sm70,sm75}` option (tests/conftest.py): engines default to that route unless a
test passes compat; bf16 engines and `native_only` tests skip under sm70/sm75."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from voltllm.config import EngineArgs

TESTS = Path(__file__).resolve().parents[1]


def _root_conftest():
    """tests/conftest.py by path ('conftest' in sys.modules may be another directory's conftest)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("_voltllm_root_conftest", TESTS / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_install_compat_default():
    install_compat_default = _root_conftest().install_compat_default
    before = EngineArgs.__init__
    undo = install_compat_default("sm70")
    try:
        assert EngineArgs(model="m").compat == "sm70"
        assert EngineArgs(model="m", dtype="float16", device="cuda").compat == "sm70"
        assert EngineArgs(model="m", compat="none").compat == "none"  # a test's own compat wins
        assert EngineArgs(model="m", compat="auto").compat == "auto"
        assert EngineArgs(model="m", device="cpu").compat == "auto"  # CPU references keep their route
        with pytest.raises(pytest.skip.Exception, match="bf16"):
            EngineArgs(model="m", dtype="bfloat16")
        assert EngineArgs(model="m", dtype="bfloat16", compat="none").dtype == "bfloat16"
    finally:
        undo()
    assert EngineArgs.__init__ is before and EngineArgs(model="m").compat == "auto"
    undo = install_compat_default("none")
    try:
        assert EngineArgs(model="m", dtype="bfloat16").compat == "none"  # the native route keeps bf16
    finally:
        undo()


INNER = textwrap.dedent('''
    import pytest
    from voltllm import LLM
    from voltllm.config import EngineArgs

    def test_default():
        assert EngineArgs(model="m").compat == EXPECTED

    def test_explicit():
        assert EngineArgs(model="m", compat="none").compat == "none"

    def test_llm_kwargs(monkeypatch):
        seen = []
        monkeypatch.setattr(EngineArgs, "create_engine_config", lambda self: seen.append(self.compat) or 1 / 0)
        with pytest.raises(ZeroDivisionError):
            LLM("m", dtype="float16")
        assert seen == [EXPECTED]

    def test_bf16():
        EngineArgs(model="m", dtype="bfloat16")

    @pytest.mark.native_only("asserts the tensor-core route")
    def test_native():
        pass
''')


def _run(tmp_path: Path, *opts: str, expected: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_inner.py").write_text(INNER.replace("EXPECTED", repr(expected)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS.parent)]))
    # -p conftest loads this suite's tests/conftest.py as a plugin (the inner file lives outside tests/)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "conftest", "-p", "no:cacheprovider",
                           "test_inner.py", *opts], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def test_compat_option_end_to_end(tmp_path):
    r = _run(tmp_path, "--compat", "sm70", expected="sm70")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 passed, 2 skipped" in r.stdout, r.stdout
    assert "native only under --compat sm70: bf16 engine" in r.stdout
    assert "native only under --compat sm70: asserts the tensor-core route" in r.stdout
    r = _run(tmp_path, expected="auto")  # no option: nothing changes, nothing skips
    assert r.returncode == 0 and "5 passed" in r.stdout, r.stdout + r.stderr
    r = _run(tmp_path, "--compat", "sm80", expected="sm80")
    assert r.returncode == 4 and "invalid choice" in r.stderr, r.stderr
