"""Triton causal depthwise conv1d of the Gated DeltaNet layer for prefill and mixed steps (any rows per request).

    out[t, c] = silu(sum_j w[c, j] * xp[t + j, c])     xp = [state of the request (K-1 rows) | its tokens]
    new state = the last K-1 rows of xp                  (written in place at the request's slot)

Same entry point semantics as voltllm.kernels.gdn_ref.causal_conv1d_varlen (its reference). The torch form runs
one cuDNN depthwise conv over gathered [state | tokens] blocks plus transposes, gathers and copies around it
(~10 passes over [T, C]); this kernel reads each input row from where the in-projection left it and writes
each output once.

Grid: (token tile, block of channels). A tile holds up to BLOCK_T tokens of one request (tiles never cross a
request; `conv_tiles` builds the table once per step, shared by every GDN layer). Only a request's first tile
reads its old state, for its first K-1 outputs, so that tile also writes the new state (the last K-1 rows of
[old state | tokens] need nothing but the old state and the step's input): no other program touches the slot.
FMAs only (no tensor cores): the same kernel serves the compat route (sm_70 / sm_75).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from voltllm.host_to_device import upload
from voltllm.kernels.registry import CompileSpec, register_kernel

BLOCK_T = 64  # tokens per tile
BLOCK_C = 128  # channels per program


@dataclass
class ConvTiles:
    """The token tiles of one step (device int32 tensors, built once per step by conv_tiles)."""
    req: torch.Tensor  # [num_tiles]: the request of each tile
    start: torch.Tensor  # [num_tiles]: its first token (a row of the flat batch)
    qsl: torch.Tensor  # [num_seqs + 1]: the step's query_start_loc
    has_init: torch.Tensor  # [num_seqs]: the step's has_initial_state as int32 (the kernel's type)
    num_tiles: int
    block_t: int


def conv_tiles(qsl: Sequence[int], has_initial_state: torch.Tensor, block_t: int = BLOCK_T) -> Optional[ConvTiles]:
    """Tiles of up to block_t tokens, none crossing a request (request i owns rows qsl[i]:qsl[i+1]), on
    has_initial_state's device; None when no request has tokens. A request without tokens gets no tile, so its
    slot is left as it is."""
    bounds = np.asarray(qsl, dtype=np.int64)
    lens = bounds[1:] - bounds[:-1]
    counts = (lens + block_t - 1) // block_t
    n = int(counts.sum())
    if n == 0:
        return None
    req = np.repeat(np.arange(lens.size), counts)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    start = bounds[:-1][req] + (np.arange(n) - first[req]) * block_t
    flat = upload(torch.from_numpy(np.concatenate([req, start, bounds]).astype(np.int32)), has_initial_state.device)
    return ConvTiles(flat[:n], flat[n:2 * n], flat[2 * n:], has_initial_state.to(torch.int32), n, block_t)


# the step's tile table is one upload sliced into rows (conv_tiles), so their alignment changes with the tile and
# request counts; each is read one scalar per program, so an alignment class would only compile another variant
@triton.jit(do_not_specialize_on_alignment=["Slots", "HasInit", "TileReq", "TileStart", "Qsl"])
def _conv_prefill_kernel(
    X, W, Bias, State, Slots, HasInit, TileReq, TileStart, Qsl, Out,
    stride_xt, stride_ss, stride_sk, stride_ot, C,
    KW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    tile = tl.program_id(0)
    offc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = offc < C
    req = tl.load(TileReq + tile)
    t0 = tl.load(TileStart + tile)
    s = tl.load(Qsl + req)
    e = tl.load(Qsl + req + 1)
    slot = tl.load(Slots + req).to(tl.int64)
    init = tl.load(HasInit + req) != 0
    st_base = State + slot * stride_ss + offc[None, :]
    tt = t0 + tl.arange(0, BLOCK_T)
    mt = tt < e
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(KW):
        p = tt - (KW - 1) + j  # the input row this tap reads; p < s falls in the old state (row K-1 + p - s)
        w = tl.load(W + offc * KW + j, mask=mc, other=0.0).to(tl.float32)
        in_x = (p >= s) & mt
        xv = tl.load(X + p[:, None].to(tl.int64) * stride_xt + offc[None, :], mask=in_x[:, None] & mc[None, :],
                     other=0.0).to(tl.float32)
        in_s = (p < s) & mt & init
        sv = tl.load(st_base + (KW - 1 + p - s)[:, None] * stride_sk, mask=in_s[:, None] & mc[None, :],
                     other=0.0).to(tl.float32)
        acc += (xv + sv) * w[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + offc, mask=mc, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(Out + tt[:, None].to(tl.int64) * stride_ot + offc[None, :], acc.to(Out.dtype.element_ty),
             mask=mt[:, None] & mc[None, :])
    if KW > 1:
        # new state row r = xp row (e - s) + r: input row e - (K-1) + r, or old state row (K-1) + that - s
        r = tl.arange(0, BLOCK_S)
        p = e - (KW - 1) + r
        mr = (r < KW - 1) & (t0 == s)
        xv = tl.load(X + p[:, None].to(tl.int64) * stride_xt + offc[None, :],
                     mask=(mr & (p >= s))[:, None] & mc[None, :], other=0.0)
        sv = tl.load(st_base + (KW - 1 + p - s)[:, None] * stride_sk,
                     mask=(mr & (p < s) & init)[:, None] & mc[None, :], other=0.0)
        new = xv.to(State.dtype.element_ty) + sv.to(State.dtype.element_ty)  # one of the two is zero
        tl.debug_barrier()  # every warp has read the old state (the taps above) before any warp writes it
        tl.store(st_base + r[:, None] * stride_sk, new, mask=mr[:, None] & mc[None, :])


def _specs() -> list[CompileSpec]:
    specs = []
    for act in ("fp16", "fp32"):
        sig = {"X": f"*{act}", "W": f"*{act}", "Bias": f"*{act}", "State": f"*{act}", "Slots": "*i64",
               "HasInit": "*i32", "TileReq": "*i32", "TileStart": "*i32", "Qsl": "*i32", "Out": f"*{act}",
               "stride_xt": "i32", "stride_ss": "i64", "stride_sk": "i32", "stride_ot": "i32", "C": "i32",
               **{n: "constexpr" for n in ("KW", "BLOCK_T", "BLOCK_C", "BLOCK_S", "HAS_BIAS", "SILU")}}
        specs.append(CompileSpec(signature=sig, constexprs={"KW": 4, "BLOCK_T": BLOCK_T, "BLOCK_C": BLOCK_C,
                                                            "BLOCK_S": 4, "HAS_BIAS": False, "SILU": True},
                                 label=f"{act} k4"))
    return specs


register_kernel("gdn.prefill_conv1d", _conv_prefill_kernel, _specs(), compat=True)


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          conv_states: torch.Tensor, slots: torch.Tensor, qsl: Sequence[int],
                          has_initial_state: torch.Tensor, activation: Optional[str] = "silu",
                          tiles: Optional[ConvTiles] = None) -> torch.Tensor:
    """Flat batch x [T, C] (rows may be strided, e.g. a slice of the in-projection's output); weight [C, K];
    conv_states [num_slots, K-1, C] updated in place at `slots` (long [B]); has_initial_state bool [B];
    `tiles`: conv_tiles(qsl, has_initial_state), if the caller keeps it for several layers -> out [T, C] in x's
    dtype.
    Rows past qsl[-1] (padding) come out as zeros, like the reference's."""
    if activation not in ("silu", None):
        raise ValueError(f"unsupported conv activation {activation!r}")
    t, c = x.shape
    kw = weight.shape[1]
    assert conv_states.stride(-1) == 1 and tuple(conv_states.shape[1:]) == (kw - 1, c)
    if tiles is None:
        tiles = conv_tiles(qsl, has_initial_state)
    out = (torch.zeros if t > qsl[-1] else torch.empty)(t, c, dtype=x.dtype, device=x.device)
    if tiles is None:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight.contiguous()
    grid = (tiles.num_tiles, triton.cdiv(c, BLOCK_C))
    _conv_prefill_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_states, slots, tiles.has_init,
        tiles.req, tiles.start, tiles.qsl, out,
        x.stride(0), conv_states.stride(0), max(conv_states.stride(1), 1), out.stride(0), c,
        KW=kw, BLOCK_T=tiles.block_t, BLOCK_C=BLOCK_C, BLOCK_S=max(triton.next_power_of_2(max(kw - 1, 1)), 2),
        HAS_BIAS=bias is not None, SILU=activation == "silu", num_warps=4,
    )
    return out
