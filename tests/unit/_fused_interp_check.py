"""Checks of the fused elementwise Triton kernels (voltllm.kernels.fused) against their torch references.

Run as a script under TRITON_INTERPRET=1 (set before triton is imported) by tests/unit/test_fused_kernels.py,
or imported on a GPU by tests/gpu/test_fused_kernels.py (device argument); prints one line per check:
    CHECK <name> <ok|FAIL> <detail>

Error = max |kernel - reference| / max |reference| over the whole compared tensor. Outputs that the kernel
writes (`out=`) are filled with NaN first, so an element it fails to write shows up as an error; in-place
kernels are compared on the whole underlying buffer (e.g. all of a fused qkv tensor), so a stray write
outside q/k or past rotary_dim shows up too.
"""
from __future__ import annotations

import sys

import torch

# fp16 2e-3 and bf16 1.6e-2 are both about 2 units in the last place relative to the largest value
# (a rounded intermediate such as silu(gate) can flip once, then the final rounding once more).
# bf16 is checked on GPUs only: Triton's interpreter truncates fp32 -> bf16 instead of rounding to nearest.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rand(shape, seed: int, device: str, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    if device == "cpu":
        return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype=dtype)
    g = torch.Generator(device).manual_seed(seed)  # real shapes on a GPU: do not make them on the host
    return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype=dtype)


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    g, r = got.float(), ref.float()
    if g.shape != r.shape:
        return float("inf")
    diff = (g - r).abs()
    if torch.isnan(diff).any():
        return float("inf")
    return diff.max().item() / max(r.abs().max().item(), 1e-6) if r.numel() else 0.0


def _verdict(errs: dict[str, float], dtype: torch.dtype) -> str:
    tol = TOL[dtype]
    detail = " ".join(f"{k} {v:.2e}" for k, v in errs.items())
    return ("ok " if all(v <= tol for v in errs.values()) else "FAIL ") + detail + f" (tol {tol:.0e})"


# ------------------------------------------------------------------------------------------------
def run_rms(device: str, t: int, h: int, dtype: torch.dtype, offset: float = 0.0, seed: int = 0) -> str:
    from voltllm.kernels import fused as F

    x = _rand((t, h), seed, device, dtype, 3.0)
    w = _rand((h,), seed + 1, device, dtype, 0.5) + (0.0 if offset else 1.0)
    ref = F.rms_norm_ref(x, w, 1e-6, offset)
    out = torch.full_like(x, float("nan"))
    got = F.rms_norm(x, w, 1e-6, offset, out=out)
    errs = {"out": _err(out, ref), "alloc": _err(F.rms_norm(x, w, 1e-6, offset), ref)}
    x2 = x.clone()
    F.rms_norm(x2, w, 1e-6, offset, out=x2)  # in place
    errs["inplace"] = _err(x2, ref)
    if got is not out:
        return "FAIL returned tensor is not `out`"
    return _verdict(errs, dtype)


def run_add_rms(device: str, t: int, h: int, dtype: torch.dtype, offset: float = 0.0, seed: int = 0,
                res_dtype: torch.dtype | None = None) -> str:
    from voltllm.kernels import fused as F

    res_dtype = res_dtype or dtype
    x = _rand((t, h), seed, device, dtype, 2.0)
    r0 = _rand((t, h), seed + 1, device, res_dtype, 2.0)
    w = _rand((h,), seed + 2, device, dtype, 0.5) + (0.0 if offset else 1.0)
    r_ref = r0.clone()
    ref, _ = F.fused_add_rms_norm_ref(x, r_ref, w, 1e-6, offset)
    r = r0.clone()
    out = torch.full(ref.shape, float("nan"), dtype=ref.dtype, device=device)
    o, r_ret = F.fused_add_rms_norm(x, r, w, 1e-6, offset, out=out)
    if o is not out or r_ret is not r:
        return "FAIL returned tensors are not (out, residual)"
    errs = {"out": _err(out, ref), "residual": _err(r, r_ref)}
    x_before = x.clone()
    r = r0.clone()
    o, _ = F.fused_add_rms_norm(x, r, w, 1e-6, offset)
    errs["alloc"] = _err(o, ref)
    errs["x untouched"] = _err(x, x_before)
    # out aliases x (what RMSNorm does on CUDA); with a wider residual the output keeps x's dtype
    x2, r = x.clone(), r0.clone()
    F.fused_add_rms_norm(x2, r, w, 1e-6, offset, out=x2)
    errs["out=x"] = _err(x2, ref.to(dtype))
    errs["out=x residual"] = _err(r, r_ref)
    return _verdict(errs, dtype)


def _qkv(device, t, hq, hk, d, dtype, seed):
    """A fused qkv projection output [T, (Hq + 2 Hk) D]."""
    return _rand((t, (hq + 2 * hk) * d), seed, device, dtype, 2.0)


def _views(qkv: torch.Tensor, hq: int, hk: int, d: int):
    """q [T, Hq, D], k [T, Hk, D] views into qkv, as the attention layer makes them (strided along tokens)."""
    t = qkv.shape[0]
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    return q.view(t, hq, d), k.view(t, hk, d)


def run_heads(device: str, t: int, hq: int, hk: int, d: int, dtype: torch.dtype, offset: float = 0.0,
              seed: int = 0) -> str:
    from voltllm.kernels import fused as F

    qkv = _qkv(device, t, hq, hk, d, dtype, seed)
    q, k = _views(qkv, hq, hk, d)
    assert not q.is_contiguous() or t == 1
    w = _rand((d,), seed + 1, device, dtype, 0.5) + (0.0 if offset else 1.0)
    errs = {}
    for name, v in (("q", q), ("k", k)):
        ref = F.rms_norm_heads_ref(v, w, 1e-6, offset)
        out = torch.full(v.shape, float("nan"), dtype=dtype, device=device)
        F.rms_norm_heads(v, w, 1e-6, offset, out=out)
        errs[name] = _err(out, ref)
        errs[name + " alloc"] = _err(F.rms_norm_heads(v, w, 1e-6, offset), ref)
    # in place on the strided views: the whole qkv buffer must equal the reference applied the same way
    ref_buf = qkv.clone()
    rq, rk = _views(ref_buf, hq, hk, d)
    rq.copy_(F.rms_norm_heads_ref(rq, w, 1e-6, offset))
    rk.copy_(F.rms_norm_heads_ref(rk, w, 1e-6, offset))
    F.rms_norm_heads(q, w, 1e-6, offset, out=q)
    F.rms_norm_heads(k, w, 1e-6, offset, out=k)
    errs["inplace qkv"] = _err(qkv, ref_buf)
    return _verdict(errs, dtype)


def tables(device: str, max_pos: int, rd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_pos, rd / 2] fp32, as voltllm.model.layers.rotary builds them (default rope)."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, rd, 2, dtype=torch.float) / rd))
    f = torch.outer(torch.arange(max_pos, dtype=torch.float), inv)
    return f.cos().to(device), f.sin().to(device)


def _rope_case(device, t, hq, hk, d, rd, dtype, seed, max_pos):
    """cos/sin tables, random positions, a fused qkv buffer and its reference copy."""
    cos, sin = tables(device, max_pos, rd)
    positions = torch.randint(0, max_pos, (t,), generator=_gen(seed + 7), dtype=torch.int64).to(device)
    qkv = _qkv(device, t, hq, hk, d, dtype, seed)
    return cos, sin, positions, qkv, qkv.clone()


def run_rope(device: str, t: int, hq: int, hk: int, d: int, rd: int, dtype: torch.dtype, norm: bool,
             offset: float = 0.0, seed: int = 0, max_pos: int = 4096) -> str:
    from voltllm.kernels import fused as F

    cos, sin, positions, qkv, ref_buf = _rope_case(device, t, hq, hk, d, rd, dtype, seed, max_pos)
    q, k = _views(qkv, hq, hk, d)
    rq, rk = _views(ref_buf, hq, hk, d)
    if norm:
        qw = _rand((d,), seed + 1, device, dtype, 0.5) + (0.0 if offset else 1.0)
        kw = _rand((d,), seed + 2, device, dtype, 0.5) + (0.0 if offset else 1.0)
        F.qk_norm_rope_inplace_ref(rq, rk, qw, kw, 1e-6, positions, cos, sin, rd, offset)
        oq, ok_ = F.qk_norm_rope_inplace(q, k, qw, kw, 1e-6, positions, cos, sin, rd, offset)
    else:
        F.rope_inplace_ref(rq, rk, positions, cos, sin, rd)
        oq, ok_ = F.rope_inplace(q, k, positions, cos, sin, rd)
    if oq is not q or ok_ is not k:
        return "FAIL returned tensors are not (q, k)"
    errs = {"qkv": _err(qkv, ref_buf), "q": _err(q, rq), "k": _err(k, rk)}
    return _verdict(errs, dtype)


def _rope_with_store(device: str, t: int, hq: int, hk: int, d: int, rd: int, dtype: torch.dtype, norm: bool,
                     n_slots: int, seed: int, max_pos: int, page: int, fill, cache_dtype: torch.dtype, fmt: int = -1,
                     k_scale=None, v_scale=None):
    """One RoPE (+ QK-norm) launch with the fused KV store into a cache filled with `fill`, and the reference
    rotation of the same rows. Slots are scattered over the cache's pages; one row has slot -1 and rows at or past
    n_slots have no slot (CUDA-graph padding). Returns (qkv, ref_buf, k, rk, v, slots, cache, n)."""
    from voltllm.attention.backend import CacheWrite
    from voltllm.kernels import fused as F

    cos, sin, positions, qkv, ref_buf = _rope_case(device, t, hq, hk, d, rd, dtype, seed, max_pos)
    q, k = _views(qkv, hq, hk, d)
    rq, rk = _views(ref_buf, hq, hk, d)
    v = qkv[:, (hq + hk) * d:].view(t, hk, d)
    blocks = t + 3
    slots = torch.randperm(blocks * page, generator=_gen(seed + 8))[:n_slots].to(torch.int64)
    if n_slots > 1:
        slots[1] = -1
    slots = slots.to(device)
    cache = torch.full((2, blocks, page, hk, d), fill, dtype=cache_dtype, device=device)
    write = CacheWrite(v, cache, slots, fmt, k_scale, v_scale)
    if norm:
        qw = _rand((d,), seed + 1, device, dtype, 0.5) + 1.0
        kw = _rand((d,), seed + 2, device, dtype, 0.5) + 1.0
        F.qk_norm_rope_inplace_ref(rq, rk, qw, kw, 1e-6, positions, cos, sin, rd)
        F.qk_norm_rope_inplace(q, k, qw, kw, 1e-6, positions, cos, sin, rd, cache_write=write)
    else:
        F.rope_inplace_ref(rq, rk, positions, cos, sin, rd)
        F.rope_inplace(q, k, positions, cos, sin, rd, cache_write=write)
    return qkv, ref_buf, k, rk, v, slots, cache, min(t, n_slots)


def run_rope_cache_write(device: str, t: int, hq: int, hk: int, d: int, rd: int, dtype: torch.dtype, norm: bool,
                         n_slots: int, seed: int = 0, max_pos: int = 4096, page: int = 4) -> str:
    """RoPE (+ QK-norm) with the fused KV-cache store vs the reference rotation followed by the reference
    cache write (voltllm.attention.torch_ref.write_kv); slot -1 and padding rows write nothing. The whole
    cache (NaN-poisoned elsewhere, so a stray or missing store shows) and the whole qkv buffer are compared."""
    from voltllm.attention.torch_ref import write_kv

    qkv, ref_buf, _, rk, v, slots, cache, n = _rope_with_store(device, t, hq, hk, d, rd, dtype, norm, n_slots, seed,
                                                               max_pos, page, float("nan"), dtype)
    ref_cache = torch.full_like(cache, float("nan"))
    write_kv(rk[:n], v[:n], ref_cache, slots[:n])
    written = ~torch.isnan(ref_cache)
    if not torch.equal(written, ~torch.isnan(cache)):
        return "FAIL the kernel wrote other cache elements than the reference"
    errs = {"qkv": _err(qkv, ref_buf), "cache": _err(cache[written], ref_cache[written])}
    return _verdict(errs, dtype)


def run_rope_fp8_cache_write(device: str, t: int, hq: int, hk: int, d: int, rd: int, dtype: torch.dtype, norm: bool,
                             n_slots: int, fmt: str, seed: int = 0, page: int = 4) -> str:
    """RoPE (+ QK-norm) with the fused store into a uint8 fp8 cache: the codes must equal the reference codec's
    write (kv_fp8.write_kv_fp8_ref, x / scale, RNE, saturation) of the rows the launch rotated, bit for bit; the
    rotation itself against the reference. The cache is filled with 0xFF first (a NaN code no finite value
    encodes to), so stray or missing stores show; slot -1 and rows past n_slots write nothing."""
    from voltllm.kernels.fp8_codec import fp8_format
    from voltllm.kernels.kv_fp8 import write_kv_fp8_ref

    k_scale = torch.tensor([0.37], dtype=torch.float32, device=device)
    v_scale = torch.tensor([1.9], dtype=torch.float32, device=device)
    qkv, ref_buf, k, _, v, slots, cache, n = _rope_with_store(device, t, hq, hk, d, rd, dtype, norm, n_slots, seed,
                                                              4096, page, 0xFF, torch.uint8, fp8_format(fmt),
                                                              k_scale, v_scale)
    ref_cache = torch.full(cache.shape, 0xFF, dtype=torch.uint8)
    write_kv_fp8_ref(k[:n].cpu(), v[:n].cpu(), ref_cache, slots[:n].cpu(), k_scale.cpu(), v_scale.cpu(), fmt)
    if not torch.equal(cache.cpu(), ref_cache):
        bad = int((cache.cpu() != ref_cache).sum())
        return f"FAIL {bad} cache codes differ from the reference codec's write of the rotated rows"
    if int((ref_cache != 0xFF).sum()) == 0:
        return "FAIL nothing was written"
    return _verdict({"qkv": _err(qkv, ref_buf)}, dtype)


def run_gated_heads(device: str, t: int, h: int, d: int, dtype: torch.dtype, seed: int = 0) -> str:
    """The Gated DeltaNet output norm: x [T, H, D] contiguous, the gate a strided view of a wider projection,
    an fp32 weight (as the layer holds it)."""
    from voltllm.kernels import fused as F

    x = _rand((t, h, d), seed, device, dtype, 3.0)
    proj = _rand((t, h * d + 5), seed + 1, device, dtype, 2.0)
    gate = proj[:, 5:].view(t, h, d)
    w = _rand((d,), seed + 2, device, torch.float32, 0.5) + 1.0
    ref = F.gated_rms_norm_heads_ref(x, gate, w, 1e-6)
    out = torch.full_like(x, float("nan"))
    got = F.gated_rms_norm_heads(x, gate, w, 1e-6, out=out)
    if got is not out:
        return "FAIL returned tensor is not `out`"
    return _verdict({"out": _err(out, ref), "alloc": _err(F.gated_rms_norm_heads(x, gate, w, 1e-6), ref)}, dtype)


def run_silu(device: str, t: int, i: int, dtype: torch.dtype, seed: int = 0, lead3: bool = False) -> str:
    from voltllm.kernels import fused as F

    shape = (2, (t + 1) // 2, 2 * i) if lead3 else (t, 2 * i)
    x = _rand(shape, seed, device, dtype, 3.0)
    ref = F.silu_and_mul_ref(x)
    out = torch.full(ref.shape, float("nan"), dtype=dtype, device=device)
    got = F.silu_and_mul(x, out=out)
    if got is not out:
        return "FAIL returned tensor is not `out`"
    return _verdict({"out": _err(out, ref), "alloc": _err(F.silu_and_mul(x), ref)}, dtype)


def run_sigmoid_gate(device: str, t: int, h: int, d: int, dtype: torch.dtype, seed: int = 0,
                     in_place: bool = False) -> str:
    """Gated attention's output gate: x [T, H, D] the attention output, the gate the second half of each head's
    [q | gate] columns of the qkv projection (strided tokens and heads)."""
    from voltllm.kernels import fused as F

    x = _rand((t, h, d), seed, device, dtype, 3.0)
    qg = _rand((t, h, 2 * d), seed + 1, device, dtype, 4.0)
    gate = qg.chunk(2, dim=-1)[1]
    ref = F.sigmoid_gate_mul_ref(x, gate)
    out = x if in_place else torch.full_like(x, float("nan"))
    got = F.sigmoid_gate_mul(x, gate, out=out)
    if got is not out:
        return "FAIL returned tensor is not `out`"
    errs = {"out": _err(out, ref)}
    if not in_place:
        errs["alloc"] = _err(F.sigmoid_gate_mul(x, gate), ref)
    return _verdict(errs, dtype)


f32, f16 = torch.float32, torch.float16
CHECKS = {
    "rms_f32_T7_H576": lambda d: run_rms(d, 7, 576, f32),
    "rms_f16_T1_H100": lambda d: run_rms(d, 1, 100, f16, seed=1),
    "rms_f16_T7_H576_offset1": lambda d: run_rms(d, 7, 576, f16, offset=1.0, seed=2),
    "rms_f32_T2_H20000_looped": lambda d: run_rms(d, 2, 20000, f32, seed=3),
    "add_rms_f32_T7_H576": lambda d: run_add_rms(d, 7, 576, f32, seed=4),
    "add_rms_f16_T1_H100": lambda d: run_add_rms(d, 1, 100, f16, seed=5),
    "add_rms_f16_T7_H576_offset1": lambda d: run_add_rms(d, 7, 576, f16, offset=1.0, seed=6),
    "add_rms_f16x_f32res_T7_H100": lambda d: run_add_rms(d, 7, 100, f16, seed=7, res_dtype=f32),
    "add_rms_f16_T2_H20000_looped": lambda d: run_add_rms(d, 2, 20000, f16, seed=8),
    "heads_f32_T7_D128_qkv_view": lambda d: run_heads(d, 7, 4, 2, 128, f32, seed=9),
    "heads_f16_T1_D64_qkv_view": lambda d: run_heads(d, 1, 3, 1, 64, f16, seed=10),
    "heads_f16_T7_D100_offset1": lambda d: run_heads(d, 7, 5, 3, 100, f16, offset=1.0, seed=11),
    "rope_f32_T7_D128_rot128": lambda d: run_rope(d, 7, 4, 2, 128, 128, f32, False, seed=12),
    "rope_f32_T7_D128_rot32": lambda d: run_rope(d, 7, 4, 2, 128, 32, f32, False, seed=13),
    "rope_f16_T1_D64_rot64": lambda d: run_rope(d, 1, 4, 2, 64, 64, f16, False, seed=14),
    "rope_f16_T7_D80_rot20": lambda d: run_rope(d, 7, 3, 1, 80, 20, f16, False, seed=15),
    "qknorm_rope_f32_T7_D128_rot128": lambda d: run_rope(d, 7, 4, 2, 128, 128, f32, True, seed=16),
    "qknorm_rope_f32_T7_D128_rot32": lambda d: run_rope(d, 7, 4, 2, 128, 32, f32, True, seed=17),
    "qknorm_rope_f16_T1_D128_rot128": lambda d: run_rope(d, 1, 8, 2, 128, 128, f16, True, seed=18),
    "qknorm_rope_f16_T7_D64_rot16_offset1": lambda d: run_rope(d, 7, 4, 2, 64, 16, f16, True, offset=1.0,
                                                               seed=19),
    "rope_kv_write_f32_T7_D128_rot128": lambda d: run_rope_cache_write(d, 7, 4, 2, 128, 128, f32, False, 7, seed=23),
    "rope_kv_write_f16_T5_D64_rot16_padded": lambda d: run_rope_cache_write(d, 5, 4, 2, 64, 16, f16, False, 3, seed=24),
    "qknorm_rope_kv_write_f16_T7_D128_rot32": lambda d: run_rope_cache_write(d, 7, 8, 2, 128, 32, f16, True, 7,
                                                                              seed=25),
    "rope_fp8_e4m3_write_f16_T7_D128_rot128": lambda d: run_rope_fp8_cache_write(d, 7, 4, 2, 128, 128, f16, False, 6,
                                                                                 "e4m3", seed=31),
    "qknorm_rope_fp8_e5m2_write_f32_T5_D64_rot32": lambda d: run_rope_fp8_cache_write(d, 5, 4, 2, 64, 32, f32, True, 5,
                                                                                      "e5m2", seed=32),
    "qknorm_rope_kv_write_f32_T1_D80_rot80_gqa1": lambda d: run_rope_cache_write(d, 1, 3, 3, 80, 80, f32, True, 1,
                                                                                  seed=26),
    "gated_heads_f32_T7_H3_D128": lambda d: run_gated_heads(d, 7, 3, 128, f32, seed=27),
    "gated_heads_f16_T5_H4_D100": lambda d: run_gated_heads(d, 5, 4, 100, f16, seed=28),
    "silu_f32_T7_I100": lambda d: run_silu(d, 7, 100, f32, seed=20),
    "silu_f16_T1_I576": lambda d: run_silu(d, 1, 576, f16, seed=21),
    "silu_f16_T7_I1500_3d": lambda d: run_silu(d, 7, 1500, f16, seed=22, lead3=True),
    "sigmoid_gate_f32_T7_H3_D100": lambda d: run_sigmoid_gate(d, 7, 3, 100, f32, seed=33),
    "sigmoid_gate_f16_T5_H4_D256_in_place": lambda d: run_sigmoid_gate(d, 5, 4, 256, f16, seed=34, in_place=True),
    "sigmoid_gate_f16_T1_H16_D256": lambda d: run_sigmoid_gate(d, 1, 16, 256, f16, seed=35),
}


def main(device: str = "cpu") -> int:
    from interp_util import run_checks

    return run_checks(CHECKS, device)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
