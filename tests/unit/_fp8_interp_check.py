"""Runs the FP8 Triton kernels under the Triton interpreter (CPU) and compares them with the torch
references bit for bit. Started in a subprocess by tests/unit/test_fp8_codec.py, because
TRITON_INTERPRET=1 must be set before any @triton.jit decorator runs. Prints "OK" and exits 0 on success.
"""
import os
import sys
import warnings

os.environ["TRITON_INTERPRET"] = "1"
warnings.filterwarnings("ignore", category=RuntimeWarning)  # numpy: fp32 -> fp16 overflow to inf is intended

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from voltllm.kernels import fp8_codec as fc  # noqa: E402
from voltllm.kernels import kv_fp8  # noqa: E402

FAILS: list[str] = []


def check(name: str, ok: bool) -> None:
    print(("ok    " if ok else "FAIL  ") + name, flush=True)
    if not ok:
        FAILS.append(name)


def same_bits(a: torch.Tensor, b: torch.Tensor, nan_payload: bool = True) -> bool:
    """Bit equality; with nan_payload=False NaNs only have to be NaN in both (sign/payload free)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == torch.uint8:
        return bool(torch.equal(a, b))
    it = {2: torch.int16, 4: torch.int32}[a.element_size()]
    if nan_payload:
        return bool(torch.equal(a.view(it), b.view(it)))
    na, nb = a.isnan(), b.isnan()
    return bool(torch.equal(na, nb)) and bool(torch.equal(a[~na].view(it), b[~nb].view(it)))


@triton.jit
def _decode_helper_kernel(u8_ptr, out_ptr, n, FMT: tl.constexpr, FP16: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    c = tl.load(u8_ptr + offs, mask=mask, other=0)
    if FP16:
        tl.store(out_ptr + offs, fc.fp8_to_fp16(c, FMT), mask=mask)
    else:
        tl.store(out_ptr + offs, fc.fp8_to_fp32(c, FMT), mask=mask)


def special_fp32() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    parts = [
        torch.randn(4096, generator=g) * 100,  # normal range of both formats
        torch.randn(2048, generator=g) * 1e-3,  # e4m3 subnormal / underflow range
        torch.randn(2048, generator=g) * 1e-5,  # e5m2 subnormal range
        torch.randn(1024, generator=g) * 1e5,  # overflow of both
        torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 448.0, 464.0,
                      465.0, 480.0, 57344.0, 61440.0, 61439.99, 2.0**-9, 2.0**-10, 3 * 2.0**-11, 2.0**-16,
                      2.0**-17, 3 * 2.0**-18, 1e-40, -1e-40, 3.4e38]),
    ]
    # every e4m3 / e5m2 value, and the midpoints between neighbours (exact ties)
    for f in (torch.float8_e4m3fn, torch.float8_e5m2):
        vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(f).float()
        vals = vals[vals.isfinite()].sort().values
        parts += [vals, (vals[1:] + vals[:-1]) / 2]
    return torch.cat(parts)


def main() -> int:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    all_fp16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    x32 = special_fp32()
    for fmt, tdt in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        # helpers through the kernels at scale 1: equal to torch itself
        got = fc.fp8_encode(all_fp16, 1.0, fmt, use_triton=True)
        check(f"{fmt} encode all fp16 values", same_bits(got, all_fp16.to(tdt).view(torch.uint8)))
        got = fc.fp8_encode(x32, 1.0, fmt, use_triton=True)
        check(f"{fmt} encode fp32 specials", same_bits(got, x32.to(tdt).view(torch.uint8)))
        got = fc.fp8_decode(codes, 1.0, fmt, dtype=torch.float32, use_triton=True)
        check(f"{fmt} decode kernel 256 codes fp32", same_bits(got, codes.view(tdt).float(), nan_payload=False))
        got = fc.fp8_decode(codes, 1.0, fmt, dtype=torch.float16, use_triton=True)
        check(f"{fmt} decode kernel 256 codes fp16", same_bits(got, codes.view(tdt).half(), nan_payload=False))
        out32 = torch.empty(256, dtype=torch.float32)
        _decode_helper_kernel[(1,)](codes, out32, 256, FMT=fc.fp8_format(fmt), FP16=False, BLOCK=256)
        check(f"{fmt} fp32 decode helper (NaN bits too)", same_bits(out32, codes.view(tdt).float()))
        out16 = torch.empty(256, dtype=torch.float16)
        _decode_helper_kernel[(1,)](codes, out16, 256, FMT=fc.fp8_format(fmt), FP16=True, BLOCK=256)
        check(f"{fmt} fp16 decode helper", same_bits(out16, codes.view(tdt).half(), nan_payload=False))
        # scaled kernels vs scaled references
        for scale in (0.37, 3.0, 1e-3):
            for x in (x32, (x32 / 50).half()):
                got = fc.fp8_encode(x, scale, fmt, use_triton=True)
                check(f"{fmt} encode {x.dtype} scale={scale}", same_bits(got, fc.scaled_encode_ref(x, scale, fmt)))
            for dt in (torch.float16, torch.float32):
                got = fc.fp8_decode(codes, torch.tensor([scale]), fmt, dtype=dt, use_triton=True)
                ref = fc.scaled_decode_ref(codes, scale, fmt, dt)
                check(f"{fmt} decode ->{dt} scale={scale}", same_bits(got, ref, nan_payload=False))

    # paged KV write + bridge
    g = torch.Generator().manual_seed(1)
    for fmt in ("e4m3", "e5m2"):
        for (nb, page, h, d) in ((12, 16, 2, 64), (9, 8, 3, 40)):
            t = 37
            kv_a = torch.zeros(2, nb, page, h, d, dtype=torch.uint8)
            kv_b = kv_a.clone()
            qkv = torch.randn(t, 3 * h, d, generator=g).half() * 4  # strided k/v views, as from a qkv split
            k, v = qkv[:, h:2 * h], qkv[:, 2 * h:]
            slots = torch.randperm(nb * page, generator=g)[:t].long()
            slots[5] = -1
            slots[-1] = -1
            ks, vs = torch.tensor([0.05]), torch.tensor([0.02])
            kv_fp8.write_kv_fp8(k, v, kv_a, slots, ks, vs, fmt, use_triton=True)
            kv_fp8.write_kv_fp8_ref(k, v, kv_b, slots, ks, vs, fmt)
            check(f"{fmt} kv write page={page} h={h} d={d}", same_bits(kv_a, kv_b))
            kv_a = torch.randint(0, 256, kv_a.shape, generator=g, dtype=torch.int32).to(torch.uint8)
            table = torch.randperm(nb, generator=g).int()
            ctx = (nb - 2) * page + 3
            ka, va = kv_fp8.gather_kv_fp8(kv_a, table, ctx, ks, vs, fmt, use_triton=True)
            kb, vb = kv_fp8.gather_kv_fp8_ref(kv_a, table, ctx, ks, vs, fmt)
            check(f"{fmt} kv gather page={page} h={h} d={d}",
                  same_bits(ka, kb, nan_payload=False) and same_bits(va, vb, nan_payload=False))
            ws = (torch.full((ctx + 5, h, d), 7.0, dtype=torch.float16),
                  torch.full((ctx + 5, h, d), 7.0, dtype=torch.float16))
            kw, vw = kv_fp8.gather_kv_fp8(kv_a, table, ctx, ks, vs, fmt, out=ws, use_triton=True)
            check(f"{fmt} kv gather into workspace",
                  same_bits(kw, kb, nan_payload=False) and same_bits(vw, vb, nan_payload=False)
                  and bool((ws[0][ctx:] == 7).all()))
    print("FAILED: " + ", ".join(FAILS) if FAILS else "OK")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
