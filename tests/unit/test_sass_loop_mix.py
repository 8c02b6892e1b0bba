"""benchmarks/micro/sass_loop_mix.py: the SASS listing parser (loops = backward branches), and one real cross-compile of
a registered kernel for sm_90 and sm_70 (Triton's bundled ptxas / cuobjdump: no GPU needed)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "micro" / "sass_loop_mix.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("sass_loop_mix", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclasses look their module up there)
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/                   LDG.E.128 R4, [R2.64] ;
        /*0030*/                   HFMA2 R8, R4, R5, R8 ;
        /*0040*/              @!P0 HFMA2.MMA R9, R6, R7, R9 ;
        /*0050*/                   IADD3 R2, P1, R2, 0x10, RZ ;
        /*0060*/               @P0 BRA 0x20 ;
        /*0070*/                   STG.E [R10.64], R8 ;
        /*0080*/                   BRA 0x80 ;
"""


def test_parse_loops(tool):
    ops, loops = tool.parse_sass(LISTING)
    assert len(ops) == 9 and ops[4][1] == "HFMA2.MMA"
    assert len(loops) == 1  # the self-branch at 0x80 is the usual end-of-kernel trap, not a loop body to count
    (lp,) = loops
    assert (lp.start, lp.end, lp.size) == (0x20, 0x60, 5)
    assert lp.ops == {"LDG": 1, "HFMA2": 2, "IADD3": 1, "BRA": 1}


@pytest.mark.parametrize("arch", [90, 70])
def test_registered_kernel(tool, arch):
    r = tool.report("quant.half2_rows_matmul", "INT4_G128_ZP n1 m1", {"BLOCK_N": 2, "U": 32}, warps=1, arch=arch,
                    divisible=("stride_lo", "stride_d", "stride_s", "NU", "N", "stride_xm", "stride_ym"))
    assert r.registers > 0 and r.instructions > 100
    body = max(r.loops, key=lambda lp: lp.size)
    # the K loop dequantizes and multiplies in f16x2 and reads 16-byte units: never a conversion to fp32 per weight
    assert body.ops["HFMA2"] > 0 and body.ops["LDG"] > 0 and body.ops["PRMT"] > 0
    assert 100 < body.size < 400, body.ops


def test_errors(tool):
    with pytest.raises(SystemExit, match="unknown kernel"):
        tool.report("no.such_kernel")
    with pytest.raises(SystemExit, match="not constexprs"):
        tool.report("quant.half2_rows_matmul", None, {"NOT_A_CONSTEXPR": 1})


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("kind", ["INT4_G128_ZP", "NVFP4"])
def test_tensor_core_form_keeps_its_lanes(tool, kind, wide):
    """kernels/quant_mma.py relies on Triton laying its [t, g, KU, word] tensors out as lane = 4 g + t with the words
    in the thread: then the K loop is two mmas per word (four with WIDE's second activation fragment) and nothing goes
    through shared memory (a layout Triton had to convert would show as STS / LDS / BAR in the loop)."""
    r = tool.report("quant.mma_matmul", kind + ("-wide" if wide else ""), {"KU": 4}, warps=4, arch=80,
                    divisible=("stride_lo", "stride_d", "stride_s", "NU", "N", "stride_xm", "stride_ym"))
    body = max(r.loops, key=lambda lp: lp.size)
    # one unit of 4 words per thread and iteration (4 warps split KU = 4)
    assert body.ops["HMMA"] == (16 if wide else 8), body.ops
    assert not (body.ops["STS"] or body.ops["LDS"] or body.ops["BAR"]), body.ops
