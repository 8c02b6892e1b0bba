"""Fused elementwise Triton kernels (voltllm.kernels.fused) on CUDA: the interpreter checks, then real model
shapes in fp16 and bf16 against the torch references, then a timing table (printed, not asserted: run with
`pytest -m gpu -s tests/gpu/test_fused_kernels_cuda.py`) of each fused kernel vs the torch layer it replaces."""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.gpu

_spec = importlib.util.spec_from_file_location(
    "_fused_interp_check", Path(__file__).resolve().parents[1] / "unit" / "_fused_interp_check.py")
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)

# (name, hidden, q heads, kv heads, head_dim, rotary_dim, intermediate, norm offset)
SHAPES = [
    ("llama8b-like", 4096, 32, 8, 128, 128, 14336, 0.0),
    ("qwen3.5-27b-like", 5120, 24, 4, 256, 64, 17408, 1.0),
]
DTYPES = [torch.float16, torch.bfloat16]


def _need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")


@pytest.mark.parametrize("name", list(H.CHECKS))
def test_fused_kernel_cuda(name):
    _need_cuda()
    status = H.CHECKS[name]("cuda")
    assert status.startswith("ok"), status


@pytest.mark.parametrize("t", [1, 5, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_fused_kernels_real_shapes(shape, dtype, t):
    _need_cuda()
    _, hidden, hq, hk, d, rd, inter, offset = shape
    results = {
        "rms": H.run_rms("cuda", t, hidden, dtype, offset=offset, seed=1),
        "add_rms": H.run_add_rms("cuda", t, hidden, dtype, offset=offset, seed=2),
        "add_rms_fp32_residual": H.run_add_rms("cuda", t, hidden, dtype, offset=offset, seed=3,
                                               res_dtype=torch.float32),
        "heads": H.run_heads("cuda", t, hq, hk, d, dtype, offset=offset, seed=4),
        "rope": H.run_rope("cuda", t, hq, hk, d, rd, dtype, False, seed=5, max_pos=262144),
        "qknorm_rope": H.run_rope("cuda", t, hq, hk, d, rd, dtype, True, offset=offset, seed=6, max_pos=262144),
        "silu": H.run_silu("cuda", t, inter, dtype, seed=7),
    }
    bad = {k: v for k, v in results.items() if not v.startswith("ok")}
    assert not bad, bad


def test_long_rows_looped_path_cuda():
    _need_cuda()
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        status = H.run_add_rms("cuda", 3, 24576, dtype, seed=9)
        assert status.startswith("ok"), status


def test_cuda_graph_replay_equals_eager():
    """One decode-step-shaped chain captured in a CUDA graph == the same chain run eagerly."""
    _need_cuda()
    from voltllm.kernels import fused as F

    dev, dt, t, hq, hk, d, hidden = "cuda", torch.float16, 4, 32, 8, 128, 4096
    cos, sin = H.tables(dev, 4096, d)
    w, qw, kw = (torch.rand(n, device=dev, dtype=dt) + 0.5 for n in (hidden, d, d))
    x0 = torch.randn(t, hidden, device=dev, dtype=dt)
    r0 = torch.randn(t, hidden, device=dev, dtype=dt)
    qkv0 = torch.randn(t, (hq + 2 * hk) * d, device=dev, dtype=dt)
    gu0 = torch.randn(t, 2 * 1024, device=dev, dtype=dt)
    pos0 = torch.tensor([3, 100, 4000, 7], device=dev)

    x, r, qkv, gu, pos = (v.clone() for v in (x0, r0, qkv0, gu0, pos0))
    out_n, out_a = torch.empty_like(x), torch.empty(t, 1024, device=dev, dtype=dt)

    def step():
        F.fused_add_rms_norm(x, r, w, 1e-6, out=out_n)
        q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        F.qk_norm_rope_inplace(q.view(t, hq, d), k.view(t, hk, d), qw, kw, 1e-6, pos, cos, sin, d)
        F.silu_and_mul(gu, out=out_a)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    eager = [v.clone() for v in (out_n, r, qkv, out_a)]
    g = torch.cuda.CUDAGraph()
    for v, v0 in ((x, x0), (r, r0), (qkv, qkv0), (gu, gu0)):
        v.copy_(v0)
    with torch.cuda.graph(g):
        step()
    for v, v0 in ((x, x0), (r, r0), (qkv, qkv0), (gu, gu0)):
        v.copy_(v0)
    g.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, (out_n, r, qkv, out_a)):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# timing (printed, never asserted)
# ------------------------------------------------------------------------------------------------
def _host_us(fn, iters: int = 200) -> float:
    """Wall time per call of back-to-back eager calls: what a launch-bound decode step pays."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def _gpu_us(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50) * 1e3


def test_fused_timing_table(capsys):
    _need_cuda()
    from voltllm.kernels import fused as F
    from voltllm.model.layers.activation import silu_and_mul as torch_silu_and_mul
    from voltllm.model.layers.norm import RMSNorm
    from voltllm.model.layers.rotary import RotaryEmbedding

    dev, dt = "cuda", torch.float16
    rows = []
    for name, hidden, hq, hk, d, rd, inter, offset in SHAPES:
        norm = RMSNorm(hidden, 1e-6, offset).to(dev, dt)
        qn, kn = RMSNorm(d, 1e-6, offset).to(dev, dt), RMSNorm(d, 1e-6, offset).to(dev, dt)
        rot = RotaryEmbedding(SimpleNamespace(rope_theta=1e6), d, 65536, rotary_dim=rd).to(dev)
        for t in (1, 4096):
            x = torch.randn(t, hidden, device=dev, dtype=dt)
            r = torch.randn(t, hidden, device=dev, dtype=dt)
            qkv = torch.randn(t, (hq + 2 * hk) * d, device=dev, dtype=dt)
            q = qkv[:, : hq * d].view(t, hq, d)
            k = qkv[:, hq * d: (hq + hk) * d].view(t, hk, d)
            pos = torch.randint(0, 65536, (t,), device=dev)
            gu = torch.randn(t, 2 * inter, device=dev, dtype=dt)
            cases = {
                "rms_norm": (lambda: F.rms_norm(x, norm.weight, 1e-6, offset), lambda: norm(x)),
                "fused_add_rms_norm": (lambda: F.fused_add_rms_norm(x, r, norm.weight, 1e-6, offset),
                                       lambda: norm(x, r)),
                "rope": (lambda: F.rope_inplace(q, k, pos, rot.cos, rot.sin, rd), lambda: rot(pos, q, k)),
                "qk_norm_rope": (lambda: F.qk_norm_rope_inplace(q, k, qn.weight, kn.weight, 1e-6, pos, rot.cos,
                                                                rot.sin, rd, offset),
                                 lambda: rot(pos, qn(q), kn(k))),
                "silu_and_mul": (lambda: F.silu_and_mul(gu), lambda: torch_silu_and_mul(gu)),
            }
            for kname, (fused, ref) in cases.items():
                rows.append((name, t, kname, _host_us(fused), _host_us(ref), _gpu_us(fused), _gpu_us(ref)))
    with capsys.disabled():
        print(f"\nfused vs torch, fp16, {torch.cuda.get_device_name()} (us; host = wall per eager call, "
              f"gpu = triton do_bench)")
        print(f"{'shape':18} {'T':>5} {'kernel':20} {'host fused':>10} {'host torch':>10} "
              f"{'gpu fused':>10} {'gpu torch':>10}")
        for name, t, kname, hf, ht, gf, gt in rows:
            print(f"{name:18} {t:5d} {kname:20} {hf:10.1f} {ht:10.1f} {gf:10.1f} {gt:10.1f}")
