"""The SASS of a registered Triton kernel, read without a GPU: registers, shared memory, and the instruction mix of each
loop (a backward branch's body), for one of its gate specs with constexprs overridden.

    PYTHONPATH=$PWD python3 benchmarks/micro/sass_loop_mix.py quant.half2_rows_matmul --spec "INT4_G128_ZP n2 m1" \\
        --set U=32 STAGES=3 --warps 1 [--arch 90] [--divisible X,LO,stride_lo] [--dump]

Triton cross-compiles the spec for sm_<arch> here (kernels/registry.py's CompileSpec, as the sm_70 gate does) and its
bundled `cuobjdump` disassembles the cubin. Pointer arguments are compiled as 16-byte aligned (the runtime's usual
specialization for torch tensors); --divisible adds integer arguments known to be multiples of 16 (strides, sizes).
Instruction counts per loop iteration, divided by the weights (or elements) an iteration covers, tell an issue-bound
kernel from a bandwidth-bound one before any device time is spent (docs/kernels.md, packed-fp16 GEMV, session 27-28).
"""
from __future__ import annotations

import argparse
import ast
import collections
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field


@dataclass
class Loop:
    start: int  # byte offsets in the SASS listing
    end: int
    ops: collections.Counter = field(default_factory=collections.Counter)

    @property
    def size(self) -> int:
        return sum(self.ops.values())


@dataclass
class SassReport:
    kernel: str
    arch: int
    registers: int
    shared: int
    instructions: int
    loops: list[Loop]
    listing: list[str]


_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)")
_TARGET = re.compile(r"\b0x([0-9a-f]+)\b")


def parse_sass(text: str) -> tuple[list[tuple[int, str, str]], list[Loop]]:
    """(offset, opcode, line) of every instruction, and the loops: each backward branch with the instructions from its
    target up to it, by opcode family (the part before the first dot)."""
    ops = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            ops.append((int(m.group(1), 16), m.group(2), line))
    loops = []
    for at, op, line in ops:
        if not op.startswith("BRA"):
            continue
        t = _TARGET.search(line.split(op, 1)[1])
        if t and int(t.group(1), 16) < at:
            start = int(t.group(1), 16)
            loops.append(Loop(start, at, collections.Counter(o.split(".")[0] for a, o, _ in ops if start <= a <= at)))
    return ops, loops


def _tool(name: str) -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{name} is not bundled with this Triton ({path})")
    return path


def report(kernel_name: str, spec_label: str | None = None, overrides: dict | None = None, warps: int = 4,
           arch: int = 90, divisible: tuple[str, ...] = ()) -> SassReport:
    import triton
    from triton.backends.compiler import GPUTarget

    from voltllm.check.sm70_gate import _innermost, import_kernel_modules
    from voltllm.kernels.registry import REGISTRY

    import_kernel_modules()
    if kernel_name not in REGISTRY:
        raise SystemExit(f"unknown kernel {kernel_name!r}; registered: {', '.join(sorted(REGISTRY))}")
    entry = REGISTRY[kernel_name]
    specs = [s for s in entry.specs if spec_label is None or s.label == spec_label]
    if not specs:
        raise SystemExit(f"{kernel_name} has no spec {spec_label!r}; its specs: {[s.label for s in entry.specs]}")
    spec = specs[0]
    fn = _innermost(entry.fn)
    constexprs = {**spec.constexprs, **(overrides or {})}
    unknown = set(overrides or {}) - set(spec.constexprs)
    if unknown:
        raise SystemExit(f"not constexprs of this spec: {sorted(unknown)} (it has {sorted(spec.constexprs)})")
    names = list(fn.arg_names)
    aligned = [n for n, t in spec.signature.items() if t.startswith("*")] + list(divisible)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned if n in names}
    src = triton.compiler.ASTSource(fn=fn, signature=dict(spec.signature), constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True,
                             check=True).stdout
    reg = re.search(r"REG:(\d+)", res)
    ops, loops = parse_sass(sass)
    return SassReport(kernel_name, arch, int(reg.group(1)) if reg else -1, int(compiled.metadata.shared), len(ops),
                      loops, [line for _, _, line in ops])


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernel", help="a registered kernel name (voltllm.kernels.registry), e.g. quant.half2_rows_matmul")
    ap.add_argument("--spec", default=None, help="the spec's label (default: its first)")
    ap.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE", help="constexpr overrides")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--arch", type=int, default=90, help="sm_<arch> (70, 75, 80, 86, 89, 90)")
    ap.add_argument("--divisible", default="", help="integer arguments known to be multiples of 16, comma-separated")
    ap.add_argument("--dump", action="store_true", help="print the whole listing too")
    args = ap.parse_args(argv)
    overrides = {}
    for item in args.set:
        name, eq, value = item.partition("=")
        if not eq:
            ap.error(f"--set takes NAME=VALUE, got {item!r}")
        overrides[name] = _value(value)
    r = report(args.kernel, args.spec, overrides, args.warps, args.arch,
               tuple(n for n in args.divisible.split(",") if n))
    print(f"{r.kernel} sm_{r.arch}: {r.instructions} instructions, {r.registers} registers / thread, "
          f"{r.shared} B shared")
    for lp in r.loops:
        mix = ", ".join(f"{op} {n}" for op, n in lp.ops.most_common())
        print(f"  loop {lp.start:#06x}-{lp.end:#06x}: {lp.size} instructions per iteration: {mix}")
    if args.dump:
        print("\n".join(r.listing))
    return 0


if __name__ == "__main__":
    sys.exit(main())
