"""Run under TRITON_INTERPRET=1 (test_gguf_planes.py): the dequant-GEMM (one row; several, over two programs along the rows) and the
dequant-to-fp16 kernel against the torch reference (gguf_planes.dequantize_planes), for every kept GGUF kind and
the AWQ / GPTQ int4 kinds (zero points or the fixed zero 8), the 8-bit GPTQ int8 kinds (zero points or the fixed
zero 128), FP8 (E4M3, fp32 scales), NVFP4 (E2M1 codes, E4M3
scales per 16, fp32 global per row) and bitsandbytes' NF4 / FP4 (table codes, an fp16 absmax per block; the dequantized
weights bit for bit), on random blocks, with row / group tails, a bias and an output that is a column slice of a wider
tensor; and bitsandbytes layers quantized by the reference codec (bnb_codec.py: 4-bit with and without double
quantization, 8-bit rows) re-laid as planes, against the codec's own dequantization. Prints `CHECK name ok|FAIL
detail` lines."""
import sys

import torch
from interp_util import patch_interpreter_index

patch_interpreter_index()
from voltllm.kernels.quant_gemv import dequantize, quant_matmul, quant_moe_matmul  # noqa: E402
from voltllm.model.layers.gguf_planes import (FP8_KIND, KINDS, NVFP4_KIND, Unpacked,  # noqa: E402
                                              bnb_kind, dequantize_planes, int4_kind, int8_kind, planes_from_blocks,
                                              random_blocks, to_planes)
from voltllm.model.loader.bnb_checkpoint import BNB8_KIND, Bnb4bitWeight, Bnb8bitWeight  # noqa: E402
from voltllm.model.loader.bnb_codec import dequantize_4bit, dequantize_int8, quantize_4bit, quantize_int8  # noqa: E402

# AWQ / GPTQ checkpoints (8-bit GPTQ: groups of 128 with zero points, of 16 without); FP8 and NVFP4 checkpoints;
# bitsandbytes NF4 in blocks of 64, FP4 in blocks of 128
INT4_KINDS = [int4_kind(32, True), int4_kind(128, True), int4_kind(64, False), int8_kind(128, True),
              int8_kind(16, False), FP8_KIND, NVFP4_KIND, bnb_kind("nf4", 64), bnb_kind("fp4", 128)]
# bitsandbytes layers from the codec: (quant_type, blocksize, double quantization, weight dtype)
BNB_LAYERS = [("nf4", 64, True, torch.float16), ("nf4", 128, False, torch.bfloat16), ("fp4", 64, False, torch.float16),
              ("fp4", 128, True, torch.float32)]
CHECKS = [f"{name}-{form}" for name in list(KINDS) + [k.name for k in INT4_KINDS]
          for form in ("dequant", "rows1", "rows3", "rows6")] + ["MOE-pairs", "NVFP4-MOE-pairs", "Q2_K-MOE-pairs",
                                                                  "INT8-MOE-pairs", "BNB_NF4-MOE-pairs"] + [
    f"codec-{t}-b{bs}{'-double' if dq else ''}-{str(dt).removeprefix('torch.')}" for t, bs, dq, dt in BNB_LAYERS] + [
    f"codec-int8-{dt}" for dt in ("float16", "bfloat16")]


def _int4_planes(kind, n, k, gen):
    """Random codes, fp16 group scales and (for zero-point kinds) zero points 0..15 in an int4 kind's planes (int8
    kinds: codes 0..255 and every int8 zero plane value, i.e. zeros 0..255); FP8:
    every E4M3 code but the NaNs (subnormals included) and fp32 scales; NVFP4: every E2M1 code, E4M3 scale codes of
    every exponent and sign (subnormals included, no NaN) and a global scale per row that is not a power of two;
    bitsandbytes: every table code and a positive fp16 absmax per block."""
    groups = k // kind.super
    if kind.bnb:
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        d = (torch.rand(n, groups, generator=gen) * 0.1 + 1e-3).half()
        return to_planes(Unpacked(codes=codes, d=d, m=None, sc=None, mn=None), kind)
    if kind.fp4:
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        sc = torch.randint(0, 256, (n, k // kind.sub), dtype=torch.uint8, generator=gen)
        sc[(sc & 0x7F) == 0x7F] = 0x7E
        g = (torch.rand(n, 1, generator=gen) + 0.5) * 1e-4
        d = g.expand(n, -(-k // kind.super)).contiguous()
        return to_planes(Unpacked(codes=codes, d=d, m=None, sc=sc.view(torch.int8), mn=None), kind)
    if kind.fp8:
        codes = torch.randint(0, 255, (n, k), dtype=torch.uint8, generator=gen)
        codes[(codes & 0x7F) == 0x7F] = 0x7E
        d = torch.rand(n, groups, generator=gen) * 1e-3 + 1e-4
        return to_planes(Unpacked(codes=codes, d=d, m=None, sc=None, mn=None), kind)
    top = 256 if kind.hi_bits else 16
    codes = torch.randint(0, top, (n, k), dtype=torch.uint8, generator=gen)
    d = (torch.randn(n, groups, generator=gen) * 0.02).half()
    lo = -128 if kind.hi_bits else 0  # the int8 kinds' zero plane: zero - 128
    zeros = torch.randint(lo, lo + top, (n, groups), dtype=torch.int8, generator=gen) if kind.zero_points else None
    return to_planes(Unpacked(codes=codes, d=d, m=None, sc=None, mn=zeros), kind)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main() -> int:
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    failed = 0
    for kind in list(KINDS.values()) + INT4_KINDS:
        name = kind.name
        # 576: 9 groups of 64, a tail for G64 = 2 and 4 (and a partial last global span of NVFP4's 256)
        k = 768 if kind.block in (256, 128) else 576
        n = 37  # a row tail for every BLOCK_N
        p = (planes_from_blocks(random_blocks(name, n, k, gen), name, k) if name in KINDS
             else _int4_planes(kind, n, k, gen))
        ref_w = dequantize_planes(p)
        got = dequantize(p, torch.float32, out=torch.full((n, k), float("nan")))
        ok = torch.equal(got, ref_w)
        failed += not ok
        print(f"CHECK {name}-dequant {'ok' if ok else 'FAIL'} max {float((got - ref_w).abs().max()):.3g}")
        for form, m in (("rows1", 1), ("rows3", 3), ("rows6", 6)):  # 6: two programs along the rows
            x = torch.randn(m, k, dtype=torch.float16)
            bias = torch.randn(n, dtype=torch.float16) if m == 3 else None
            wide = torch.full((m, n + 8), float("nan"), dtype=torch.float16)
            out = quant_matmul(x, p, bias, out=wide[:, 4:4 + n])
            ref = x.float() @ ref_w.T + (0 if bias is None else bias.float())
            err = rel(out, ref)
            ok = err < 2e-3 and not torch.isnan(out).any() and torch.isnan(wide[:, :4]).all()
            failed += not ok
            print(f"CHECK {name}-{form} {'ok' if ok else 'FAIL'} rel {err:.2e}")
    failed += not _check_moe_pairs(gen, int4_kind(64, True), "MOE-pairs")
    failed += not _check_moe_pairs(gen, NVFP4_KIND, "NVFP4-MOE-pairs")
    failed += not _check_moe_pairs(gen, KINDS["Q2_K"], "Q2_K-MOE-pairs")  # a GGUF low-bit kind: scale and min per 16
    failed += not _check_moe_pairs(gen, int8_kind(64, True), "INT8-MOE-pairs")  # 8-bit GPTQ experts
    failed += not _check_moe_pairs(gen, bnb_kind("nf4", 64), "BNB_NF4-MOE-pairs")  # bitsandbytes experts
    for layer in BNB_LAYERS:
        failed += not _check_bnb_codec(gen, *layer)
    for dtype in (torch.float16, torch.bfloat16):
        failed += not _check_bnb_int8_codec(gen, dtype)
    return 1 if failed else 0


def _check_bnb_int8_codec(gen, dtype: torch.dtype) -> bool:
    """A bitsandbytes 8-bit layer (bnb_codec.quantize_int8) re-laid as planes (Bnb8bitWeight.to_weight: 8-bit GPTQ's
    symmetric kind, SCB / 127 in fp16 per 64 inputs): the dequantize kernel (into a NaN-poisoned output) equals the
    planes' reference bit for bit and the codec's q * SCB / 127 within the scale's fp16 rounding (2^-11 relative);
    the dequant-GEMM multiplies like it. Rows of scales 10^-2 .. 10 and an all-zero row."""
    n, k = 37, 384
    w = (torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, n)[:, None]).to(dtype)
    w[5] = 0
    codes, scb = quantize_int8(w)
    ref = dequantize_int8(codes, scb)
    planes = Bnb8bitWeight(codes, scb).to_weight(torch.device("cpu"), torch.float16)
    got = dequantize(planes, torch.float32, out=torch.full((n, k), float("nan")))
    err = float(((got - ref).abs() / ref.abs().clamp_min(1e-30))[ref != 0].max())
    ok = (planes.kind == BNB8_KIND and torch.equal(got, dequantize_planes(planes)) and err <= 2 ** -11 * (1 + 2 ** -10)
          and not got[5].any())
    x = torch.randn(3, k, dtype=torch.float16)
    out = quant_matmul(x, planes, out=torch.full((3, n), float("nan"), dtype=torch.float16))
    mm_err = rel(out, x.float() @ ref.T)
    ok = ok and mm_err < 2e-3 and not torch.isnan(out).any()
    print(f"CHECK codec-int8-{str(dtype).removeprefix('torch.')} {'ok' if ok else 'FAIL'} max rel {err:.2e} "
          f"matmul rel {mm_err:.2e}")
    return ok


def _check_bnb_codec(gen, quant_type: str, blocksize: int, double_quant: bool, dtype: torch.dtype) -> bool:
    """A weight quantized by bnb_codec, re-laid as planes (Bnb4bitWeight.to_weight): the dequantize kernel (into a
    NaN-poisoned output) and the dequant-GEMM against the codec's dequantization in fp32. The absmax's fp16 rounding
    is the only difference: none without double quantization (the absmax is one of the fp16 / bf16 weights; fp32
    weights round), at most 2^-11 relative per element with it."""
    n, k = 37, 384
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    packed, state = quantize_4bit(w, quant_type, blocksize, double_quant=double_quant)
    ref = dequantize_4bit(packed, state.__class__(**{**state.__dict__, "dtype": torch.float32}))
    planes = Bnb4bitWeight(packed, state).to_weight(torch.device("cpu"), torch.float16)
    got = dequantize(planes, torch.float32, out=torch.full((n, k), float("nan")))
    err = float(((got - ref).abs() / ref.abs().clamp_min(1e-30))[ref != 0].max())
    exact = dtype != torch.float32 and not double_quant
    ok = (torch.equal(got, ref) if exact else err <= 2 ** -11) and torch.equal(got, dequantize_planes(planes))
    x = torch.randn(3, k, dtype=torch.float16)
    out = quant_matmul(x, planes, out=torch.full((3, n), float("nan"), dtype=torch.float16))
    mm_err = rel(out, x.float() @ ref.T)
    ok = ok and mm_err < 2e-3 and not torch.isnan(out).any()
    name = f"codec-{quant_type}-b{blocksize}{'-double' if double_quant else ''}-{str(dtype).removeprefix('torch.')}"
    print(f"CHECK {name} {'ok' if ok else 'FAIL'} max rel {err:.2e} (exact {exact}) matmul rel {mm_err:.2e}")
    return ok


def _check_moe_pairs(gen, kind, name: str) -> bool:
    """quant_moe_matmul: 5 (token, expert) pairs over 3 experts of 40 rows stacked in one weight of `kind`, against
    each pair's row of x times its expert's dequantized block."""
    e, rows, k = 3, 40, 256
    p = (planes_from_blocks(random_blocks(kind.name, e * rows, k, gen), kind.name, k) if kind.name in KINDS
         else _int4_planes(kind, e * rows, k, gen))
    w = dequantize_planes(p)
    x = torch.randn(4, k, dtype=torch.float16)
    x_rows = torch.tensor([0, 0, 3, 1, 2], dtype=torch.int32)
    experts = torch.tensor([2, 0, 2, 1, 0], dtype=torch.int32)
    out = quant_moe_matmul(x, p, rows, x_rows, experts, out=torch.full((5, rows), float("nan"), dtype=torch.float16))
    ref = torch.stack([x[r].float() @ w[ex * rows:(ex + 1) * rows].T for r, ex in zip(x_rows.tolist(),
                                                                                      experts.tolist())])
    err = rel(out, ref)
    ok = err < 2e-3 and not torch.isnan(out).any()
    print(f"CHECK {name} {'ok' if ok else 'FAIL'} rel {err:.2e}")
    return ok


if __name__ == "__main__":
    sys.exit(main())
