"""Triton's pipeliner multi-buffers the paged decode kernel's K / V tiles when the kernel is compiled as the JIT
compiles it at run time (pointers and strides divisible by 16). It does so only because each tile's block ids come
from the previous iteration (carried): with the ids loaded in the same iteration it kept one K / V buffer at every
num_stages, so each tile's loads waited for the previous tile's compute (session 40, docs/kernels.md). Cross-compiled
for sm_90 on the CPU (no GPU needed)."""
from __future__ import annotations

import importlib
import re

import pytest

triton = pytest.importorskip("triton")


def _kv_buffer_counts(kv_fmt: int, num_stages: int, block_n: int = 64) -> set[int]:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pd = importlib.import_module("voltllm.kernels.attention.paged_decode")
    spec = next(s for s in pd._decode_specs if s.constexprs["USE_DOT"] and s.constexprs["HEAD_DIM"] == 128
                and s.constexprs["KV_FMT"] == kv_fmt and not s.constexprs["ROPE"])
    fn = pd._paged_decode_kernel
    divisible = [n for n, t in spec.signature.items() if t.startswith("*") or n.startswith("stride")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    constexprs = dict(spec.constexprs, SPLIT=False, PDL=True, BLOCK_N=block_n)
    kernel = triton.compile(ASTSource(fn, spec.signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 2, "num_stages": num_stages})
    elem = "i8" if kv_fmt >= 0 else "f16"
    return {int(n) for n in re.findall(rf"memdesc<(\d+)x{block_n}x128x{elem}", kernel.asm["ttgir"])}


@pytest.mark.parametrize("kv_fmt", [-1, 0], ids=["fp16", "fp8_e4m3"])
def test_kv_tiles_get_num_stages_minus_one_buffers(kv_fmt):
    assert _kv_buffer_counts(kv_fmt, 3) == {2}
    assert _kv_buffer_counts(kv_fmt, 4, block_n=32) == {3}
