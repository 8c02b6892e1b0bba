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


def run_interp_scripts(runs, timeout: int = 600, env=None) -> list:
    """Run scripts under TRITON_INTERPRET=1 (it must be set before triton.jit runs, hence subprocesses), all at
    once, with the project and tests/ importable. runs: (script, args) pairs; env: one dict of extra variables per
    run, or None. Returns a CompletedProcess (text stdout / stderr) per run; every process is gone on return.
    The interpreter runs on one core, so independent scripts side by side take about the time of the longest."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    import pytest

    pytest.importorskip("triton")
    tests_dir = Path(__file__).resolve().parent
    base = {**os.environ, "TRITON_INTERPRET": "1",
            "PYTHONPATH": os.pathsep.join([str(tests_dir.parent), str(tests_dir), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, str(script), *args], env={**base, **(env[i] if env else {})},
                              cwd=str(Path(script).parent), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, (script, args) in enumerate(runs)]
    deadline = time.monotonic() + timeout
    try:
        done = []
        for (script, args), p in zip(runs, procs):
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{script} {' '.join(args)}: still running after {timeout} s")
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        return done
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def run_interp_script(helper, args=(), timeout: int = 600):
    """One script under TRITON_INTERPRET=1 (run_interp_scripts); its CompletedProcess."""
    return run_interp_scripts([(helper, tuple(args))], timeout)[0]


# Sharing one script's checks between processes: each process of run_interp_checks(shared=True) gets the claim
# folder and its direction through these variables (test harness only) and runs the checks it claims first.
CLAIM_DIR_VAR = "VOLTLLM_TEST_INTERP_CLAIM_DIR"
CLAIM_FROM_END_VAR = "VOLTLLM_TEST_INTERP_CLAIM_FROM_END"


def claimed(items, name_of=lambda item: item, only=()):
    """The items this process runs, in its order (only those named in `only` when given). Outside
    run_interp_checks(shared=True): all of them, in order.
    Inside: the process walks the list from its end (the second process) or from its start (the others) and keeps
    each item whose claim file it creates first, so the processes split the checks as they go, and a long check
    at either end of the list meets a process that has just started. torch's global generator is seeded from
    each check's name before it runs, so a check that draws from it gets the same inputs whichever process runs it,
    after whichever others."""
    import os
    import zlib

    import torch

    folder = os.environ.get(CLAIM_DIR_VAR)
    items = [item for item in items if not only or name_of(item) in only]
    if folder and os.environ.get(CLAIM_FROM_END_VAR) == "1":
        items.reverse()
    for item in items:
        if folder:
            try:
                os.close(os.open(os.path.join(folder, name_of(item)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                continue
        torch.manual_seed(zlib.crc32(name_of(item).encode()))
        yield item


def usable_cores() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def run_interp_checks(helper, args=(), timeout: int = 600, shared: bool = False) -> dict[str, str]:
    """run_interp_script, then {check name: "ok ..." | "FAIL ..."} from its `CHECK name status detail` lines.

    shared=True (the script picks its checks through `claimed`): one process per usable core, at most 4, share
    the checks. The interpreter runs on one core, and CI has two: the checks of the slowest scripts then take
    about half as long."""
    import tempfile

    import pytest

    jobs = min(usable_cores(), 4) if shared else 1
    with tempfile.TemporaryDirectory(prefix="interp-claims-") as folder:
        env = [{CLAIM_DIR_VAR: folder, CLAIM_FROM_END_VAR: str(int(i == 1))} for i in range(jobs)] if jobs > 1 else None
        procs = run_interp_scripts([(helper, tuple(args))] * jobs, timeout, env)
    crashed = [p.returncode for p in procs if p.returncode not in (0, 1)]
    if jobs > 1 and crashed:  # 1: a check failed (its line says which); anything else lost the checks it held
        pytest.fail(f"{helper}: a process died (rc={crashed}):\n{''.join(p.stderr for p in procs)[-4000:]}")
    results = {}
    for p in procs:
        for line in p.stdout.splitlines():
            if line.startswith("CHECK "):
                _, name, status, *detail = line.split(" ", 3)
                results[name] = f"{status} {' '.join(detail)}"
    if not results:
        codes = [p.returncode for p in procs]
        pytest.fail(f"{helper} produced no checks (rc={codes}):\n{''.join(p.stdout for p in procs)}\n"
                    f"{''.join(p.stderr for p in procs)[-4000:]}")
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
    for name, fn in claimed(checks.items(), lambda item: item[0], only):
        start = time.perf_counter()
        try:
            status = fn(device)
        except Exception as e:  # report and go on
            status = f"FAIL {type(e).__name__}: {e} {traceback.format_exc()[-800:]!r}"
        failed += not status.startswith("ok")
        print(f"CHECK {name} {status} ({time.perf_counter() - start:.1f} s)", flush=True)
    return 1 if failed else 0


def error_checks_main(checks) -> int:
    """main() of a check script whose checks return (relative error, problems): checks yields (name, fn, tol); under
    TRITON_INTERPRET=1 (else exit 2) each claimed check (argv names only those) prints `CHECK name ok|FAIL detail`,
    ok when the error is under its tolerance and there are no problems; one that raises is a FAIL and the rest go on.
    The generator is first iterated after the interpreter is patched, so its kernels' imports come after it."""
    import os
    import sys
    import traceback

    import torch

    if os.environ.get("TRITON_INTERPRET") != "1":
        print("run with TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    patch_interpreter_index()
    torch.set_num_threads(2)
    failed = 0
    for name, fn, tol in claimed(checks, lambda c: c[0], set(sys.argv[1:])):
        try:
            err, problems = fn()
            ok = err < tol and not problems
            detail = f"relerr={err:.3e} tol={tol:.0e} {problems}".strip()
        except Exception:
            ok, detail = False, traceback.format_exc().replace("\n", " | ")
        failed += not ok
        print(f"CHECK {name} {'ok' if ok else 'FAIL'} {detail}", flush=True)
    return 1 if failed else 0
