"""Helpers for Triton-interpreter checks (scripts run with TRITON_INTERPRET=1 in a subprocess)."""


def patch_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a tensor used as a loop bound into an int with int(ndarray);
    numpy >= 2.4 rejects that for 1-element arrays. Test-side fix only; a no-op outside the interpreter."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    from triton.runtime import interpreter

    orig = interpreter._patch_lang_tensor
    if getattr(orig, "_voltllm_patched", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._voltllm_patched = True
    interpreter._patch_lang_tensor = patched


def load_script(path):
    """A Python file that is no package module (a check script, a benchmarks/ tool) imported as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(path)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def check_names(helper) -> list[str]:
    """The CHECKS list a check script defines (importing it runs no kernel: triton loads lazily there)."""
    return list(load_script(helper).CHECKS)


def run_interp_script(helper, args=(), timeout: int = 600):
    """Run a script under TRITON_INTERPRET=1 (it must be set before triton.jit runs, hence the subprocess),
    with the project and tests/ importable; returns the CompletedProcess (text stdout / stderr)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    pytest.importorskip("triton")
    tests_dir = Path(__file__).resolve().parent
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(tests_dir.parent), str(tests_dir), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(helper), *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=str(Path(helper).parent))


def run_interp_checks(helper, args=(), timeout: int = 600) -> dict[str, str]:
    """run_interp_script, then {check name: "ok ..." | "FAIL ..."} from its `CHECK name status detail` lines."""
    import pytest

    proc = run_interp_script(helper, args, timeout)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CHECK "):
            _, name, status, *detail = line.split(" ", 3)
            results[name] = f"{status} {' '.join(detail)}"
    if not results:
        pytest.fail(f"{helper} produced no checks (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}")
    return results


def registered_kernels(module: str, prefix: str) -> list[str]:
    """Names in voltllm's kernel registry starting with prefix once `module` is imported (in a subprocess
    under the interpreter, so no GPU is needed)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    pytest.importorskip("triton")
    code = (f"import {module}; from voltllm.kernels.registry import REGISTRY; "
            f"print(sorted(n for n in REGISTRY if n.startswith({prefix!r})))")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return eval(out.stdout.strip().splitlines()[-1])  # a printed list of str


def run_checks(checks: dict, device: str, only=()) -> int:
    """Run each check (name -> fn(device) -> "ok ..." | "FAIL ..."; only those named in `only` when given),
    printing `CHECK name status detail`; a check that raises is reported as FAIL and the rest go on. Returns
    the script's exit code."""
    import time
    import traceback

    failed = 0
    for name, fn in checks.items():
        if only and name not in only:
            continue
        start = time.perf_counter()
        try:
            status = fn(device)
        except Exception as e:  # report and go on
            status = f"FAIL {type(e).__name__}: {e} {traceback.format_exc()[-800:]!r}"
        failed += not status.startswith("ok")
        print(f"CHECK {name} {status} ({time.perf_counter() - start:.1f} s)", flush=True)
    return 1 if failed else 0
