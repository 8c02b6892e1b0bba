"""FP8 paged KV cache stored as uint8: the write kernel and the fp16 "bridge" kernel.

Cache layout (voltllm.attention.backend): kv_cache is uint8 of shape
(2, num_blocks, block_size, num_kv_heads, head_dim), contiguous; [0] = K, [1] = V. Each attention
layer has its own k_scale / v_scale (fp32 tensors of one element, so CUDA graphs can replay with
new values): stored = encode(x / scale), read = decode(code) * scale. The codec is the software
one of voltllm.kernels.fp8_codec (integer bit operations), so this runs on sm_70/sm_75.

* `write_kv_fp8`: scatter one step's K/V rows [T, H, D] into their slots (slot -1: skipped).
* `gather_kv_fp8`: the bridge for compute-bound prefill on SM70: dequantize one request's first
  ctx_len tokens (through its block table) into contiguous fp16 workspaces [ctx_len, H, D] that
  torch SDPA (tensor-core kernels on V100) can read.
* `gather_kv_pages`: the same bridge for any cache (fmt -1: an fp16/bf16/fp32 cache, copied; no scales),
  used by the compat route's SDPA prefill (voltllm/attention/compat_backend.py).

Each has a plain-torch reference (`*_ref`) built on the reference codec; the Triton kernels match
them bit for bit.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from voltllm.attention.torch_ref import gather_kv
from voltllm.kernels.fp8_codec import (_scale_value, fp8_format, fp8_to_fp32, fp32_to_fp8, scaled_decode_ref,
                                       scaled_encode_ref)
from voltllm.kernels.registry import CompileSpec, register_kernel

Scale = Union[float, torch.Tensor, None]


@triton.jit
def kv_fp8_write_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, num_kv_heads,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FMT: tl.constexpr,
):
    """One program per (token, group of BLOCK_H heads): cache[slot, h, :] = encode(x[tok, h, :] / scale)."""
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    mask = (h[:, None] < num_kv_heads) & (d[None, :] < HEAD_DIM) & (slot >= 0)
    k = tl.load(k_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    k_scale = tl.load(k_scale_ptr)
    v_scale = tl.load(v_scale_ptr)
    dst = slot * (num_kv_heads * HEAD_DIM) + h[:, None] * HEAD_DIM + d[None, :]
    tl.store(k_cache_ptr + dst, fp32_to_fp8(tl.math.div_rn(k.to(tl.float32), k_scale), FMT), mask=mask)
    tl.store(v_cache_ptr + dst, fp32_to_fp8(tl.math.div_rn(v.to(tl.float32), v_scale), FMT), mask=mask)


# Arguments that change from step to step and gain nothing from Triton's value / alignment specialisation (a bound,
# per-request scalars, the block table's rows): each new class (== 1, % 16, a 16-byte aligned slice) would compile
# another variant inside the step that first meets it, ~70-90 ms (micro/bench_compiles.py, session 43)
@triton.jit(do_not_specialize=["ctx_len", "stride_bt"],
            do_not_specialize_on_alignment=["block_table_ptr", "seq_ptr", "ctx_ptr", "start_ptr"])
def kv_fp8_gather_kernel(
    k_cache_ptr, v_cache_ptr, block_table_ptr, k_out_ptr, v_out_ptr, k_scale_ptr, v_scale_ptr,
    seq_ptr, ctx_ptr, start_ptr,
    ctx_len, num_kv_heads, stride_bt, stride_ob, stride_ot, stride_oh,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    FMT: tl.constexpr, VARLEN: tl.constexpr,
):
    """One program per (BLOCK_T tokens, head, request b):
    out[b, t, h, :] = out_dtype(decode(cache[slot_b(t), h, :]) * scale), slot_b through block table row b.
    VARLEN: request b is block-table row seq[b] with ctx[b] tokens, written from workspace row start[b]
    (ctx_len is then the longest, which sizes the grid; stride_ob is unused).

    FMT -1: a float cache, copied (out_dtype(cache[slot(t), h, :]); the scales are not read)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    if VARLEN:
        row = tl.load(seq_ptr + b).to(tl.int64)
        n = tl.load(ctx_ptr + b)
        out_row0 = tl.load(start_ptr + b).to(tl.int64) * stride_ot
    else:
        row = b
        n = ctx_len
        out_row0 = b * stride_ob
    t_mask = t < n
    blk = tl.load(block_table_ptr + row * stride_bt + t // PAGE, mask=t_mask, other=0).to(tl.int64)
    slot = blk * PAGE + t % PAGE
    mask = t_mask[:, None] & (d[None, :] < HEAD_DIM)
    src = slot[:, None] * (num_kv_heads * HEAD_DIM) + h * HEAD_DIM + d[None, :]
    dst = out_row0 + t.to(tl.int64)[:, None] * stride_ot + h * stride_oh + d[None, :]
    kc = tl.load(k_cache_ptr + src, mask=mask, other=0)
    vc = tl.load(v_cache_ptr + src, mask=mask, other=0)
    if FMT >= 0:
        k = fp8_to_fp32(kc, FMT) * tl.load(k_scale_ptr)
        v = fp8_to_fp32(vc, FMT) * tl.load(v_scale_ptr)
    else:
        k = kc
        v = vc
    tl.store(k_out_ptr + dst, k.to(k_out_ptr.dtype.element_ty), mask=mask)
    tl.store(v_out_ptr + dst, v.to(v_out_ptr.dtype.element_ty), mask=mask)


# the e5m2 variant differs only in the codec helper: one head size represents it
_SPEC_SHAPES = (("e4m3", 0, 64), ("e4m3", 0, 128), ("e4m3", 0, 256), ("e5m2", 1, 128))


def _write_block_h(h: int, block_d: int) -> int:
    return max(1, min(triton.next_power_of_2(h), 1024 // block_d))


def _gather_block_t(block_d: int) -> int:
    return max(1, 2048 // block_d)


def _write_specs() -> list[CompileSpec]:
    sig = {"k_ptr": "*fp16", "v_ptr": "*fp16", "k_cache_ptr": "*u8", "v_cache_ptr": "*u8", "slot_ptr": "*i64",
           "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "stride_kt": "i32", "stride_kh": "i32",
           "stride_vt": "i32", "stride_vh": "i32", "num_kv_heads": "i32", "HEAD_DIM": "constexpr",
           "BLOCK_H": "constexpr", "BLOCK_D": "constexpr", "FMT": "constexpr"}
    return [CompileSpec(signature=sig, label=f"fp16 d{d} h8 {name}",
                        constexprs={"HEAD_DIM": d, "BLOCK_H": _write_block_h(8, d), "BLOCK_D": d, "FMT": fmt})
            for name, fmt, d in _SPEC_SHAPES]


def _gather_specs() -> list[CompileSpec]:
    def sig(cache: str) -> dict[str, str]:
        return {"k_cache_ptr": cache, "v_cache_ptr": cache, "block_table_ptr": "*i32", "k_out_ptr": "*fp16",
                "v_out_ptr": "*fp16", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "seq_ptr": "*i32",
                "ctx_ptr": "*i32", "start_ptr": "*i32", "ctx_len": "i32",
                "num_kv_heads": "i32", "stride_bt": "i32", "stride_ob": "i32", "stride_ot": "i32",
                "stride_oh": "i32", "PAGE": "constexpr",
                "HEAD_DIM": "constexpr", "BLOCK_T": "constexpr", "BLOCK_D": "constexpr", "FMT": "constexpr",
                "VARLEN": "constexpr"}
    # the varlen form (the compat prefill's joined requests) for one fp8 format and the float cache
    shapes = [(name, fmt, d, False) for name, fmt, d in _SPEC_SHAPES] + [("fp16 cache", -1, 128, False),
                                                                        ("e4m3", 0, 128, True),
                                                                        ("fp16 cache", -1, 128, True)]
    return [CompileSpec(signature=sig("*u8" if fmt >= 0 else "*fp16"),
                        label=f"fp16 d{d} page16 {name}" + (" varlen" if varlen else ""),
                        constexprs={"PAGE": 16, "HEAD_DIM": d, "BLOCK_T": _gather_block_t(d), "BLOCK_D": d,
                                    "FMT": fmt, "VARLEN": varlen})
            for name, fmt, d, varlen in shapes]


register_kernel("fp8.kv_write", kv_fp8_write_kernel, _write_specs(), compat=True)
register_kernel("fp8.kv_gather", kv_fp8_gather_kernel, _gather_specs(), compat=True)


def _check_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"fp8 KV cache must be uint8 (2, blocks, block_size, heads, dim), got "
                         f"{kv_cache.dtype} {tuple(kv_cache.shape)}")
    if not kv_cache.is_contiguous():
        raise ValueError("fp8 KV cache must be contiguous")


# --- references ------------------------------------------------------------------------------
def write_kv_fp8_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     k_scale: Scale = None, v_scale: Scale = None, fmt: Union[str, int] = "e4m3") -> None:
    _check_cache(kv_cache)
    _, num_blocks, block_size, h, d = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, h, d)
    t = k.shape[0]
    slots = slot_mapping[:t].long()
    valid = slots >= 0
    flat[0, slots[valid]] = scaled_encode_ref(k[valid], k_scale, fmt)
    flat[1, slots[valid]] = scaled_encode_ref(v[valid], v_scale, fmt)


def gather_kv_fp8_ref(kv_cache: torch.Tensor, block_table: torch.Tensor, ctx_len: int, k_scale: Scale = None,
                      v_scale: Scale = None, fmt: Union[str, int] = "e4m3",
                      dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    _check_cache(kv_cache)
    kc, vc = gather_kv(kv_cache, block_table, ctx_len)
    return scaled_decode_ref(kc, k_scale, fmt, dtype), scaled_decode_ref(vc, v_scale, fmt, dtype)


# --- launchers -------------------------------------------------------------------------------
def write_kv_fp8(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: Scale = None, v_scale: Scale = None, fmt: Union[str, int] = "e4m3",
                 use_triton: Optional[bool] = None) -> None:
    """k, v: [T, H, D] fp16/fp32 (last dim contiguous); slot_mapping int64 [>= T], -1 = skip.

    Triton on CUDA tensors (or use_triton=True, e.g. under TRITON_INTERPRET=1); reference otherwise.
    """
    f = fp8_format(fmt)
    use_triton = k.is_cuda if use_triton is None else use_triton
    if not use_triton:
        write_kv_fp8_ref(k, v, kv_cache, slot_mapping, k_scale, v_scale, f)
        return
    _check_cache(kv_cache)
    t, h, d = k.shape
    if t == 0:
        return
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    assert kv_cache.shape[3] == h and kv_cache.shape[4] == d, "K/V shape does not match the cache"
    block_d = triton.next_power_of_2(d)
    block_h = _write_block_h(h, block_d)
    grid = (t, triton.cdiv(h, block_h))
    kv_fp8_write_kernel[grid](
        k, v, kv_cache[0], kv_cache[1], slot_mapping, _scale_value(k_scale, k.device),
        _scale_value(v_scale, k.device), k.stride(0), k.stride(1), v.stride(0), v.stride(1), h,
        HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=block_d, FMT=f,
    )


def gather_kv_fp8(kv_cache: torch.Tensor, block_table: torch.Tensor, ctx_len: int, k_scale: Scale = None,
                  v_scale: Scale = None, fmt: Union[str, int] = "e4m3", dtype: torch.dtype = torch.float16,
                  out: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                  use_triton: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) of one request's first ctx_len tokens, each [ctx_len, H, D] in dtype.

    `out` may be a pair of preallocated workspaces (views of [>= ctx_len, H, D] with a contiguous last
    dim); the result is then written into (and returned as) their first ctx_len rows.
    """
    f = fp8_format(fmt)
    use_triton = kv_cache.is_cuda if use_triton is None else use_triton
    if not use_triton:
        k, v = gather_kv_fp8_ref(kv_cache, block_table, ctx_len, k_scale, v_scale, f, dtype)
        if out is None:
            return k, v
        out[0][:ctx_len].copy_(k)
        out[1][:ctx_len].copy_(v)
        return out[0][:ctx_len], out[1][:ctx_len]
    _check_cache(kv_cache)
    h, d = kv_cache.shape[3], kv_cache.shape[4]
    if out is None:
        out = (torch.empty(ctx_len, h, d, dtype=dtype, device=kv_cache.device),
               torch.empty(ctx_len, h, d, dtype=dtype, device=kv_cache.device))
    k_out, v_out = out[0][:ctx_len], out[1][:ctx_len]
    if k_out.stride() != v_out.stride() or k_out.stride(2) != 1:
        raise ValueError("K and V workspaces must share strides and have a contiguous last dim")
    if ctx_len == 0:
        return k_out, v_out
    _launch_gather(kv_cache, block_table.unsqueeze(0), k_out, v_out, _scale_value(k_scale, kv_cache.device),
                   _scale_value(v_scale, kv_cache.device), f, ctx_len, 1, None, 0, k_out.stride(0), k_out.stride(1))
    return k_out, v_out


def gather_kv_pages(kv_cache: torch.Tensor, block_table: torch.Tensor, ctx_len: int,
                    out: tuple[torch.Tensor, torch.Tensor], k_scale: Optional[torch.Tensor] = None,
                    v_scale: Optional[torch.Tensor] = None, fmt: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Bridge of any paged cache into workspaces: out[0][:ctx_len] = K, out[1][:ctx_len] = V, [ctx_len, H, D].

    fmt -1: a float cache (copied, converted to the workspace dtype; scales unused); fmt >= 0: a uint8 fp8
    cache, decode(code) * scale. k_scale / v_scale: fp32 one-element tensors on the cache's device (None:
    1.0). One Triton launch; no host sync (ctx_len is a host int). Returns the two [ctx_len, H, D] views.
    """
    k, v = gather_kv_pages_batch(kv_cache, block_table.unsqueeze(0), ctx_len, out, k_scale, v_scale, fmt)
    return k[0], v[0]


def gather_kv_pages_batch(kv_cache: torch.Tensor, block_tables: torch.Tensor, ctx_len: int,
                          out: tuple[torch.Tensor, torch.Tensor], k_scale: Optional[torch.Tensor] = None,
                          v_scale: Optional[torch.Tensor] = None, fmt: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """`gather_kv_pages` for B requests of one context length in one launch: block_tables [B, blocks] (row
    b: request b's pages; last dim contiguous), out = two workspaces [>= B * ctx_len, H, D] sharing strides.
    Returns the two [B, ctx_len, H, D] views of their first B * ctx_len rows (request b at rows b * ctx_len..).
    """
    h, d = _check_bridge_cache(kv_cache, fmt)
    if block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [B, blocks] with a contiguous last dim, got "
                         f"{tuple(block_tables.shape)}")
    b = block_tables.shape[0]
    k_flat, v_flat = out[0][:b * ctx_len], out[1][:b * ctx_len]
    if (k_flat.shape[0] < b * ctx_len or k_flat.stride() != v_flat.stride() or k_flat.stride(2) != 1
            or k_flat.shape[1:] != (h, d)):
        raise ValueError("K and V workspaces must be [>= B * ctx_len, H, D], share strides, contiguous last dim")
    k_out, v_out = k_flat.view(b, ctx_len, h, d), v_flat.view(b, ctx_len, h, d)
    if ctx_len > 0 and b > 0:
        _launch_gather(kv_cache, block_tables, k_out, v_out, k_scale, v_scale, fmt, ctx_len, b, None,
                       k_out.stride(0), k_out.stride(1), k_out.stride(2))
    return k_out, v_out


def gather_kv_pages_varlen(kv_cache: torch.Tensor, block_tables: torch.Tensor, plan: torch.Tensor, max_ctx: int,
                           out: tuple[torch.Tensor, torch.Tensor], k_scale: Optional[torch.Tensor] = None,
                           v_scale: Optional[torch.Tensor] = None, fmt: int = -1) -> None:
    """`gather_kv_pages` for requests of any context lengths in one launch. plan: int32 [3, B] on the cache's
    device, rows (block-table row, context length, first workspace row) per request; max_ctx: the longest
    context (a host int, sizes the grid). Request b's K / V land in out[0] / out[1] rows start_b ..
    start_b + ctx_b - 1 ([>= rows, H, D] workspaces sharing strides); the caller keeps the ranges apart."""
    h, d = _check_bridge_cache(kv_cache, fmt)
    k_out, v_out = out
    if (k_out.stride() != v_out.stride() or k_out.stride(2) != 1 or k_out.shape[1:] != (h, d)
            or block_tables.stride(1) != 1 or plan.dtype != torch.int32 or plan.dim() != 2 or plan.shape[0] != 3):
        raise ValueError("gather_kv_pages_varlen: workspaces [rows, H, D] sharing strides, block_tables with a "
                         "contiguous last dim, plan int32 [3, B]")
    if plan.shape[1] > 0 and max_ctx > 0:
        _launch_gather(kv_cache, block_tables, k_out, v_out, k_scale, v_scale, fmt, max_ctx, plan.shape[1],
                       plan.contiguous(), 0, k_out.stride(0), k_out.stride(1))


def _check_bridge_cache(kv_cache: torch.Tensor, fmt: int) -> tuple[int, int]:
    """(heads, head_dim) of a paged cache the bridge can read (fmt >= 0: uint8 fp8 codes)."""
    if fmt >= 0:
        _check_cache(kv_cache)
    elif kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or not kv_cache.is_contiguous():
        raise ValueError("KV cache must be contiguous (2, blocks, block_size, heads, dim), got "
                         f"{tuple(kv_cache.shape)}")
    return kv_cache.shape[3], kv_cache.shape[4]


def _launch_gather(kv_cache, block_tables, k_out, v_out, k_scale, v_scale, fmt, grid_ctx, b, plan, stride_ob,
                   stride_ot, stride_oh) -> None:
    """One kv_fp8_gather_kernel launch over (grid_ctx tokens, heads, b requests); plan None: equal contexts."""
    _, _, page, h, d = kv_cache.shape
    dev = kv_cache.device
    ks = k_scale if k_scale is not None else _scale_value(None, dev)
    vs = v_scale if v_scale is not None else _scale_value(None, dev)
    block_d = triton.next_power_of_2(d)
    block_t = _gather_block_t(block_d)
    rows = (block_tables,) * 3 if plan is None else (plan[0], plan[1], plan[2])  # (unused without VARLEN)
    kv_fp8_gather_kernel[(triton.cdiv(grid_ctx, block_t), h, b)](
        kv_cache[0], kv_cache[1], block_tables, k_out, v_out, ks, vs, *rows, grid_ctx, h, block_tables.stride(0),
        stride_ob, stride_ot, stride_oh, PAGE=page, HEAD_DIM=d, BLOCK_T=block_t, BLOCK_D=block_d, FMT=fmt,
        VARLEN=plan is not None,
    )
