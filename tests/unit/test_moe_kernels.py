"""Triton MoE grouped GEMM (voltllm.kernels.moe) under Triton's CPU interpreter, against the torch reference
(voltllm.model.layers.moe.fused_experts_ref). TRITON_INTERPRET=1 must be set before triton.jit runs, so the
checks run in a subprocess (tests/unit/_moe_interp_check.py), once per module; each check is one test here."""
from __future__ import annotations

from pathlib import Path

import pytest

from interp_util import check_names, registered_kernels, run_interp_checks
import torch

HELPER = Path(__file__).with_name("_moe_interp_check.py")


CHECKS = check_names(HELPER)


@pytest.fixture(scope="module")
def interp_results() -> dict[str, str]:
    return run_interp_checks(HELPER, ('cpu',), timeout=600, shared=True)


@pytest.mark.parametrize("name", CHECKS)
def test_moe_kernel_interp(interp_results, name):
    assert name in interp_results, f"check {name} did not run"
    assert interp_results[name].startswith("ok"), interp_results[name]


def test_kernels_registered_for_compat_gate():
    assert str(registered_kernels("voltllm.kernels.moe", "moe.")) == \
        "['moe.align', 'moe.align_sort', 'moe.down_weighted', 'moe.gate_up_silu']"
    assert str(registered_kernels("voltllm.kernels.moe_decode", "moe.")) == (  # (it imports voltllm.kernels.moe)
        "['moe.align', 'moe.align_sort', 'moe.down_weighted', 'moe.gate_up_silu', 'moe.route_topk', 'moe.small_down', "
        "'moe.small_gate_up']")


def test_picked_tiles_are_the_gated_ones():
    """Every tile pick_config returns, per activation width, is one the sm_70 / sm_75 compile gate compiles (its
    registered specs), and fp32 runs keep their K blocks within FP32_MAX_BLOCK_K (shared memory on sm_75)."""
    from voltllm.kernels.moe import FP32_MAX_BLOCK_K, pick_config
    from voltllm.kernels.registry import REGISTRY

    for kernel in ("moe.gate_up_silu", "moe.down_weighted"):
        gated = {(s.label.split()[0], s.constexprs["BLOCK_M"], s.constexprs["BLOCK_N"], s.constexprs["BLOCK_K"])
                 for s in REGISTRY[kernel].specs}
        for itemsize, act in ((2, "fp16"), (4, "fp32")):
            for pairs, experts in ((8, 256), (512, 256), (4096, 256), (65536, 256), (300, 8), (40000, 512)):
                cfg = pick_config(pairs, experts, itemsize)
                assert (act, cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]) in gated, (kernel, act, pairs, cfg)
                if itemsize == 4:
                    assert cfg["BLOCK_K"] <= FP32_MAX_BLOCK_K


def test_align_bounds_without_interpreter():
    """moe_align is plain torch: the padded length never exceeds its static bound, for any routing."""
    from voltllm.kernels.moe import moe_align

    g = torch.Generator().manual_seed(0)
    for t, e, k, bm in [(1, 512, 10, 16), (3, 4, 4, 64), (100, 64, 8, 16), (257, 8, 2, 64)]:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        sorted_ids, block_expert, num_padded = moe_align(ids, e, bm)
        assert int(num_padded[0]) <= sorted_ids.numel()
        assert block_expert.numel() * bm == sorted_ids.numel()
        assert int((sorted_ids < t * k).sum()) == t * k


def test_cpu_layer_uses_reference():
    from voltllm.model.layers import moe

    m = moe.SparseMoE(16, 4, 2, 8, 0, True, torch.float32)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    x = torch.randn(5, 16)
    w, ids = moe.route(m.gate(x), 2, True)
    torch.testing.assert_close(m(x), moe.fused_experts_ref(x, m.w13, m.w2, w, ids))


def test_fused_shared_expert_only_for_plain_weights():
    """The decode path reads the shared expert's weights itself: only plain unquantized ones without bias."""
    from voltllm.model.layers import moe
    from voltllm.model.layers.linear import Linear

    m = moe.SparseMoE(16, 4, 2, 8, 12, True, torch.float32)
    gate, gate_up, down = m._plain_shared_weights()
    assert gate.shape == (1, 16) and gate_up.shape == (24, 16) and down.shape == (16, 12)
    m.shared_expert_gate = Linear(16, 1, bias=True)
    assert m._plain_shared_weights() is None
    assert moe.SparseMoE(16, 4, 2, 8, 0, True, torch.float32)._plain_shared_weights() is None
