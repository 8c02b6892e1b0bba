"""Tensor-parallel shards of weights kept quantized (distributed/sharding.py, PackedWeight.cut, gguf_planes.col_band /
row_shard): each shard's planes dequantize to exactly the same slice of the whole dequantized matrix, for GGUF,
int4 (AWQ / GPTQ), FP8, NVFP4, bitsandbytes NF4 / FP4 and 8-bit kinds; padded vocabulary rows are zeros; a cut across a
block is an error that names the layer, the kind and the multiple."""
from __future__ import annotations

import pytest
import torch

from voltllm.distributed.sharding import take_cols, take_rows
from voltllm.model.layers.gguf_planes import (FP8_KIND, KINDS, NVFP4_KIND, Planes, Unpacked, col_band,
                                              column_multiple, dequantize_planes, int4_kind, random_blocks, row_shard,
                                              to_planes)
from voltllm.model.layers.quantized_linear import GGUFBlocks, PackedSlice, PackedWeight, split_rows


def _finite_e4m3(g, shape) -> torch.Tensor:
    c = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    return torch.where((c & 0x7F) == 0x7F, c - 1, c)  # (0x7F / 0xFF are NaN)


def _bnb8(n: int, k: int, g: torch.Generator):
    from voltllm.model.loader.bnb_checkpoint import Bnb8bitWeight
    from voltllm.model.loader.bnb_codec import quantize_int8

    return Bnb8bitWeight(*quantize_int8(torch.randn(n, k, generator=g) * 0.05))


def _planes(name: str, n: int, k: int, seed: int = 0) -> Planes:
    g = torch.Generator().manual_seed(seed)
    if name in KINDS:
        return GGUFBlocks(name, random_blocks(name, n, k, g), n, k).to_weight(None, torch.float32)
    if name.startswith("INT4"):
        group = int(name.split("_")[1][1:])
        zp = name.endswith("_ZP")
        kind = int4_kind(group, zero_points=zp)
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        d = (torch.rand(n, k // group, generator=g) * 0.1).to(torch.float16)
        mn = torch.randint(0, 16, (n, k // group), generator=g).to(torch.int8) if zp else None
        return to_planes(Unpacked(codes=codes, d=d, m=None, sc=None, mn=mn), kind)
    if name == "FP8":
        d = torch.rand(n, k // 128, generator=g) * 0.01
        return to_planes(Unpacked(codes=_finite_e4m3(g, (n, k)), d=d, m=None, sc=None, mn=None), FP8_KIND)
    if name == "BNB8":  # a bitsandbytes 8-bit layer (LLM.int8() rows) quantized by the codec
        return _bnb8(n, k, g).to_weight(None, torch.float32)
    if name.startswith("BNB"):  # BNB_<type>_B<blocksize>: a bitsandbytes layer quantized by the codec
        from voltllm.model.loader.bnb_checkpoint import Bnb4bitWeight
        from voltllm.model.loader.bnb_codec import quantize_4bit

        packed, state = quantize_4bit(torch.randn(n, k, generator=g) * 0.05, name[4:7].lower(),
                                      int(name.rpartition("_B")[2]), double_quant=True)
        return Bnb4bitWeight(packed, state).to_weight(None, torch.float32)
    assert name == "NVFP4"
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    sc = _finite_e4m3(g, (n, k // 16)).view(torch.int8)
    d = torch.full((n, -(-k // 256)), 0.37)
    return to_planes(Unpacked(codes=codes, d=d, m=None, sc=sc, mn=None), NVFP4_KIND)


# (kind, inputs): NVFP4 at 320 inputs (a partial last 256-span of its global scale)
CASES = [(name, 1024) for name in KINDS] + [("INT4_G32_ZP", 512), ("INT4_G128", 512), ("FP8", 512), ("NVFP4", 320),
                                             ("BNB_NF4_B64", 512), ("BNB_FP4_B128", 512), ("BNB8", 512)]


@pytest.mark.parametrize("name,k", CASES)
def test_column_and_row_shards_equal_slices_of_the_dequantized_matrix(name, k):
    p = _planes(name, 6, k)
    full = dequantize_planes(p)
    mult = column_multiple(p.kind)
    for start, end in [(0, mult), (mult, k), (k - mult, k), (0, k)]:
        band = col_band(p, start, end)
        assert band.k == end - start
        assert torch.equal(dequantize_planes(band), full[:, start:end]), (start, end)
    assert torch.equal(dequantize_planes(row_shard(p, 2, 3)), full[2:5])
    padded = dequantize_planes(row_shard(p, 4, 4))  # 2 rows past the end: zeros
    assert torch.equal(padded[:2], full[4:]) and not padded[2:].any()


class _Held(PackedWeight):
    """A packed weight whose planes are given (as a loader's to_weight would make them)."""

    def __init__(self, p: Planes):
        self.p, self.out_features, self.in_features = p, p.n, p.k

    def to_weight(self, device, dtype):
        return self.p

    def dequantize(self, dtype=torch.float32, device=None):
        return dequantize_planes(self.p).to(dtype)


@pytest.mark.parametrize("name,k", [("Q4_K", 1024), ("INT4_G32_ZP", 512), ("FP8", 512), ("NVFP4", 320),
                                    ("BNB_NF4_B64", 512), ("BNB8", 512)])
def test_take_rows_and_cols_dispatch_on_packed_weights(name, k):
    p = _planes(name, 8, k)
    full = dequantize_planes(p)
    mult = column_multiple(p.kind)
    w = _Held(p) if name not in KINDS else GGUFBlocks(name, random_blocks(name, 8, k, torch.Generator().manual_seed(0)),
                                                        8, k)
    if name == "BNB8":  # the loader's own weight, cut before it is re-laid
        w = _bnb8(8, k, torch.Generator().manual_seed(0))
        assert column_multiple(p.kind) == 64
    dense = w.dequantize(torch.float32)  # (the format's own dequantization: the 8-bit layer's, not its planes')
    cols = take_cols(w, mult, mult, "layers.0.self_attn.o_proj")
    assert (cols.out_features, cols.in_features) == (8, mult)
    assert torch.equal(dequantize_planes(cols.to_weight(None, torch.float32)), full[:, mult:2 * mult])
    assert torch.equal(cols.dequantize(torch.float32), dense[:, mult:2 * mult])
    rows = take_rows(w, 6, 4)  # the last rank of a padded vocabulary: 2 real rows, 2 zero rows
    assert (rows.out_features, rows.in_features) == (4, k)
    got = dequantize_planes(rows.to_weight(None, torch.float32))
    assert torch.equal(got[:2], full[6:]) and not got[2:].any()
    assert torch.equal(rows.dequantize(torch.float32)[:2], dense[6:])
    both = take_cols(take_rows(w, 1, 3), 0, mult)  # a row cut then a column cut
    assert torch.equal(dequantize_planes(both.to_weight(None, torch.float32)), full[1:4, :mult])


def test_rows_of_interleaved_shards_compose():
    """GDN's in_proj_qkvz: PackedRows cut from one tensor, then this rank's rows of each (fewer source rows)."""
    p = _planes("Q8_0", 12, 256)
    full = dequantize_planes(p)
    parts = split_rows(_Held(p), [torch.tensor([0, 3, 6, 9]), torch.tensor([11, 1, 2, 5])])
    local = take_rows(parts[1], 1, 2)
    assert not isinstance(local, PackedSlice)
    assert torch.equal(dequantize_planes(local.to_weight(None, torch.float32)), full[[1, 2]])


@pytest.mark.parametrize("name,k,start,n,mult", [("Q4_K", 1024, 128, 256, 256), ("INT4_G128", 512, 64, 128, 128),
                                                 ("Q8_0", 256, 32, 64, 64), ("FP8", 512, 128, 64, 128),
                                                 ("BNB_FP4_B128", 512, 64, 128, 128)])
def test_misaligned_column_cut_is_an_error_naming_the_layer(name, k, start, n, mult):
    p = _planes(name, 4, k)
    cut = take_cols(_Held(p), start, n, "layers.3.mlp.down_proj")
    with pytest.raises(ValueError, match=rf"layers\.3\.mlp\.down_proj: .*{p.kind.name} must start and end on "
                                         rf"multiples of {mult} inputs"):
        cut.to_weight(None, torch.float32)
    with pytest.raises(ValueError, match=f"multiples of {mult} inputs"):
        col_band(p, start, start + n)


def test_dense_fallback_is_cut_as_dense():
    """A layout the planes cannot hold comes back dense from to_weight: any cut is then exact."""
    w = torch.randn(5, 96)

    class Dense(_Held):
        def __init__(self):
            self.out_features, self.in_features = w.shape

        def to_weight(self, device, dtype):
            return w.to(dtype)

        def dequantize(self, dtype=torch.float32, device=None):
            return w.to(dtype)

    assert torch.equal(take_cols(Dense(), 16, 48).to_weight(None, torch.float32), w[:, 16:64])
    got = take_rows(Dense(), 3, 4).to_weight(None, torch.float32)
    assert torch.equal(got[:2], w[3:]) and not got[2:].any()


def test_fp8_quantized_at_load_cuts_before_quantizing():
    from voltllm.model.loader.fp8_checkpoint import QuantizeAtLoad

    w = torch.randn(8, 512)
    whole = QuantizeAtLoad(w).dequantize(torch.float32)
    cut = take_cols(QuantizeAtLoad(w), 256, 256)
    assert isinstance(cut, QuantizeAtLoad) and torch.equal(cut.dequantize(torch.float32), whole[:, 256:])
    assert torch.equal(dequantize_planes(take_rows(QuantizeAtLoad(w), 2, 3).to_weight(None, torch.float32)),
                       whole[2:5])
