"""FP8 (E4M3 / E5M2) KV cache on the CPU: the dtype spec and config, checkpoint scale names, the reference
backend with scales, backend selection, and the Triton kernels / backend routes (native and compat: bridge +
SDPA prefill) under the Triton interpreter (subprocess: tests/unit/_fp8_kv_interp_check.py).
The engine end to end (capacity, agreement, checkpoint scales) is in tests/model/test_fp8_kv_engine.py.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from interp_util import run_interp_checks
import torch

from tiny_models import make_model
from voltllm.attention.backend import AttentionMetadata
from voltllm.attention.kv_spec import kv_cache_dtype_error, kv_cache_spec, kv_scale_target
from voltllm.attention.torch_ref import TorchReferenceBackend
from voltllm.config import ConfigError, EngineArgs

HELPER = Path(__file__).with_name("_fp8_kv_interp_check.py")
INTERP_CHECKS = [
    "decode_e4m3_f32_dot_split5", "decode_e4m3_f16_dot_split4_d128", "decode_e4m3_f16_fma_nosplit",
    "decode_e5m2_f32_fma_split3", "decode_e5m2_f16_lanes_split16", "decode_e4m3_f16_lanes_next_tile_split2",
    "decode_e4m3_f32_d80_gqa3_fma",
    "decode_rope_norm_e4m3_f32_dot_split3", "decode_rope_e5m2_f32_d128_fma",
    "prefill_e4m3_f32_mixed", "prefill_e5m2_f16_mha_prefix",
    "backend_native_decode_e4m3_padded", "backend_native_prefill_e4m3_f16",
    "backend_compat_decode_e5m2_split", "backend_compat_prefill_e4m3_mixed_f16",
    "backend_compat_prefill_e5m2_mha_f32", "backend_compat_prefill_fp16_cache",
    "write_e4m3_f16_strided", "write_e5m2_f32_strided", "bridge_e4m3_f16", "bridge_e5m2_f32", "bridge_fp16_cache",
    "compat_workspace_reused", "bridge_batch_e4m3", "bridge_batch_fp16_cache", "compat_equal_runs_e4m3",
    "bridge_varlen_e4m3", "bridge_varlen_fp16_cache", "compat_varlen_e4m3", "gather_fp8_launcher_e5m2",
    "compat_warm_up_mixed_step",
    "backend_native_mixed_e4m3_window", "backend_compat_mixed_e5m2_window", "prefill_e4m3_f16_window",
    "decode_e4m3_f32_lanes_split3_window",
]


# --- Triton kernels under the interpreter ---------------------------------------------------------------
@pytest.fixture(scope="module")
def interp_results() -> dict[str, str]:
    return run_interp_checks(HELPER, (), timeout=600, shared=True)


@pytest.mark.parametrize("name", INTERP_CHECKS)
def test_fp8_kernel_interp(interp_results, name):
    assert name in interp_results, f"check {name} did not run"
    assert interp_results[name].startswith("ok"), interp_results[name]


def test_every_interp_check_listed(interp_results):
    assert sorted(interp_results) == sorted(INTERP_CHECKS)


def test_fp8_kernel_specs_registered():
    from voltllm.kernels.registry import REGISTRY
    import voltllm.kernels.attention  # noqa: F401  (registers)
    import voltllm.kernels.kv_fp8  # noqa: F401
    for name in ("attention.paged_decode", "attention.paged_prefill"):
        entry = REGISTRY[name]
        fmts = {spec.constexprs["KV_FMT"] for spec in entry.specs}
        assert fmts == {-1, 0, 1}, (name, fmts)
        for spec in entry.specs:
            assert set(spec.signature) == set(entry.fn.arg_names)
            assert (spec.signature["KV"] == "*u8") == (spec.constexprs["KV_FMT"] >= 0)
            assert not any("bf16" in t or "fp8" in t for t in spec.signature.values())
    gather = {s.constexprs["FMT"] for s in REGISTRY["fp8.kv_gather"].specs}
    assert -1 in gather and 0 in gather  # the compat bridge for fp16 and fp8 caches


# --- spec, config, capacity -----------------------------------------------------------------------------
def test_kv_spec():
    for name, fmt in (("fp8", "e4m3"), ("fp8_e4m3", "e4m3"), ("fp8_e5m2", "e5m2")):
        spec = kv_cache_spec(name, torch.float16)
        assert spec.storage_dtype == torch.uint8 and spec.element_size == 1 and spec.fp8_format == fmt
        assert spec.is_fp8 and spec.name == f"fp8_{fmt}" and spec.fmt == (0 if fmt == "e4m3" else 1)
    auto = kv_cache_spec("auto", torch.bfloat16)
    assert auto.storage_dtype == torch.bfloat16 and auto.element_size == 2 and not auto.is_fp8 and auto.fmt == -1
    assert kv_cache_spec("float16", torch.float16).storage_dtype == torch.float16
    assert "fp8_e4m3" in kv_cache_dtype_error("int4", torch.float16)
    assert "model dtype" in kv_cache_dtype_error("float16", torch.float32)
    # a route without bf16: the error says so and names the fix, rather than "differs from the model dtype"
    err = kv_cache_dtype_error("bfloat16", torch.float16, "the sm70 route")
    assert err.startswith("--kv-cache-dtype bfloat16: the sm70 route has no bf16") and "use auto" in err
    assert kv_cache_dtype_error("float16", torch.float16, "the sm70 route") is None
    with pytest.raises(ValueError):
        kv_cache_spec("fp4", torch.float16)


def test_kv_scale_checkpoint_names():
    assert kv_scale_target("layers.3.self_attn.k_scale") == ("layers.3.self_attn", ("k_scale",))
    assert kv_scale_target("layers.3.self_attn.k_proj.k_scale") == ("layers.3.self_attn", ("k_scale",))
    assert kv_scale_target("layers.0.self_attn.v_proj.v_scale") == ("layers.0.self_attn", ("v_scale",))
    assert kv_scale_target("layers.0.self_attn.attn.v_scale") == ("layers.0.self_attn", ("v_scale",))
    assert kv_scale_target("layers.1.self_attn.kv_scale") == ("layers.1.self_attn", ("k_scale", "v_scale"))
    for other in ("layers.1.self_attn.k_proj.weight", "layers.1.self_attn.k_proj.weight_scale",
                  "layers.1.self_attn.k_proj.input_scale", "layers.1.mlp.k_scale"):
        assert kv_scale_target(other) is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny_fp8")), "qwen3", max_position_embeddings=1024)


@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_config_accepts_fp8(tiny, value):
    cfg = EngineArgs(model=tiny, device="cpu", kv_cache_dtype=value).create_engine_config()
    assert cfg.cache.kv_cache_dtype == value


def test_config_rejects_unknown_kv_dtype(tiny):
    with pytest.raises(ConfigError, match="kv-cache-dtype"):
        EngineArgs(model=tiny, device="cpu", kv_cache_dtype="fp4").create_engine_config()
    with pytest.raises(ConfigError, match="model dtype"):
        EngineArgs(model=tiny, device="cpu", dtype="float32", kv_cache_dtype="float16").create_engine_config()


def test_runner_selects_backend_with_kv_dtype(tiny):
    from voltllm.attention.triton_backend import TritonAttentionBackend
    from voltllm.worker.runner import select_attention_backend
    cfg = EngineArgs(model=tiny, device="cpu", kv_cache_dtype="fp8_e5m2", max_model_len=512).create_engine_config()
    ref = select_attention_backend(cfg)
    assert isinstance(ref, TorchReferenceBackend) and ref.fp8_format == "e5m2"
    gpu = dataclasses.replace(cfg, device=dataclasses.replace(cfg.device, device=torch.device("cuda"), compat="sm70"))
    be = select_attention_backend(gpu)
    assert isinstance(be, TritonAttentionBackend) and be.kv_fmt == 1 and be.use_tensor_cores is False
    assert be.sdpa_prefill.max_context == 512
    routes = be.routes(torch.device("cuda"))
    assert "SDPA" in routes["prefill"] and "FMA" in routes["decode"] and "fp8_e5m2" in routes["kv_cache"]


def test_backend_applies_scales():
    """TorchReferenceBackend with a scale s on the same K/V equals the unscaled one on K/s, V/s times s."""
    from voltllm.kernels.fp8_codec import decode_e4m3, encode_e4m3
    torch.manual_seed(0)
    q, k, v = torch.randn(5, 4, 16), torch.randn(5, 2, 16) * 8, torch.randn(5, 2, 16) * 8
    meta = AttentionMetadata(num_tokens=5, query_start_loc=torch.tensor([0, 5], dtype=torch.int32),
                             seq_lens=torch.tensor([5], dtype=torch.int32), block_tables=torch.tensor([[0]], dtype=torch.int32),
                             slot_mapping=torch.arange(5), max_query_len=5, max_seq_len=5, query_start_loc_cpu=[0, 5],
                             seq_lens_cpu=[5])
    be = TorchReferenceBackend(kv_cache_dtype="fp8_e4m3")
    cache = torch.zeros(2, 1, 8, 2, 16, dtype=torch.uint8)
    ks, vs = torch.tensor(4.0), torch.tensor(2.0)
    out = be.forward(q, k, v, cache, meta, 0.25, k_scale=ks, v_scale=vs)
    assert torch.equal(cache[0, 0, :5], encode_e4m3(k / 4.0)) and torch.equal(cache[1, 0, :5], encode_e4m3(v / 2.0))
    from voltllm.attention.torch_ref import attend_one
    want = attend_one(q, decode_e4m3(cache[0, 0, :5]) * 4.0, decode_e4m3(cache[1, 0, :5]) * 2.0, 0.25)
    assert torch.allclose(out, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="fp8"):
        TorchReferenceBackend().forward(q, k, v, cache.clone(), meta, 0.25)
