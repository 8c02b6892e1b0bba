"""Fused elementwise Triton kernels (voltllm.kernels.fused: RMSNorm + residual, per-head QK-norm, RoPE,
QK-norm + RoPE, SiLU-and-mul) under Triton's CPU interpreter, against their torch references.
TRITON_INTERPRET=1 must be set before triton.jit runs, so the checks run in a subprocess
(tests/unit/_fused_interp_check.py), once per module; each check is one test here."""
from __future__ import annotations

from pathlib import Path

import pytest

from interp_util import check_names, run_interp_checks
import torch

HELPER = Path(__file__).with_name("_fused_interp_check.py")
KERNELS = ("fused.qk_norm_rope", "fused.rms_norm", "fused.sigmoid_gate_mul", "fused.silu_and_mul")




CHECKS = check_names(HELPER)


@pytest.fixture(scope="module")
def interp_results() -> dict[str, str]:
    return run_interp_checks(HELPER, ('cpu',), timeout=600, shared=True)


@pytest.mark.parametrize("name", CHECKS)
def test_fused_kernel_interp(interp_results, name):
    assert name in interp_results, f"check {name} did not run"
    assert interp_results[name].startswith("ok"), interp_results[name]


def test_every_check_listed(interp_results):
    assert sorted(interp_results) == sorted(CHECKS)


def test_fused_kernels_registered_for_compat_gate():
    pytest.importorskip("triton")
    import voltllm.kernels.fused  # noqa: F401  (registers)
    from voltllm.kernels.registry import REGISTRY

    for name in KERNELS:
        entry = REGISTRY[name]
        assert entry.compat and entry.specs
        labels = {spec.label for spec in entry.specs}
        assert len(labels) == len(entry.specs)
        for spec in entry.specs:
            assert set(spec.signature) == set(entry.fn.arg_names), spec.label
            assert not any("bf16" in ty or "fp8" in ty for ty in spec.signature.values()), spec.label
            assert {k for k, v in spec.signature.items() if v == "constexpr"} == set(spec.constexprs), spec.label
        assert {spec.label.split()[0] for spec in entry.specs} == {"fp16", "fp32"}


def test_wrappers_reject_bad_arguments():
    """Argument checks run before any launch (so no GPU or interpreter is needed here)."""
    pytest.importorskip("triton")
    from voltllm.kernels import fused as F

    q, k = torch.zeros(2, 4, 64), torch.zeros(2, 2, 64)
    cos = sin = torch.zeros(16, 32)
    pos = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="rotary_dim"):
        F.rope_inplace(q, k, pos, cos, sin, 63)
    with pytest.raises(ValueError, match="rotary_dim"):
        F.rope_inplace(q, k, pos, cos, sin, 128)
    with pytest.raises(ValueError, match="positions"):
        F.rope_inplace(q, k, pos[:1], cos, sin, 64)
    with pytest.raises(ValueError, match="cos/sin"):
        F.rope_inplace(q, k, pos, cos[:, :8], sin[:, :8], 64)
    with pytest.raises(ValueError, match="contiguous"):
        F.rope_inplace(q.transpose(1, 2).contiguous().transpose(1, 2), k, pos, cos, sin, 64)
    with pytest.raises(ValueError, match="head_dim"):
        F.qk_norm_rope_inplace(q, k, torch.ones(32), torch.ones(64), 1e-6, pos, cos, sin, 64)
    with pytest.raises(ValueError, match="sigmoid_gate_mul"):
        F.sigmoid_gate_mul(q, q.half())
    with pytest.raises(ValueError, match="sigmoid_gate_mul"):
        F.sigmoid_gate_mul(q, k)
    x = torch.zeros(3, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="in place"):
        F.fused_add_rms_norm(x, torch.zeros(3, 8, dtype=torch.float16), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="differ"):
        F.fused_add_rms_norm(x, torch.zeros(3, 9), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        F.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="rms_norm_heads"):
        F.rms_norm_heads(x, torch.ones(8), 1e-6)


def test_references_equal_the_model_layers():
    """The *_ref functions the kernels are checked against compute what voltllm.model.layers compute."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from voltllm.kernels import fused as F
    from voltllm.model.layers.activation import silu_and_mul
    from voltllm.model.layers.norm import RMSNorm
    from voltllm.model.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16):
        for offset in (0.0, 1.0):
            layer = RMSNorm(96, 1e-5, offset).to(dtype)
            with torch.no_grad():
                layer.weight.normal_()
            x, r = torch.randn(5, 96).to(dtype), torch.randn(5, 96).to(dtype)
            assert torch.equal(F.rms_norm_ref(x, layer.weight, 1e-5, offset), layer(x))
            want_out, want_res = layer(x, r)
            r2 = r.clone()
            got_out, got_res = F.fused_add_rms_norm_ref(x, r2, layer.weight, 1e-5, offset)
            assert torch.equal(got_out, want_out) and torch.equal(got_res, want_res) and got_res is r2
        gu = torch.randn(3, 40).to(dtype)
        assert torch.equal(F.silu_and_mul_ref(gu), silu_and_mul(gu))
        for rd in (64, 16):
            rot = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), 64, 128, rotary_dim=rd)
            q, k = torch.randn(4, 3, 64).to(dtype), torch.randn(4, 1, 64).to(dtype)
            pos = torch.tensor([0, 5, 127, 9])
            want_q, want_k = rot(pos, q, k)
            got_q, got_k = F.rope_inplace_ref(q.clone(), k.clone(), pos, rot.cos, rot.sin, rd)
            assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_cache_write_argument_checks():
    pytest.importorskip("triton")
    from voltllm.attention.backend import CacheWrite
    from voltllm.kernels import fused as F

    q, k = torch.zeros(2, 4, 64), torch.zeros(2, 2, 64)
    cos = sin = torch.zeros(16, 32)
    pos = torch.zeros(2, dtype=torch.long)
    cache = torch.zeros(2, 3, 4, 2, 64)
    slots = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="cache_write.v"):
        F.rope_inplace(q, k, pos, cos, sin, 64, CacheWrite(torch.zeros(2, 1, 64), cache, slots))
    with pytest.raises(ValueError, match="kv_cache"):
        F.rope_inplace(q, k, pos, cos, sin, 64, CacheWrite(torch.zeros(2, 2, 64), cache[:, :, :, :1], slots))
    with pytest.raises(ValueError, match="float cache"):
        F.rope_inplace(q, k, pos, cos, sin, 64, CacheWrite(torch.zeros(2, 2, 64), cache.to(torch.uint8), slots))
    with pytest.raises(ValueError, match="slot_mapping"):
        F.rope_inplace(q, k, pos, cos, sin, 64, CacheWrite(torch.zeros(2, 2, 64), cache, slots.int()))


def test_rotary_cache_write_and_backend_contract():
    """Backends offer the fused K/V store only for float caches on CUDA (never the torch reference, never fp8
    caches); the rotary layer's torch path honours a CacheWrite with the reference write; forward(kv_written=
    True) leaves the cache alone."""
    from types import SimpleNamespace

    from voltllm.attention.backend import AttentionMetadata, CacheWrite
    from voltllm.attention.torch_ref import TorchReferenceBackend, write_kv
    from voltllm.attention.triton_backend import TritonAttentionBackend
    from voltllm.model.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    t, hk, d, page = 3, 2, 16, 4
    q, k, v = torch.randn(t, 4, d), torch.randn(t, hk, d), torch.randn(t, hk, d)
    slots = torch.tensor([5, -1, 2])
    meta = AttentionMetadata(num_tokens=t, query_start_loc=torch.tensor([0, t], dtype=torch.int32),
                             seq_lens=torch.tensor([t], dtype=torch.int32), block_tables=torch.tensor([[0, 1]]),
                             slot_mapping=slots, max_query_len=t, max_seq_len=t, query_start_loc_cpu=[0, t],
                             seq_lens_cpu=[t])
    cache = torch.zeros(2, 2, page, hk, d)
    assert TorchReferenceBackend().cache_write_for(v, cache, meta) is None
    assert TritonAttentionBackend().cache_write_for(v, cache, meta) is None  # a CPU cache
    assert TritonAttentionBackend(kv_cache_dtype="fp8").cache_write_for(v, cache.to(torch.uint8), meta) is None

    rot = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), d, 64)
    pos = torch.tensor([0, 1, 2])
    want_q, want_k = rot(pos, q.clone(), k.clone())
    want = torch.zeros_like(cache)
    write_kv(want_k, v, want, slots)
    got_q, got_k = rot(pos, q.clone(), k.clone(), cache_write=CacheWrite(v, cache, slots))
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k) and torch.equal(cache, want)

    before = torch.full_like(cache, 7.0)
    TorchReferenceBackend().forward(q, k, v, before, meta, d ** -0.5, kv_written=True)
    assert bool((before == 7.0).all())
