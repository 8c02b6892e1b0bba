"""Which compiled specs the sm_70 / sm_75 gate hands to ptxas, and the ptxas run itself.

The gate compiles every compat spec to PTX and checks it (the PTX rules, shared memory against the target). Running
ptxas on all of them is ~45% of the gate's time (docs/sm70.md, "What it costs"). What ptxas adds over the rules is
whether the target accepts each instruction form the PTX uses: an opcode with its modifiers and types, a directive,
a special register. Tile sizes, warps and stages change how many instructions there are, not which forms. So per
target the gate assembles each kernel's smallest spec and, smallest first, every spec whose PTX has a form that no
spec chosen before it has: then every form any compat kernel uses has been through ptxas for that target.
`ptxas="all"` in the gate assembles every spec.
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import tempfile
from typing import Hashable, Mapping, Optional

# a statement's head: an optional guard predicate, then the opcode with its modifiers (ld.global.nc.v4.b32) or a
# directive with its first qualifier (.reg .b32, .shared .align); labels, braces, comments and continuation lines
# of a multi-line instruction start otherwise and are skipped
_STATEMENT = re.compile(r"^[ \t]*(?:@!?%\w+[ \t]+)?([.a-z][\w.:]*)(?:[ \t]+(\.\w+))?", re.M)
_PERCENT_NAME = re.compile(r"%[A-Za-z_][\w.]*")
_VIRTUAL_REGISTER = re.compile(r"%[a-z]{1,3}\d+")  # %r12, %rd3, %f7, %p1, %rs2: Triton's virtual registers


def instruction_forms(ptx: str) -> frozenset[str]:
    """The opcodes (with modifiers and types), directives and special registers (%tid.x, %laneid, ...) in `ptx`."""
    forms = set()
    for m in _STATEMENT.finditer(ptx):
        head, qualifier = m.group(1), m.group(2)
        forms.add(f"{head} {qualifier}" if head.startswith(".") and qualifier else head)
    forms.update(t for t in _PERCENT_NAME.findall(ptx) if not _VIRTUAL_REGISTER.fullmatch(t))
    return frozenset(forms)


def choose_for_ptxas(candidates: Mapping[Hashable, tuple[str, int, frozenset[str]]]) -> set:
    """Keys to assemble among one target's compiled specs, `candidates`: key -> (kernel name, PTX size, forms).

    Smallest PTX first (ptxas time grows with it), a spec is chosen when its kernel has none chosen yet or its PTX
    has a form no chosen spec has."""
    chosen: set = set()
    covered: set[str] = set()
    kernels: set[str] = set()
    for key in sorted(candidates, key=lambda k: (candidates[k][1], repr(k))):
        kernel, _, forms = candidates[key]
        if kernel not in kernels or not forms <= covered:
            chosen.add(key)
            kernels.add(kernel)
            covered |= forms
    return chosen


def assemble(ptx_path: str, arch: int, cache_dir: Optional[str] = None) -> Optional[str]:
    """Run Triton's ptxas on a PTX file for sm_<arch> with Triton's flags; None when it assembles, else its log.

    cache_dir: where a success is remembered (an empty file named by the hash of the PTX, the target and the ptxas
    binary), so a second gate run skips ptxas for PTX it has accepted before; refusals are never cached."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    ptxas, target = get_ptxas(arch).path, sm_arch_from_capability(arch)
    marker = None
    if cache_dir is not None:
        with open(ptx_path, "rb") as f:
            digest = hashlib.sha256(f.read())
        stat = os.stat(ptxas)
        digest.update(f"\0{target}\0{ptxas}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
        marker = os.path.join(cache_dir, digest.hexdigest())
        if os.path.exists(marker):
            return None
    with tempfile.TemporaryDirectory(prefix="voltllm-ptxas-") as d:
        cmd = [ptxas, "-lineinfo", "-v", f"--gpu-name={target}", ptx_path, "-o", os.path.join(d, "kernel.cubin")]
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return f"`ptxas` failed with error code {done.returncode}\n{done.stderr}"
    if marker is not None:
        try:
            os.makedirs(cache_dir, exist_ok=True)
            open(marker, "wb").close()
        except OSError:  # a read-only cache only costs the next run its ptxas time
            pass
    return None
