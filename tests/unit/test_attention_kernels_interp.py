"""Triton attention kernels (kv_write, paged decode with split-KV, paged prefill) and the TRITON_ATTN
backend under Triton's CPU interpreter, against voltllm.attention.torch_ref.

TRITON_INTERPRET=1 must be set before triton.jit decorates the kernels, so the checks run in a
subprocess (tests/unit/_attention_interp_check.py), once per session; each check is one test here.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from interp_util import run_interp_checks

HELPER = Path(__file__).with_name("_attention_interp_check.py")
CHECKS = [
    "prefill_f32_d64_gqa4_mixed",
    "prefill_f32_d64_gqa4_tile32",
    "prefill_f16_d128_mha_prefix",
    "prefill_f32_d64_query_len1",
    "decode_f32_d64_gqa4_nosplit_dot",
    "decode_f32_d64_gqa4_split5_fma",
    "decode_f32_d64_gqa4_split16_dot_empty_parts",
    "decode_f16_d128_mha_split3_fma",
    "decode_f16_d128_gqa4_split4_dot",
    "decode_f32_d80_gqa3_split2_fma",
    "decode_f32_d64_page32_tile16_split3",
    "decode_f32_d64_gqa4_split5_lanes",
    "decode_f16_d128_mha_split16_lanes_empty_parts",
    "decode_f32_d64_gqa4_split3_dot_early_tile",
    "decode_f16_d128_gqa4_nosplit_fma_early_tile",
    "decode_f32_d64_gqa4_split3_lanes_next_tile",
    "decode_f16_d128_gqa4_nosplit_lanes_next_tile",
    "decode_rope_norm_f32_d64_gqa4_split5_dot",
    "decode_rope_f16_d128_gqa4_nosplit_fma",
    "decode_rope_norm_f16_d128_split3_lanes",
    "kv_write_strided_inputs",
    "backend_decode_split_padded",
    "backend_decode_lanes_half_tile",
    "backend_decode_fma_rows",
    "prefill_f32_d64_skips_one_row_sequences",
    "backend_mixed_long_decode_rows_split",
    "backend_mixed_prefill_padded",
    *[f"prefill_f32_d64_gqa4_window{w}" for w in (1, 20, 48, 200)],
    *[f"decode_f32_d64_gqa4_split{s}_{r}_window" for r in ("dot", "fma", "lanes", "lanes_next_tile") for s in (1, 5)],
    "decode_f16_d128_gqa4_split3_dot_window_by_context",
    "decode_rope_f16_d128_gqa4_split2_fma_window",
    *[f"backend_{b}_{c}" for b in ("native", "compat")
      for c in ("mixed_window", "equal_run_window", "decode_window_positions")],
]


@pytest.fixture(scope="module")
def interp_results() -> dict[str, str]:
    return run_interp_checks(HELPER, (), timeout=300, shared=True)


@pytest.mark.parametrize("name", CHECKS)
def test_attention_kernel_interp(interp_results, name):
    assert name in interp_results, f"check {name} did not run"
    assert interp_results[name].startswith("ok"), interp_results[name]


def test_every_check_listed(interp_results):
    assert sorted(interp_results) == sorted(CHECKS)


def test_attention_kernels_registered():
    from voltllm.kernels.registry import REGISTRY
    import voltllm.kernels.attention  # noqa: F401  (registers)
    for name in ("attention.kv_write", "attention.paged_decode", "attention.paged_decode_reduce",
                 "attention.paged_prefill"):
        entry = REGISTRY[name]
        assert entry.specs and entry.compat == (name != "attention.paged_prefill")  # (the compat route: SDPA)
        dims = {spec.constexprs.get("HEAD_DIM") for spec in entry.specs}
        assert dims == {64, 128, 256}
        for spec in entry.specs:
            assert set(spec.signature) == set(entry.fn.arg_names)


def test_grown_split_scratch_stays_alive_for_earlier_graphs():
    """A larger reservation (a hybrid's verification graphs after its decode graphs) replaces the split-KV scratch;
    the old one stays referenced, since graphs captured on it still use it on replay (freed, the H200 hit an
    illegal address there: tests/gpu/test_hybrid_spec_cuda.py::test_prefix_cache_snapshots)."""
    import torch

    from voltllm.attention.triton_backend import TritonAttentionBackend

    backend, cpu = TritonAttentionBackend(num_sms=132), torch.device("cpu")
    backend.reserve(4, 32, 8, 128, 4096, cpu)
    first = backend._get_scratch(cpu, 1, 1)
    backend.reserve(96, 32, 8, 128, 4096, cpu)
    grown = backend._get_scratch(cpu, 1, 1)
    assert grown[0].numel() > first[0].numel()
    assert any(o is first[0] and lse is first[1] for o, lse in backend._retired_scratch)
    backend.reserve(8, 32, 8, 128, 4096, cpu)  # smaller: the grown scratch serves it
    assert backend._get_scratch(cpu, 1, 1)[0] is grown[0]


def test_num_splits_heuristic():
    from voltllm.kernels.attention import choose_num_splits
    assert choose_num_splits(1, 8, 32768, 132) > 16      # one long sequence: split to fill 132 SMs
    assert choose_num_splits(64, 8, 1024, 132) == 1      # 512 programs already fill the GPU
    assert choose_num_splits(1, 8, 100, 132) == 1        # short context: nothing to split
    assert choose_num_splits(2, 8, 1 << 20, 132) <= 64   # capped


def test_prefill_config_valid():
    from voltllm.kernels.attention import prefill_config
    for cap in (None, (7, 0), (7, 5), (8, 0), (9, 0)):
        for d in (64, 80, 128, 256):
            for group in (1, 2, 4, 8, 16):
                for mql in (1, 3, 17, 4096):
                    bm, bn, warps, stages = prefill_config(d, group, mql, cap)
                    assert bm >= 16 and bm >= group and bm & (bm - 1) == 0, (cap, d, group, mql, bm)
                    assert bn >= 16 and bn & (bn - 1) == 0 and warps in (4, 8) and stages >= 1
    assert prefill_config(256, 4, 4096, (9, 0)) == (128, 32, 8, 2)
    assert prefill_config(128, 4, 4096, (9, 0)) == (128, 128, 8, 3)
    assert prefill_config(128, 4, 128, (9, 0)) == (64, 32, 4, 2)  # short prompts: the small tile
    assert prefill_config(128, 4, 128, (8, 0)) == (128, 64, 8, 3)
    assert prefill_config(64, 4, 4096, (9, 0)) == (128, 64, 8, 3)
