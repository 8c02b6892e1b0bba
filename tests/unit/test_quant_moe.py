"""A SparseMoE whose experts stay quantized (model/layers/quant_moe.py), on the CPU: planes stacked by expert with
the dense experts' outputs; a part that cannot stay quantized (mixed kinds in one stacked weight, a dense tensor)
moves the layer's experts to dense weights, parts received before included."""
import pytest
import torch

from voltllm.model.layers.gguf_planes import dequantize_planes, planes_from_blocks, random_blocks
from voltllm.model.layers.moe import SparseMoE
from voltllm.model.layers.quantized_linear import GGUFBlocks

E, H, I, K = 4, 64, 64, 2


def _blocks(kind: str, rows: int, cols: int, seed: int) -> GGUFBlocks:
    return GGUFBlocks(kind, random_blocks(kind, rows, cols, torch.Generator().manual_seed(seed)), rows, cols)


def _load(moe: SparseMoE, kinds: dict, dense_at=None) -> SparseMoE:
    """Router plus every expert's projections (kinds[proj]; (expert, proj) == dense_at arrives dense)."""
    moe.load_hf_weight("gate.weight", torch.randn(E, H, generator=torch.Generator().manual_seed(9)))
    for e in range(E):
        for n, (proj, rows, cols) in enumerate((("gate", I, H), ("up", I, H), ("down", H, I))):
            kind = kinds[proj] if isinstance(kinds[proj], str) else kinds[proj][e]
            w = _blocks(kind, rows, cols, 10 * e + n)
            if (e, proj) == dense_at:
                w = dequantize_planes(planes_from_blocks(w.raw, kind, cols))
            moe.load_hf_weight(f"experts.{e}.{proj}_proj.weight", w)
    return moe


def _dense_twin(moe_kinds: dict, dense_at=None) -> SparseMoE:
    twin = SparseMoE(H, E, K, I, 0, True, torch.float32)
    src = _load(SparseMoE(H, E, K, I, 0, True, torch.float32), moe_kinds, dense_at)  # dequantized on load
    twin.load_state_dict(src.state_dict())
    return twin


@pytest.mark.parametrize("kinds,dense_at,kept", [
    ({"gate": "Q4_0", "up": "Q4_0", "down": "Q8_0"}, None, True),  # one kind per stacked weight
    ({"gate": ["Q4_0", "Q8_0", "Q4_0", "Q4_0"], "up": "Q4_0", "down": "Q4_0"}, None, False),  # mixed gate / up
    ({"gate": "Q4_0", "up": "Q4_0", "down": "Q4_0"}, (2, "up"), False),  # a dense part midway
])
def test_quantized_experts(kinds, dense_at, kept):
    moe = _load(SparseMoE(H, E, K, I, 0, True, torch.float32, quantized_experts=True), kinds, dense_at)
    assert (moe.qexperts is not None and moe.qexperts.ready and moe.w13 is None) == kept
    assert kept or (moe.qexperts is None and moe.w13 is not None)
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(moe(x), _dense_twin(kinds, dense_at)(x), rtol=1e-5, atol=1e-5)
    if kept:
        q = moe.qexperts
        assert (q.w13.n, q.w2.n) == (E * 2 * I, E * H) and q.w13.kind.name == "Q4_0" and q.w2.kind.name == "Q8_0"


def test_used_before_loaded():
    moe = SparseMoE(H, E, K, I, 0, True, torch.float32, quantized_experts=True)
    moe.load_hf_weight("gate.weight", torch.randn(E, H))
    with pytest.raises(RuntimeError, match="before all of them"):
        moe(torch.randn(2, H))
