"""Software FP8 codec: bit-exact against torch's own float8 conversions; Triton kernels under the
interpreter against the torch references (in a subprocess, see _fp8_interp_check.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from voltllm.attention.torch_ref import write_kv
from voltllm.kernels import fp8_codec as fc
from voltllm.kernels import kv_fp8

REPO = Path(__file__).resolve().parents[2]
FORMATS = [
    ("e4m3", torch.float8_e4m3fn, fc.encode_e4m3, fc.decode_e4m3),
    ("e5m2", torch.float8_e5m2, fc.encode_e5m2, fc.decode_e5m2),
]
CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def torch_codes(x: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    return x.to(fp8).view(torch.uint8)


def assert_codes_equal(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor) -> None:
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(x[i].item(), got[i].item(), want[i].item()) for i in bad[:8]]


@pytest.mark.parametrize("name,fp8,enc,dec", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_all_codes(name, fp8, enc, dec, dtype):
    got = dec(CODES, dtype)
    want = CODES.view(fp8).to(dtype)
    assert got.dtype == dtype
    assert torch.equal(got.view(BITS[dtype]), want.view(BITS[dtype]))  # NaN payloads included


@pytest.mark.parametrize("name,fp8,enc,dec", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_encode_every_16bit_value(name, fp8, enc, dec, dtype):
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    assert_codes_equal(enc(x), torch_codes(x, fp8), x)


def _fp32_cases() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    random_bits = torch.randint(-2**31, 2**31 - 1, (1 << 21,), generator=g, dtype=torch.int64).to(torch.int32)
    parts = [
        random_bits.view(torch.float32),  # every exponent, NaN payloads, fp32 subnormals
        torch.randn(1 << 16, generator=g) * 300,  # normal
        torch.randn(1 << 16, generator=g) * 2e-3,  # e4m3 subnormal / underflow
        torch.randn(1 << 16, generator=g) * 3e-5,  # e5m2 subnormal / underflow
        torch.randn(1 << 14, generator=g) * 1e6,  # huge
        torch.randn(1 << 14, generator=g) * 1e-30,  # tiny
        torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 448.0, 449.0, 464.0,
                      464.00003, 480.0, -500.0, 57344.0, 61439.996, 61440.0, 65504.0, 3.4e38, 1e-45, -1e-45]),
    ]
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        vals = CODES.view(fp8).float()
        vals = vals[vals.isfinite()].unique()  # sorted
        mid = (vals[1:] + vals[:-1]) / 2  # exact ties: round half to even
        parts += [vals, mid, mid.nextafter(torch.full_like(mid, float("inf"))),
                  mid.nextafter(torch.full_like(mid, -float("inf")))]
    return torch.cat(parts)


@pytest.mark.parametrize("name,fp8,enc,dec", FORMATS)
def test_encode_fp32_bit_exact(name, fp8, enc, dec):
    x = _fp32_cases()
    assert_codes_equal(enc(x), torch_codes(x, fp8), x)


@pytest.mark.parametrize("name,fp8,enc,dec", FORMATS)
def test_encode_semantics(name, fp8, enc, dec):
    x = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"), 1e9, -1e9])
    got = enc(x).tolist()
    if name == "e4m3":  # saturating: overflow and inf -> +-448
        assert got == [0x00, 0x80, 0x7E, 0xFE, 0x7F, 0xFF, 0x7E, 0xFE]
        # ties to even, subnormals in units of 2**-9 included
        assert enc(torch.tensor([448.0, 464.0, 465.0, 2.0**-10, 3 * 2.0**-10, 5 * 2.0**-10])).tolist() == \
            [0x7E, 0x7E, 0x7E, 0, 2, 2]
    else:  # IEEE-like: overflow rounds to inf
        assert got == [0x00, 0x80, 0x7C, 0xFC, 0x7F, 0xFF, 0x7C, 0xFC]
        assert enc(torch.tensor([57344.0, 61439.0, 61440.0, 2.0**-17])).tolist() == [0x7B, 0x7B, 0x7C, 0]


@pytest.mark.parametrize("name,fp8,enc,dec", FORMATS)
def test_roundtrip(name, fp8, enc, dec):
    vals = dec(CODES, torch.float32)
    ok = ~vals.isnan()
    assert torch.equal(enc(vals[ok]), CODES[ok])
    assert torch.equal(enc(vals[ok].half()), CODES[ok])


def test_format_names():
    assert fc.fp8_format("fp8") == fc.fp8_format("e4m3") == fc.fp8_format("fp8_e4m3") == fc.FP8_E4M3
    assert fc.fp8_format("fp8_e5m2") == fc.fp8_format("e5m2") == fc.FP8_E5M2
    with pytest.raises(ValueError):
        fc.fp8_format("e3m4")
    with pytest.raises(TypeError):
        fc.encode_e4m3(torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("name,fp8,enc,dec", FORMATS)
def test_scaled_references(name, fp8, enc, dec):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4096, generator=g) * 30
    for scale in (0.1, torch.tensor([2.5]), None):
        s = 1.0 if scale is None else float(scale)
        assert torch.equal(fc.scaled_encode_ref(x, scale, name), torch_codes(x / s, fp8))
        assert torch.equal(fc.fp8_encode(x.half(), scale, name), torch_codes(x.half().float() / s, fp8))
        want = (CODES.view(fp8).float() * s).half()
        got = fc.fp8_decode(CODES, scale, name)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got[~got.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("name,fp8,enc,dec", FORMATS)
def test_kv_references_match_torch_fp8_cache(name, fp8, enc, dec):
    g = torch.Generator().manual_seed(7)
    nb, page, h, d, t = 10, 4, 2, 16, 19
    k = torch.randn(t, h, d, generator=g).half() * 3
    v = torch.randn(t, h, d, generator=g).half()
    slots = torch.randperm(nb * page, generator=g)[:t].long()
    slots[3] = -1
    ks, vs = 0.02, 0.01
    cache = torch.zeros(2, nb, page, h, d, dtype=torch.uint8)
    kv_fp8.write_kv_fp8(k, v, cache, slots, ks, vs, name)
    # independent path: torch's own float8 cache through the plain reference writer
    ref = torch.zeros(2, nb, page, h, d, dtype=fp8)
    write_kv((k.float() / ks), (v.float() / vs), ref, slots)
    assert torch.equal(cache, ref.view(torch.uint8))
    table = torch.randperm(nb, generator=g).int()
    ctx = 7 * page + 1
    kw, vw = kv_fp8.gather_kv_fp8(cache, table, ctx, ks, vs, name)
    blocks = table[: (ctx + page - 1) // page].long()
    want = ref[:, blocks].reshape(2, -1, h, d)[:, :ctx].float()
    assert torch.equal(kw, (want[0] * ks).half()) and torch.equal(vw, (want[1] * vs).half())
    assert kw.shape == (ctx, h, d) and kw.dtype == torch.float16


def test_triton_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "unit" / "_fp8_interp_check.py")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-4000:] + proc.stderr[-4000:]
