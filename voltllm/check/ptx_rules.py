"""What the sm_70 / sm_75 compile gate (voltllm.check.sm70_gate) rejects in a kernel's TTIR and PTX: bf16 and
fp8 types in the IR (Triton silently emulates bf16 and fp8e5 on sm_70), and PTX instructions or types newer
than the target per the PTX ISA target notes (PTX_RULES, `mma.sync` shapes; the table is in docs/sm70.md).
"""
from __future__ import annotations

import bisect
import itertools
import re
from dataclasses import dataclass
from typing import Optional


# ---------------------------------------------------------------------------------------------
# rules
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    name: str
    pattern: re.Pattern
    min_arch: int  # the instruction/type needs sm_<min_arch> or newer
    why: str


def _r(name: str, pattern: str, min_arch: int, why: str) -> Rule:
    return Rule(name, re.compile(pattern), min_arch, why)


# Order matters only for the message: the first matching rule names a line.
PTX_RULES: tuple[Rule, ...] = (
    _r("fp8", r"\.(e4m3|e5m2)(x2|x4)?\b", 89, "FP8 (e4m3/e5m2) conversions and types need sm_89+"),
    _r("fp4/fp6", r"\.(e2m1|e2m3|e3m2|ue8m0)(x2|x4)?\b", 100, "FP4/FP6 types need sm_100+"),
    _r("bf16", r"\.bf16(x2)?\b", 80, "bf16 instructions/types need sm_80+ (V100 and T4 have no bf16)"),
    _r("tf32", r"\.tf32\b", 80, "tf32 needs sm_80+"),
    _r("cvt.f16x2.f32", r"\bcvt\.\S*\.f16x2\.f32\b", 80, "packed cvt f32 -> f16x2 needs sm_80+"),
    _r("relu", r"\b(cvt|fma)\.\S*\.relu\b", 80, "cvt/fma .relu needs sm_80+"),
    _r("min/max.NaN", r"\b(min|max)(\.\w+)*\.NaN\b", 80, "min/max .NaN needs sm_80+"),
    _r("min/max.xorsign", r"\b(min|max)(\.\w+)*\.xorsign\b", 86, "min/max .xorsign needs sm_86+"),
    _r("min/max.f16", r"\b(min|max)(\.\w+)*\.f16(x2)?\b", 80, "f16 min/max needs sm_80+"),
    _r("tcgen05", r"\btcgen05\b", 100, "tcgen05 (5th-gen tensor cores) needs sm_100+"),
    _r("wide ld/st", r"\b(ld|st)\.\S*\.(v8\.[bfus]32|v4\.[bfus]64)\b", 100, "256-bit ld/st needs sm_100+"),
    _r("wgmma", r"\bwgmma\b", 90, "wgmma needs sm_90+"),
    _r("cp.async.bulk", r"\bcp(\.reduce)?\.async\.bulk\b", 90, "TMA (cp.async.bulk) needs sm_90+"),
    _r("stmatrix", r"\bstmatrix\b", 90, "stmatrix needs sm_90+"),
    _r("setmaxnreg", r"\bsetmaxnreg\b", 90, "setmaxnreg needs sm_90+"),
    _r("elect.sync", r"\belect\.sync\b", 90, "elect.sync needs sm_90+"),
    _r("fence.proxy.async", r"\bfence\.proxy\.async\b", 90, "fence.proxy.async needs sm_90+"),
    _r("griddepcontrol", r"\bgriddepcontrol\b", 90, "griddepcontrol needs sm_90+"),
    _r("cluster", r"\bbarrier\.cluster\b|::cluster\b|%(n?clusterid|cluster_\w+|is_explicit_cluster)\b", 90,
       "thread-block clusters need sm_90+"),
    _r("multimem", r"\bmultimem\b", 90, "multimem needs sm_90+"),
    _r("mapa", r"\bmapa\b", 90, "mapa needs sm_90+"),
    _r("vector atomics", r"\b(atom|red)\.\S*\.v(2|4|8)\.", 90, "vector atom/red needs sm_90+"),
    _r("cp.async", r"\bcp\.async\b", 80, "cp.async needs sm_80+"),
    _r("mbarrier", r"\bmbarrier\b", 80, "mbarrier needs sm_80+"),
    _r("redux.sync", r"\bredux\.sync\b", 80, "redux.sync needs sm_80+"),
    _r("createpolicy", r"\bcreatepolicy\b", 80, "createpolicy needs sm_80+"),
    _r("L2::cache_hint", r"\.L2::cache_hint\b", 80, ".L2::cache_hint needs sm_80+"),
    _r("discard", r"\bdiscard\.", 80, "discard needs sm_80+"),
    _r("applypriority", r"\bapplypriority\b", 80, "applypriority needs sm_80+"),
    _r("ldmatrix", r"\bldmatrix\b", 75, "ldmatrix needs sm_75+"),
    _r("movmatrix", r"\bmovmatrix\b", 75, "movmatrix needs sm_75+"),
    _r("tanh.approx", r"\btanh\.approx\b", 75, "tanh.approx needs sm_75+"),
    _r("ex2.approx.f16", r"\bex2\.approx(\.\w+)*\.f16(x2)?\b", 75, "f16 ex2.approx needs sm_75+"),
    _r("L2 prefetch size", r"\.L2::(64|128|256)B\b", 75, ".L2::<size>B prefetch needs sm_75+"),
    _r("wmma int4/b1", r"\bwmma\.\S*\.(s4|u4|b1)\b", 75, "sub-byte wmma needs sm_75+"),
    _r("wmma int8", r"\bwmma\.\S*\.(s8|u8)\b", 72, "int8 wmma needs sm_72+"),
)

_MMA = re.compile(r"\bmma\.sync\.aligned\.(m\d+n\d+k\d+)((?:\.\w+)*)")
# mma.sync shape -> (min arch for f16 operands, min arch otherwise)
_MMA_SHAPES = {"m8n8k4": (70, 80), "m16n8k8": (75, 80), "m8n8k16": (75, 75), "m8n8k32": (75, 75),
               "m8n8k128": (75, 75)}
_ALWAYS = 10**6  # IR rules apply to every compat arch
IR_RULES: tuple[Rule, ...] = (
    # a type appears after '<', ' ', '(', ',', ':' or a shape's 'NNx' (tensor<128x64xbf16>), not in %names
    _r("ir bf16", r"(?:[<\s(,:]|\dx)bf16\b", _ALWAYS,
       "bf16 type in the kernel: the compat route is fp16 (no bf16 on V100/T4; Triton would emulate it "
       "with integer code)"),
    _r("ir fp8/fp6/fp4", r"(?:[<\s(,:]|\dx)f[468]E\d+M\d+\w*", _ALWAYS,
       "fp8/fp6/fp4 Triton type in the kernel: store uint8 and use the software codec "
       "(voltllm.kernels.fp8_codec)"),
)


def _mma_min_arch(line: str) -> Optional[tuple[int, str]]:
    m = _MMA.search(line)
    if not m:
        return None
    shape, quals = m.group(1), m.group(2).split(".")
    f16_only = all(q in ("", "row", "col", "f16", "f32", "satfinite") for q in quals) and "f16" in quals
    f16_arch, other_arch = _MMA_SHAPES.get(shape, (80, 80))
    need = f16_arch if f16_only else other_arch
    return need, f"mma.sync {shape}{m.group(2)} needs sm_{need}+"


def _strip_comment(line: str) -> str:
    i = line.find("//")
    return (line if i < 0 else line[:i]).strip()


@dataclass
class Violation:
    rule: str
    reason: str
    line_no: int
    line: str


def _scan_pattern(pattern: re.Pattern) -> re.Pattern:
    """`pattern` without a leading word boundary: it matches wherever `pattern` does (and maybe more), and the
    regex engine can then skip ahead to its literal prefix, about 10x faster over a whole PTX file."""
    text = pattern.pattern
    return re.compile(text[2:]) if text.startswith(r"\b") else pattern


_SCAN: dict[int, tuple[re.Pattern, ...]] = {}


def _candidate_lines(ptx: str, arch: int) -> tuple[list[str], list[int]]:
    """(lines with their line ends, the 0-based indices of the lines where the mma pattern or a rule that applies to
    sm_<arch> may match). A pattern that matches inside a line (comment stripped) matches the whole text there too,
    so every line that check_ptx would flag is among them."""
    scans = _SCAN.get(arch)
    if scans is None:
        scans = _SCAN[arch] = tuple(_scan_pattern(p) for p in
                                    (_MMA, *(r.pattern for r in PTX_RULES if arch < r.min_arch)))
    lines = ptx.splitlines(keepends=True)
    starts = list(itertools.accumulate(map(len, lines), initial=0))
    found: set[int] = set()
    for scan in scans:
        pos = 0
        while (m := scan.search(ptx, pos)) is not None:
            i = bisect.bisect_right(starts, m.start()) - 1
            found.add(i)
            pos = starts[i + 1]  # the next line
    return lines, sorted(found)


def check_ptx(ptx: str, arch: int) -> list[Violation]:
    """The lines of `ptx` that use an instruction or type that sm_<arch> lacks (one per line).

    Every line is judged as if each rule were tried on it in order; a fast scan of the whole text first skips the
    lines that no rule can match (about 99.99% of a kernel's PTX)."""
    out = []
    lines, candidates = _candidate_lines(ptx, arch)
    for i in candidates:
        no, raw = i + 1, (lines[i].splitlines() or [""])[0]
        line = _strip_comment(raw)
        if not line:
            continue
        mma = _mma_min_arch(line)
        if mma is not None and arch < mma[0]:
            out.append(Violation("mma shape", mma[1], no, line))
            continue
        for rule in PTX_RULES:
            if arch < rule.min_arch and rule.pattern.search(line):
                out.append(Violation(rule.name, rule.why, no, line))
                break
    return out


_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')


def check_ir(ttir: str) -> list[Violation]:
    """bf16 / fp8 types anywhere in the kernel's TTIR (file names in locations are ignored)."""
    out = []
    for no, raw in enumerate(ttir.splitlines(), 1):
        if raw.lstrip().startswith("#loc"):
            continue
        line = _QUOTED.sub('""', raw).strip()
        for rule in IR_RULES:
            if rule.pattern.search(line):
                out.append(Violation(rule.name, rule.why, no, raw.strip()))
                break
    return out
