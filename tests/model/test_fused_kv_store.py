"""The attention layers' fused K/V store (voltllm.model.layers.paged_attention): when a backend offers a
CacheWrite, the RoPE step stores the rotated K and V and the backend must not write them again. On the CPU the
rotary layer's torch path performs the store (the Triton kernel's own checks are in tests/unit/
_fused_interp_check.py); here a reference backend that offers the CacheWrite must give exactly the logits and
tokens of one that writes K/V itself: llama (plain RoPE), qwen3 (QK-norm + RoPE) and qwen3_5 (gated attention,
partial RoPE), batched requests, chunked prefill."""
from __future__ import annotations

import pytest
import torch

from tiny_models import make_model
from voltllm import LLM, SamplingParams
from voltllm.attention.backend import CacheWrite
from voltllm.attention.torch_ref import TorchReferenceBackend
from voltllm.kernels.fp8_codec import fp8_format


class FusedStoreBackend(TorchReferenceBackend):
    """The reference backend, offering the model the K/V store (as TRITON_ATTN does for float caches on CUDA)."""

    def __init__(self, kv_cache_dtype="auto"):
        super().__init__(kv_cache_dtype=kv_cache_dtype)
        self.offered = 0
        self.skipped = 0

    def cache_write_for(self, v, kv_cache, meta, k_scale=None, v_scale=None):
        self.offered += 1
        if kv_cache.dtype == torch.uint8:  # an fp8 cache: the codes are encoded in the RoPE step
            return CacheWrite(v, kv_cache, meta.slot_mapping, fp8_format(self.fp8_format), k_scale, v_scale)
        return CacheWrite(v, kv_cache, meta.slot_mapping)

    def forward(self, q, k, v, kv_cache, meta, scale, k_scale=None, v_scale=None, kv_written=False):
        self.skipped += bool(kv_written)
        return super().forward(q, k, v, kv_cache, meta, scale, k_scale, v_scale, kv_written)


def _assert_same(want, got, backend, fused):
    """The fused engine used the store on every offered step and gave the reference's tokens and logprobs."""
    assert backend.offered > 0 and backend.skipped == backend.offered
    for w, o in zip(want, got):
        assert o.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lo in zip(w.outputs[0].logprobs, o.outputs[0].logprobs):
            assert {t: v.logprob for t, v in lw.items()} == {t: v.logprob for t, v in lo.items()}
    fused.engine.check_integrity()


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_5"])
def test_fused_store_equals_backend_write(tmp_path, kind):
    kw = dict(device="cpu", max_model_len=512, max_num_batched_tokens=64, skip_tokenizer_init=True)
    if kind == "qwen3_5":  # hybrid: the gated attention layers
        from tiny_models import make_tiny_hybrid

        path = make_tiny_hybrid(str(tmp_path), kind, 800, 801)
        if path is None:
            pytest.skip("qwen3_5 not in this transformers")
        kw["mamba_cache_mode"] = "none"
    else:
        path = make_model(str(tmp_path), kind, seed=3)
    ref, fused = LLM(path, **kw), LLM(path, **kw)
    backend = FusedStoreBackend()
    fused.engine.runner.backend = backend
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 190, (n,), generator=g).tolist()} for n in (90, 7, 33)]
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    want = ref.generate(prompts, p)
    got = fused.generate(prompts, p)
    _assert_same(want, got, backend, fused)


@pytest.mark.parametrize("kind,calc", [("llama", False), ("qwen3", True)])
def test_fused_fp8_store_equals_backend_write(tmp_path, kind, calc):
    """fp8_e4m3 caches: the RoPE step encodes K / V with the layer's scales (CacheWrite.fmt); the logits equal those
    of an engine whose backend encodes them. With --calculate-kv-scales the first forward is not offered the store
    (its scales come from that forward's K / V) and every later one is."""
    kw = dict(device="cpu", max_model_len=512, max_num_batched_tokens=64, skip_tokenizer_init=True,
              kv_cache_dtype="fp8_e4m3", calculate_kv_scales=calc)
    path = make_model(str(tmp_path), kind, seed=5)
    ref, fused = LLM(path, **kw), LLM(path, **kw)
    backend = FusedStoreBackend("fp8_e4m3")
    fused.engine.runner.backend = backend
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 190, (n,), generator=g).tolist()} for n in (70, 9)]
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    want = ref.generate(prompts, p)
    got = fused.generate(prompts, p)
    _assert_same(want, got, backend, fused)
