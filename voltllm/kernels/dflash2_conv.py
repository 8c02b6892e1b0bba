"""DFlash2's grouped dynamic causal convolution along a drafter's block rows (model/models/dflash2_layers.py) in one
launch.

    out[t, c] = sum over taps o of (base[o, c] + dynamic[t, o, c // group]) * x[t - o, c]

where row t - o counts only if it is in row t's block: the rows are decode rows laid side by side, a block's rows
share one context length and step their positions by one, which no two blocks and no CUDA-graph padding row meet
(`block_taps` in the model file is the torch form of the same test). The torch form (`GroupedDynamicConv._convolve`,
the CPU path and the reference) is ~5 launches per tap plus the taps' masks; here program (t, feature tile) reads its
row's position and context length and those of the rows before it, and sums the taps in fp32 registers. Static grid:
a CUDA graph captures it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from voltllm.kernels.registry import CompileSpec, register_kernel


@triton.jit
def _conv_kernel(X, DYN, BASE, POS, LENS, OUT, H, stride_x, stride_dyn, stride_out, TAPS: tl.constexpr,
                 GROUP: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    c_in = c < H
    groups = H // GROUP
    pos_t = tl.load(POS + t)
    len_t = tl.load(LENS + t)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for o in tl.static_range(TAPS):
        s = t - o
        ok = s >= 0
        if o > 0:  # row t - o is a tap only inside row t's block
            same_len = tl.load(LENS + s, mask=ok, other=-1) == len_t
            ok = ok & same_len & (tl.load(POS + s, mask=ok, other=-1) == pos_t - o)
        xv = tl.load(X + s.to(tl.int64) * stride_x + c, mask=c_in & ok, other=0.0).to(tl.float32)
        w = tl.load(BASE + o * H + c, mask=c_in, other=0.0).to(tl.float32) + \
            tl.load(DYN + t.to(tl.int64) * stride_dyn + o * groups + c // GROUP, mask=c_in, other=0.0)
        acc += w * xv
    tl.store(OUT + t.to(tl.int64) * stride_out + c, acc.to(OUT.dtype.element_ty), mask=c_in)


BLOCK_H = 256


def _specs() -> list[CompileSpec]:
    sig = {"X": "", "DYN": "*fp32", "BASE": "", "POS": "*i64", "LENS": "*i32", "OUT": "", "H": "i32",
           "stride_x": "i32", "stride_dyn": "i32", "stride_out": "i32", "TAPS": "constexpr", "GROUP": "constexpr",
           "BLOCK_H": "constexpr"}
    # the public drafter's two taps over groups of 16, and the tests' (2 taps, groups of 8); no bf16 on sm_70 / 75
    return [CompileSpec({**sig, "X": dt, "BASE": dt, "OUT": dt}, {"TAPS": 2, "GROUP": g, "BLOCK_H": BLOCK_H},
                        f"{dt[1:]} taps2 group{g}") for dt in ("*fp16", "*fp32") for g in (16, 8)]


register_kernel("dflash2.block_conv", _conv_kernel, _specs())


def block_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, positions: torch.Tensor,
               seq_lens: torch.Tensor) -> torch.Tensor:
    """The convolution of x [T, H] (the block rows of one forward) with dynamic [T, taps, groups] fp32 weights (any
    row stride, taps and groups contiguous) and base [taps, H]; positions / seq_lens: the rows' (at least T of
    each). Returns a new [T, H] tensor of x's dtype."""
    t, hidden = x.shape
    taps, groups = dynamic.shape[1], dynamic.shape[2]
    if hidden % groups or base.shape != (taps, hidden) or dynamic.shape[0] != t or dynamic.dtype != torch.float32 \
            or dynamic.stride(2) != 1 or dynamic.stride(1) != groups or x.stride(1) != 1:
        raise ValueError(f"block conv: x {tuple(x.shape)}, dynamic {tuple(dynamic.shape)} {dynamic.dtype} strides "
                         f"{dynamic.stride()}, base {tuple(base.shape)} do not fit together")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if t:
        _conv_kernel[(t, triton.cdiv(hidden, BLOCK_H))](
            x, dynamic, base.contiguous(), positions.long(), seq_lens.int(), out, hidden, x.stride(0),
            dynamic.stride(0), out.stride(0), TAPS=taps, GROUP=hidden // groups, BLOCK_H=BLOCK_H, num_warps=4)
    return out
