"""Sparse MoE layers under tensor parallelism, without processes: every rank holds each expert's (and the shared
expert's) share of the intermediate rows, so the ranks' outputs before the all-reduce must add up to the whole
layer's output. Checked for both checkpoint layouts (per-expert tensors; transformers' stacked experts.gate_up_proj /
experts.down_proj, also [E, in, out]) and for packed weights cut lazily."""
import pytest
import torch

from voltllm.model.layers.moe import SparseMoE

H, E, K, I, IS = 32, 4, 2, 24, 16  # noqa: E741 (hidden, experts, top-k, intermediate, shared)
H2 = 64  # the quantized cases' hidden size (Q8_0 rows: whole 32-input blocks)


class _Rank:
    """A stand-in TP group: the all-reduce is left to the test (it adds the ranks' outputs itself)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def all_reduce_(self, x):
        return x


def _weights(seed: int, stacked: bool, transposed: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.3

    w = {"gate.weight": rnd(E, H), "shared_expert_gate.weight": rnd(1, H),
         "shared_expert.gate_proj.weight": rnd(IS, H), "shared_expert.up_proj.weight": rnd(IS, H),
         "shared_expert.down_proj.weight": rnd(H, IS)}
    gate, up, down = rnd(E, I, H), rnd(E, I, H), rnd(E, H, I)
    if stacked:
        gate_up = torch.cat([gate, up], dim=1)
        w["experts.gate_up_proj"] = gate_up.transpose(1, 2).contiguous() if transposed else gate_up
        w["experts.down_proj"] = down.transpose(1, 2).contiguous() if transposed else down
    else:
        for e in range(E):
            w[f"experts.{e}.gate_proj.weight"], w[f"experts.{e}.up_proj.weight"] = gate[e], up[e]
            w[f"experts.{e}.down_proj.weight"] = down[e]
    return w


def _layer(weights: dict, tp=None) -> SparseMoE:
    moe = SparseMoE(H, E, K, I, IS, True, torch.float32, tp=tp)
    loaded = set()
    for name, t in weights.items():
        loaded.update(moe.load_hf_weight(name, t.clone(), "mlp."))
    assert loaded == moe.expected_weight_keys("mlp.")
    return moe


@pytest.mark.parametrize("layout", ["per-expert", "stacked", "stacked-transposed"])
@pytest.mark.parametrize("size", [2, 4])
def test_ranks_partials_add_up_to_the_whole_layer(layout, size):
    weights = _weights(0, layout != "per-expert", layout == "stacked-transposed")
    whole = _layer(weights)
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(1))
    parts = [_layer(weights, _Rank(r, size)) for r in range(size)]
    for r, part in enumerate(parts):  # each rank: its share of every expert's rows
        n = I // size
        assert part.inter == n and part.w13.shape == (E, 2 * n, H) and part.w2.shape == (E, H, n)
        assert torch.equal(part.w13[:, :n], whole.w13[:, r * n:(r + 1) * n])
        assert torch.equal(part.w13[:, n:], whole.w13[:, I + r * n:I + (r + 1) * n])
        assert torch.equal(part.w2, whole.w2[:, :, r * n:(r + 1) * n])
        assert part.shared_expert.down_proj.in_features == IS // size
    with torch.no_grad():
        ref = whole(x)
        total = sum(part(x) for part in parts)
    assert torch.allclose(total, ref, atol=1e-5, rtol=0), (total - ref).abs().max()


def test_stacked_tensor_of_the_wrong_shape_is_named():
    weights = _weights(0, True)
    moe = SparseMoE(H, E, K, I, IS, True, torch.float32, tp=_Rank(0, 2))
    with pytest.raises(ValueError, match=r"experts.down_proj: shape \(4, 32, 12\), expected \(4, 32, 24\)"):
        moe.load_hf_weight("experts.down_proj", weights["experts.down_proj"][:, :, :12], "mlp.")


def _q8_experts(seed: int, inter: int) -> dict:
    """Per-expert Q8_0 GGUF blocks (gate / up [inter, H2], down [H2, inter]) and a dense router."""
    from voltllm.model.layers.gguf_planes import random_blocks
    from voltllm.model.layers.quantized_linear import GGUFBlocks

    g = torch.Generator().manual_seed(seed)
    w = {"gate.weight": torch.randn(E, H2, generator=g) * 0.3}
    for e in range(E):
        for kind, (n, k) in (("gate", (inter, H2)), ("up", (inter, H2)), ("down", (H2, inter))):
            w[f"experts.{e}.{kind}_proj.weight"] = GGUFBlocks("Q8_0", random_blocks("Q8_0", n, k, g), n, k)
    return w


def _quant_layer(weights: dict, inter: int, tp=None) -> SparseMoE:
    moe = SparseMoE(H2, E, K, inter, 0, True, torch.float32, quantized_experts=True, tp=tp)
    for name, t in weights.items():
        moe.load_hf_weight(name, t, "layers.0.mlp.")
    return moe


def test_quantized_experts_cut_by_rank():
    """Experts kept quantized: each rank's planes hold its rows / input columns; the partials add up."""
    weights = _q8_experts(2, 128)
    whole = _quant_layer(weights, 128)
    parts = [_quant_layer(weights, 128, _Rank(r, 2)) for r in range(2)]
    assert whole.qexperts.ready and all(p.qexperts.ready and p.qexperts.w2.k == 64 for p in parts)
    x = torch.randn(5, H2, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref, total = whole(x), sum(p(x) for p in parts)
    assert torch.allclose(total, ref, atol=1e-4, rtol=1e-4), (total - ref).abs().max()


def test_misaligned_quantized_expert_cut_is_an_error_not_a_dense_fallback():
    """A rank's share that splits a quantized group fails the load naming the layer (as a dense layer's cut does),
    instead of silently holding every expert dense (a 30B-A3B's experts would need ~61 GB)."""
    from voltllm.model.layers.quantized_linear import MisalignedCut

    with pytest.raises(MisalignedCut, match=r"layers\.0\.mlp\.experts\.0\.down_proj\.weight: .*multiples of 64"):
        _quant_layer(_q8_experts(2, 128), 128, _Rank(1, 4))  # 32 inputs per rank
