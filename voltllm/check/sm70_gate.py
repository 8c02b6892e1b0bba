"""The sm_70 / sm_75 compile gate: every compat-route Triton kernel must build for V100 and T4.

No GPU is needed: Triton cross-compiles for a named target,

    triton.compile(triton.compiler.ASTSource(fn=jit_fn, signature=spec.signature,
                                             constexprs=spec.constexprs),
                   target=triton.backends.compiler.GPUTarget("cuda", arch, 32))

which runs the whole pipeline (TTIR -> TTGIR -> LLVM IR -> PTX -> ptxas cubin) for `sm_<arch>`.
The gate then reads the TTIR and the PTX and fails a kernel that uses anything those chips lack:
bf16/fp8 types in the IR (Triton silently emulates bf16 and fp8e5 on sm_70), and PTX instructions
or types newer than the target per the PTX ISA target notes (voltllm/check/ptx_rules.py; the table is
in docs/sm70.md). Anything ptxas itself rejects for the target fails too, and so does a spec whose block needs
more shared memory than the target has (SHARED_MEMORY_LIMIT: a launch there would fail with "out of resource"),
unless its caller copes with that (`shared_fallback`: smaller tiles, then a torch form), where the size is only
reported (marked `ok*` in the table, with a note).

`find_unregistered_kernels()` lists module-level @triton.jit objects of voltllm.kernels that are
not in REGISTRY, not called (transitively, by name) from a registered kernel, and not named in their
module's `__triton_helpers__` tuple (declared device helpers).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import pkgutil
import sys
import tempfile
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Iterable, Optional, Sequence, Union

from voltllm.check.ptx_rules import check_ir, check_ptx
from voltllm.check.ptxas_cover import assemble, choose_for_ptxas, instruction_forms
from voltllm.kernels.registry import REGISTRY, CompileSpec, KernelEntry

PACKAGE = "voltllm.kernels"
DEFAULT_ARCHS = (70, 75)
MAX_LINES_PER_RESULT = 8
# Shared memory one block may use (opt-in maximum, bytes): V100 96 KB, T4 / RTX 20xx 64 KB. The spec's size is
# Triton's own figure for the compiled kernel (its launcher checks the same one against the device).
SHARED_MEMORY_LIMIT = {70: 96 * 1024, 75: 64 * 1024}


# ---------------------------------------------------------------------------------------------
# compilation
# ---------------------------------------------------------------------------------------------
def _kernel_interface() -> type:
    from triton.runtime.jit import KernelInterface
    return KernelInterface


def _innermost(obj: Any) -> Any:
    """The JITFunction under Autotuner/Heuristics wrappers (which keep it in `.fn`)."""
    ki = _kernel_interface()
    while isinstance(getattr(obj, "fn", None), ki):
        obj = obj.fn
    return obj


_COMPILED: dict[tuple, tuple[str, str, int]] = {}


def _unassembled_path(key: tuple) -> str:
    """Where a compile that stopped before ptxas keeps (TTIR, PTX, shared bytes): Triton caches a kernel only after
    its last stage, so without this a second gate run would compile those specs again. In Triton's cache directory,
    keyed like compile_for's memo plus the Triton version (which fixes its LLVM)."""
    import hashlib

    import triton

    digest = hashlib.sha256(repr((triton.__version__, key)).encode()).hexdigest()
    return os.path.join(_gate_cache_dir(), "ptx", digest[:2], digest + ".json.gz")


def _gate_cache_dir() -> str:
    """The gate's own cache, inside Triton's cache directory (cleared with it)."""
    from triton import knobs

    return os.path.join(knobs.cache.dir, "voltllm-gate")


def _load_unassembled(key: tuple) -> Optional[tuple[str, str, int]]:
    import gzip
    import json

    try:
        with gzip.open(_unassembled_path(key), "rt") as f:
            d = json.load(f)
        return d["ttir"], d["ptx"], int(d["shared"])
    except (OSError, ValueError, KeyError, TypeError, EOFError):  # absent or damaged: compile again
        return None


def _store_unassembled(key: tuple, value: tuple[str, str, int]) -> None:
    import gzip
    import json

    path = _unassembled_path(key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with gzip.open(tmp, "wt") as f:
            json.dump({"ttir": value[0], "ptx": value[1], "shared": value[2]}, f)
        os.replace(tmp, path)  # atomic: parallel workers never read half a file
    except OSError:  # a read-only cache only costs the next run its compile time
        pass


class _StopBeforePtxas(Exception):
    """Raised in place of Triton's cubin stage when the caller wants the PTX only (nothing reaches Triton's cache:
    it stores a kernel only after its last stage)."""


def aligned_attrs(signature: dict) -> dict:
    """ASTSource attrs marking the pointer arguments and the integer `stride*` arguments of `signature` divisible by
    16: how Triton's JIT specializes a launch on 16-byte-aligned tensors whose strides are multiples of 16 (the usual
    case at run time; the spec alone leaves them unspecialized, which changes vectorization and register use)."""
    return {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(signature.items())
            if ty.startswith("*") or (name.startswith("stride") and ty in ("i32", "i64"))}


def compile_for(fn: Any, spec: CompileSpec, arch: int, options: Optional[dict] = None,
                assemble: bool = True, aligned: bool = False) -> tuple[str, str, int]:
    """(TTIR, PTX, shared memory bytes per block) of one specialization of `fn` for sm_<arch>, cross-compiled
    without a GPU. options: Triton's compile options (num_warps, num_stages; its defaults when None).
    assemble=False stops before ptxas (the shared memory size is known from the LLVM IR stage on).
    aligned: with the divisibility of aligned tensors (aligned_attrs), as most launches run."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    jit_fn = _innermost(fn)
    if not isinstance(jit_fn, JITFunction):
        raise TypeError(f"{fn!r} is not a triton.jit function (is TRITON_INTERPRET set? the gate needs it unset)")
    key = (jit_fn.cache_key, tuple(sorted(spec.signature.items())), repr(sorted(spec.constexprs.items())), arch,
           repr(sorted((options or {}).items())), aligned)
    hit = _COMPILED.get((key, True)) or (None if assemble else _COMPILED.get((key, False)))
    if hit is None and not assemble:
        hit = _load_unassembled(key)
        if hit is not None:
            _COMPILED[(key, False)] = hit
    if hit is not None:
        return hit
    src = triton.compiler.ASTSource(fn=jit_fn, signature=dict(spec.signature), constexprs=dict(spec.constexprs),
                                    attrs=aligned_attrs(spec.signature) if aligned else None)
    # keep the PTX even when a later stage (ptxas) fails, so a failure can show the offending lines
    stash: dict[str, Any] = {}
    previous = knobs.runtime.add_stages_inspection_hook

    def hook(backend: Any, stages: dict, options: Any, language: Any, capability: Any) -> None:
        if previous is not None:
            previous(backend, stages, options, language, capability)
        for name in ("ttir", "ptx"):
            make = stages.get(name)
            if make is not None:
                def stage(mod: Any, metadata: dict, make: Any = make, name: str = name) -> Any:
                    out = make(mod, metadata)
                    stash[name] = str(out)
                    return out
                stages[name] = stage
        if not assemble and "cubin" in stages:
            def stop(mod: Any, metadata: dict) -> Any:
                stash["shared"] = int(metadata["shared"])
                raise _StopBeforePtxas()
            stages["cubin"] = stop

    knobs.runtime.add_stages_inspection_hook = hook
    try:
        # on a ptxas error Triton prints the whole PTX to stdout; the gate reports it its own way
        with contextlib.redirect_stdout(io.StringIO()):
            kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    except _StopBeforePtxas:
        kernel = None
    except Exception as e:
        e.gate_ptx = stash.get("ptx")  # type: ignore[attr-defined]
        raise
    finally:
        knobs.runtime.add_stages_inspection_hook = previous
    if kernel is None:
        _COMPILED[(key, False)] = (stash["ttir"], stash["ptx"], stash["shared"])
        _store_unassembled(key, _COMPILED[(key, False)])
        return _COMPILED[(key, False)]
    asm = kernel.asm
    if "ptx" not in asm or "ttir" not in asm:
        raise RuntimeError("Triton kept no PTX/TTIR (unset TRITON_STORE_BINARY_ONLY)")
    _COMPILED[(key, True)] = (asm["ttir"], asm["ptx"], int(kernel.metadata.shared))
    return _COMPILED[(key, True)]


# ---------------------------------------------------------------------------------------------
# module discovery
# ---------------------------------------------------------------------------------------------
def import_kernel_modules(modules: Optional[Iterable[Union[str, ModuleType]]] = None
                          ) -> tuple[list[ModuleType], dict[str, str]]:
    """Import the given modules, or every module under voltllm.kernels (found with pkgutil).

    Returns (modules, {module name: import error}).
    """
    names: list[str] = []
    found: list[ModuleType] = []
    errors: dict[str, str] = {}
    if modules is None:
        pkg = importlib.import_module(PACKAGE)
        found.append(pkg)

        def onerror(name: str) -> None:
            errors[name] = _exc_line(sys.exc_info()[1])

        for info in pkgutil.walk_packages(pkg.__path__, prefix=PACKAGE + ".", onerror=onerror):
            names.append(info.name)
    else:
        for m in modules:
            if isinstance(m, ModuleType):
                found.append(m)
            else:
                names.append(m)
    for name in names:
        try:
            found.append(importlib.import_module(name))
        except Exception as e:  # noqa: BLE001 - a broken module is a gate failure, not a crash
            errors[name] = _exc_line(e)
    return found, errors


def _exc_line(e: Optional[BaseException]) -> str:
    if e is None:
        return "unknown error"
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[-1] if msg else ''}"


def _module_jit_objects(mod: ModuleType) -> list[tuple[str, Any]]:
    ki = _kernel_interface()
    out = []
    for name, obj in vars(mod).items():
        if not isinstance(obj, ki):
            continue
        inner = _innermost(obj)
        pyfn = getattr(inner, "fn", None)
        if getattr(pyfn, "__module__", None) != mod.__name__:
            continue  # imported from elsewhere; it belongs to its own module
        out.append((name, obj))
    return out


def _called_jit_functions(jit_fn: Any) -> list[Any]:
    """@triton.jit functions that `jit_fn` calls by a global name or a module attribute (a.b.f)."""
    import ast
    import textwrap

    pyfn = getattr(jit_fn, "fn", None)
    src = getattr(jit_fn, "_src", None)
    if pyfn is None or src is None:
        return []
    try:
        tree = ast.parse(textwrap.dedent(src))
    except SyntaxError:
        return []
    ki = _kernel_interface()
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        parts: list[str] = []
        f = node.func
        while isinstance(f, ast.Attribute):
            parts.append(f.attr)
            f = f.value
        if not isinstance(f, ast.Name):
            continue
        obj = pyfn.__globals__.get(f.id)
        for attr in reversed(parts):
            obj = getattr(obj, attr, None)
        if isinstance(obj, ki):
            found.append(_innermost(obj))
    return found


def _reachable_from_registry() -> set[int]:
    """ids of the registered kernels and of every @triton.jit helper they call, transitively."""
    todo = [_innermost(e.fn) for e in REGISTRY.values()]
    seen: set[int] = set()
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        todo += _called_jit_functions(fn)
    return seen


def find_unregistered_kernels(modules: Optional[Iterable[Union[str, ModuleType]]] = None) -> list[str]:
    """'module:name' of module-level @triton.jit objects of the kernel modules that are not
    registered, not called (transitively) by a registered kernel, and not named in the module's
    `__triton_helpers__` tuple. Modules that fail to import are listed too."""
    mods, errors = import_kernel_modules(modules)
    covered = _reachable_from_registry()
    out = [f"{name} (import failed: {err})" for name, err in sorted(errors.items())]
    for mod in mods:
        helpers = set(getattr(mod, "__triton_helpers__", ()))
        for name, obj in _module_jit_objects(mod):
            if id(_innermost(obj)) not in covered and name not in helpers:
                out.append(f"{mod.__name__}:{name}")
    return sorted(out)


# ---------------------------------------------------------------------------------------------
# the gate
# ---------------------------------------------------------------------------------------------
@dataclass
class GateResult:
    kernel: str
    label: str
    arch: int
    status: str  # "ok" | "failed" | "skipped"
    reasons: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)  # offending PTX/IR lines, "L<no>: <text>"

    @property
    def ok(self) -> bool:
        return self.status != "failed"


@dataclass
class GateReport:
    archs: tuple[int, ...]
    results: list[GateResult]
    import_errors: dict[str, str] = field(default_factory=dict)
    unregistered: list[str] = field(default_factory=list)
    assembled: dict[int, tuple[int, int]] = field(default_factory=dict)  # arch -> (specs ptxas ran on, compiled)

    @property
    def failures(self) -> list[GateResult]:
        return [r for r in self.results if r.status == "failed"]

    @property
    def ok(self) -> bool:
        return not self.failures and not self.import_errors and not self.unregistered

    def format_table(self, max_lines: int = MAX_LINES_PER_RESULT) -> str:
        rows: dict[tuple[str, str], dict[int, str]] = {}
        for r in self.results:
            cell = {"ok": "ok", "failed": "FAIL", "skipped": "-"}[r.status]
            rows.setdefault((r.kernel, r.label), {})[r.arch] = cell + ("*" if r.status == "ok" and r.reasons else "")
        head = ["kernel", "spec"] + [f"sm_{a}" for a in self.archs]
        body = [[k, lab or "-"] + [cells.get(a, "") for a in self.archs] for (k, lab), cells in rows.items()]
        widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
        fmt = "  ".join("{:<%d}" % w for w in widths)
        out = [fmt.format(*head), fmt.format(*["-" * w for w in widths])]
        out += [fmt.format(*row) for row in body]
        for r in self.failures:
            out.append("")
            out.append(f"FAIL {r.kernel} [{r.label or '-'}] sm_{r.arch}:")
            out += [f"  - {why}" for why in dict.fromkeys(r.reasons)]
            out += [f"    {ln}" for ln in r.lines[:max_lines]]
            if len(r.lines) > max_lines:
                out.append(f"    ... {len(r.lines) - max_lines} more")
        for r in self.results:
            if r.status == "ok" and r.reasons:
                out.append(f"* {r.kernel} [{r.label or '-'}] sm_{r.arch}: {'; '.join(r.reasons)}")
        for name, err in self.import_errors.items():
            out.append(f"IMPORT FAILED {name}: {err}")
        for name in self.unregistered:
            out.append(f"UNREGISTERED {name}: register it (voltllm.kernels.registry.register_kernel) or list it "
                       f"in its module's __triton_helpers__")
        n_fail = len(self.failures)
        for arch, (done, compiled) in self.assembled.items():
            out.append(f"ptxas sm_{arch}: assembled {done} of {compiled} compiled specs"
                       + (" (every kernel and instruction form)" if done < compiled else ""))
        out.append("")
        out.append(f"{len(self.results)} checks, {n_fail} failed, {len(self.import_errors)} import errors, "
                   f"{len(self.unregistered)} unregistered: {'PASS' if self.ok else 'FAIL'}")
        return "\n".join(out)


Outcome = tuple  # ("ok", IR and PTX rule violations, shared bytes) | ("error", reason, lines)


def triton_compilation_errors() -> tuple[type, ...]:
    from triton.compiler.errors import CompilationError
    return (CompilationError,)


def _error_outcome(e: BaseException, arch: int, ptx: Optional[str]) -> Outcome:
    """A compile error (Triton or ptxas) as a failed outcome: the first message lines and any rule-breaking PTX."""
    text = [ln for ln in str(e).strip().splitlines() if ln.strip()][:20]
    bad = check_ptx(ptx, arch) if ptx else []
    reason = f"does not compile for sm_{arch}: {type(e).__name__}"
    last = [ln.strip() for ln in text if not ln.startswith((" ", "\t"))]
    if isinstance(e, triton_compilation_errors()) and last:
        reason += f": {last[-1]}"
    return ("error", "; ".join(dict.fromkeys([reason] + [v.reason for v in bad])),
            [f"L{v.line_no}: {v.line}" for v in bad] + text)


class PtxasError(RuntimeError):
    """ptxas refused a spec's PTX for the target."""


def _compile_to_ptx(fn: Any, spec: CompileSpec, arch: int, ptx_path: str, aligned: bool = False
                    ) -> tuple[Outcome, int, frozenset[str]]:
    """(outcome, PTX size, instruction forms) of one spec compiled up to PTX and checked against the rules (in the
    worker that compiled it: the checks run in parallel, and the PTX, 92 MB for the whole registry, goes to
    `ptx_path` for ptxas, not back to the parent)."""
    try:
        ttir, ptx, shared = compile_for(fn, spec, arch, assemble=False, aligned=aligned)
    except Exception as e:  # noqa: BLE001 - a compile error fails the kernel
        return _error_outcome(e, arch, getattr(e, "gate_ptx", None)), 0, frozenset()
    with open(ptx_path, "w") as f:
        f.write(ptx)
    return ("ok", check_ir(ttir) + check_ptx(ptx, arch), shared), len(ptx), instruction_forms(ptx)


def check_entry(entry: KernelEntry, archs: Sequence[int], outcomes: dict[tuple[str, int, int], Outcome]
                ) -> list[GateResult]:
    """Gate results of one kernel: every spec x arch, from the outcomes run_gate compiled and checked."""
    results = []
    for i, spec in enumerate(entry.specs):
        label = spec.label or f"spec{i}"
        for arch in archs:
            if not (entry.compat and spec.compat):
                results.append(GateResult(entry.name, label, arch, "skipped", ["native route only (compat=False)"]))
                continue
            outcome = outcomes[(entry.name, i, arch)]
            if outcome[0] == "error":
                results.append(GateResult(entry.name, label, arch, "failed", [outcome[1]], list(outcome[2])))
                continue
            bad = outcome[1]
            reasons, lines = [v.reason for v in bad], [f"L{v.line_no}: {v.line}" for v in bad]
            shared, limit = outcome[2], SHARED_MEMORY_LIMIT.get(arch)
            note = []
            if limit is not None and shared > limit:
                why = f"needs {shared // 1024} KB of shared memory per block; sm_{arch} has {limit // 1024} KB"
                if entry.shared_fallback:
                    note = [why + " (its caller falls back)"]
                else:
                    reasons.append(why)
            if reasons:
                results.append(GateResult(entry.name, label, arch, "failed", reasons, lines))
            else:
                results.append(GateResult(entry.name, label, arch, "ok", note))
    for arch in archs:  # say so when no spec fits at all: the caller's last resort (a torch form) runs there
        mine = [r for r in results if r.arch == arch and r.status == "ok"]
        if mine and all(r.reasons for r in mine):
            for r in mine:
                r.reasons.append(f"no spec of {entry.name} fits sm_{arch}: its caller's torch form runs there")
    return results


# --- compilation in two passes: every spec to PTX (in spawned workers that import the kernel modules and compile by
# registry name), then ptxas on the specs ptxas_cover chooses (or on all of them)
def _worker_init(module_names: Sequence[str]) -> None:
    for name in module_names:
        importlib.import_module(name)


def _worker_compile(name: str, index: int, arch: int, ptx_path: str, aligned: bool
                    ) -> tuple[Outcome, int, frozenset[str]]:
    entry = REGISTRY[name]
    return _compile_to_ptx(entry.fn, entry.specs[index], arch, ptx_path, aligned)


def _default_jobs() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return max(1, min(n, 8))


Task = tuple  # (kernel name, spec index, arch)


def _compile_all_to_ptx(entries: Sequence[KernelEntry], archs: Sequence[int], jobs: int, ptx_dir: str,
                        aligned: bool = False) -> dict[Task, tuple[Outcome, int, frozenset[str], str]]:
    """Per task: (outcome, PTX size, instruction forms, PTX file in `ptx_dir`)."""
    by_name = {e.name: e for e in entries}
    tasks = [(e.name, i, a) for e in entries if e.compat for i, s in enumerate(e.specs) if s.compat for a in archs]
    path = {t: os.path.join(ptx_dir, f"{n}.ptx") for n, t in enumerate(tasks)}
    # registered kernels compile in spawned workers by name; others (a kernel defined in a test) in-process
    remote = [t for t in tasks if REGISTRY.get(t[0]) is by_name[t[0]]] if jobs > 1 and len(tasks) > 1 else []
    out: dict[Task, tuple[Outcome, int, frozenset[str]]] = {}
    if remote:
        from concurrent.futures import ProcessPoolExecutor
        from multiprocessing import get_context

        modules = sorted({_innermost(REGISTRY[n].fn).fn.__module__ for n, _, _ in remote})
        with ProcessPoolExecutor(max_workers=min(jobs, len(remote)), mp_context=get_context("spawn"),
                                 initializer=_worker_init, initargs=(modules,)) as pool:
            futures = {t: pool.submit(_worker_compile, *t, path[t], aligned) for t in remote}
            for t, fut in futures.items():
                try:
                    out[t] = fut.result()
                except Exception as e:  # noqa: BLE001 - a dead worker: compile that one in-process instead
                    print(f"sm70 gate: worker failed on {t}: {_exc_line(e)}", file=sys.stderr)
    for t in tasks:
        if t not in out:
            name, i, arch = t
            out[t] = _compile_to_ptx(by_name[name].fn, by_name[name].specs[i], arch, path[t], aligned)
    return {t: (*out[t], path[t]) for t in tasks}


def _assemble_chosen(compiled: dict[Task, tuple[Outcome, int, frozenset[str], str]], archs: Sequence[int],
                     ptxas: str, jobs: int) -> tuple[dict[Task, Outcome], dict[int, tuple[int, int]]]:
    """Outcomes after ptxas ran on the chosen specs (a refused one fails), and per arch (assembled, compiled)."""
    from concurrent.futures import ThreadPoolExecutor

    outcomes = {t: c[0] for t, c in compiled.items()}
    chosen: list[Task] = []
    counts: dict[int, tuple[int, int]] = {}
    for arch in archs:
        ok = {t: (t[0], size, forms) for t, (o, size, forms, _) in compiled.items() if t[2] == arch and o[0] == "ok"}
        mine = set(ok) if ptxas == "all" else choose_for_ptxas(ok)
        chosen += sorted(mine)
        counts[arch] = (len(mine), len(ok))
    paths = {t: compiled[t][3] for t in chosen}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        cache = os.path.join(_gate_cache_dir(), "ptxas-accepted")
        logs = dict(zip(chosen, pool.map(lambda t: assemble(paths[t], t[2], cache), chosen)))
    for t, log in logs.items():
        if log is not None:
            with open(paths[t]) as f:
                outcomes[t] = _error_outcome(PtxasError(log), t[2], f.read())
    return outcomes, counts


def run_gate(archs: Sequence[int] = DEFAULT_ARCHS, modules: Optional[Iterable[Union[str, ModuleType]]] = None,
             entries: Optional[Sequence[KernelEntry]] = None, jobs: Optional[int] = None,
             ptxas: str = "cover", aligned: bool = False) -> GateReport:
    """Cross-compile every compat kernel spec for each arch and check its TTIR and PTX.

    modules=None imports all of voltllm.kernels (and also reports unregistered @triton.jit objects);
    a list of module names limits the check to kernels defined in those modules. `entries` checks the
    given KernelEntry objects only (no imports), e.g. a kernel defined in a test. Registered kernels
    compile in `jobs` spawned processes (default: the usable CPU cores, at most 8; 1 = in-process).
    ptxas: "cover" assembles the specs voltllm.check.ptxas_cover chooses (every kernel and every instruction form
    once per arch), "all" every spec. aligned: compile with the divisibility of aligned tensors (aligned_attrs).
    """
    if ptxas not in ("cover", "all"):
        raise ValueError(f"ptxas must be 'cover' or 'all', not {ptxas!r}")
    archs = tuple(int(a) for a in archs)
    import_errors: dict[str, str] = {}
    unregistered: list[str] = []
    if entries is None:
        mods, import_errors = import_kernel_modules(modules)
        if modules is None:
            entries = list(REGISTRY.values())
            unregistered = [u for u in find_unregistered_kernels(mods) if "import failed" not in u]
        else:
            names = {m.__name__ for m in mods}
            entries = [e for e in REGISTRY.values()
                       if getattr(getattr(_innermost(e.fn), "fn", None), "__module__", None) in names]
    jobs = _default_jobs() if jobs is None else jobs
    with tempfile.TemporaryDirectory(prefix="voltllm-gate-") as ptx_dir:
        compiled = _compile_all_to_ptx(entries, archs, jobs, ptx_dir, aligned)
        outcomes, assembled = _assemble_chosen(compiled, archs, ptxas, jobs)
    results: list[GateResult] = []
    for entry in entries:
        results += check_entry(entry, archs, outcomes)
    return GateReport(archs, results, import_errors, unregistered, assembled)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="voltllm check --sm70",
                                description="Cross-compile the compat-route Triton kernels for sm_70/sm_75 "
                                            "and reject instructions those GPUs lack.")
    p.add_argument("--arch", type=int, action="append", help="compute capability (repeatable; default 70 and 75)")
    p.add_argument("--module", action="append", help="only kernels of this module (repeatable)")
    p.add_argument("--max-lines", type=int, default=MAX_LINES_PER_RESULT, help="offending lines shown per failure")
    p.add_argument("--jobs", "-j", type=int, default=None, help="compile processes (default: CPU cores, max 8)")
    p.add_argument("--ptxas", choices=("cover", "all"), default="cover",
                   help="which specs ptxas assembles: every kernel and instruction form once per arch (cover, the "
                        "default) or every spec (all)")
    p.add_argument("--aligned", action="store_true",
                   help="compile each spec as the JIT specializes it for 16-byte-aligned tensors whose strides are "
                        "multiples of 16 (pointer and stride arguments divisible by 16) instead of unspecialized")
    args = p.parse_args(list(argv) if argv is not None else None)
    report = run_gate(tuple(args.arch) if args.arch else DEFAULT_ARCHS, args.module, jobs=args.jobs,
                      ptxas=args.ptxas, aligned=args.aligned)
    print(report.format_table(args.max_lines))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
