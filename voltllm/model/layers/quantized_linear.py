"""Linear layers whose quantized weights stay quantized on the device (LinearMethod for voltllm.model.layers.linear):
GGUF files, and 4-bit AWQ / GPTQ checkpoints (model/loader/int4_checkpoint.py), both re-laid as gguf_planes.Planes.

Each logical shard (q, k, v; gate, up; ...) arrives as a PackedWeight of its own type (a Q4_K_M file mixes Q4_K and
Q6_K, even inside one merged qkv projection). Shards of a type with a plane layout (gguf_planes.KINDS) become
Planes; consecutive shards of one kind are merged so a uniform merged projection is one kernel launch. Other
types arrive already dequantized (the loader did it) and stay dense in the compute dtype.

The product, by row count (M):
- up to `fma_max_rows` rows (decode): the dequant-GEMM (kernels.quant_gemv), which reads the weight once at its
  quantized size and needs no tensor cores (the same on every route), or its packed-fp16 form (kernels.quant_half2);
- up to MMA_MAX_ROWS rows, where the start-up tuner timed it faster than quant_dot (sm_80+, not the compat route):
  the tensor-core GEMV (kernels.quant_mma), one weight read for up to 16 rows (batched decode, a speculative
  verification of K + 1 <= 16 rows);
- up to `dot_max_rows` rows (decode batches): the tiled dequant-GEMM (kernels.quant_dot), which dequantizes each
  weight tile in registers once per block of rows and multiplies with `tl.dot` (tensor cores from sm_80 on, FMAs
  below, hence a lower limit there: kernels.quant_dot.dot_max_rows; its tiles by row class `dot_tiles`, on sm_90 off
  the compat route the transposed form's: kernels.quant_dot.dot_table; the compat route takes its chip's limit and
  tiles on any GPU, platform.route_capability);
- more rows (prompt steps, large decode batches): the weight is dequantized into a workspace and cuBLAS multiplies
  (fp16 tensor cores on every route; one weight at a time, reused through the caching allocator).
The CPU (tests) dequantizes with the torch reference and multiplies with F.linear.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from voltllm.model.layers.gguf_planes import (Planes, col_band, column_multiple, concat_rows, dequantize_planes,
                                              planes_from_blocks, row_band, row_shard, take_rows)
from voltllm.model.layers.linear import LinearMethod

# rows up to which the dequant-GEMM beats dequantize + cuBLAS (H200 sweep: benchmarks/results/gguf-quant/)
FMA_MAX_ROWS = 4
# the row classes above FMA_MAX_ROWS (5-8, 9-16) where the tensor-core GEMV (kernels/quant_mma.py, sm_80+) may take a
# product, when the start-up tuner timed it faster than quant_dot at that many rows (one weight read for all of them:
# batched decode, speculative verification)
MMA_ROW_CLASSES = (8, 16)
MMA_MAX_ROWS = MMA_ROW_CLASSES[-1]


def row_class(rows: int) -> int:
    """The tuner's row class of a product of `rows` activation rows: 1, FMA_MAX_ROWS (2-4), 8 (5-8) or 16 (9-16)."""
    if rows == 1:
        return 1
    return FMA_MAX_ROWS if rows <= FMA_MAX_ROWS else next(c for c in MMA_ROW_CLASSES if rows <= c)
# the largest dequantized workspace: bigger matrices (a 152K-token vocabulary: 1.2-1.5 GB in fp16, which prompt
# logprobs multiply by every prompt row) are dequantized in bands of rows, so no step needs more than this beyond
# what the start-up memory profile saw
WORKSPACE_MAX_BYTES = 256 << 20


class PackedWeight:
    """A weight [out_features, in_features] as a quantized file stores it; `to_weight` re-lays it on the device."""
    out_features: int
    in_features: int

    def to_weight(self, device: Optional[torch.device], dtype: torch.dtype) -> Union[Planes, torch.Tensor]:
        """Planes on `device`, or the dense matrix in `dtype` where the planes cannot hold this weight."""
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None) -> torch.Tensor:
        """The dense matrix [out_features, in_features] (layers that keep no quantized form, e.g. MoE experts)."""
        raise NotImplementedError

    def cut(self, dim: int, start: int, n: int, what: str = "") -> "PackedWeight":
        """Rows (dim 0) or input columns (dim 1) [start, start + n), rows past the end zeros: a tensor-parallel
        shard (distributed.sharding). Formats that can cut their stored form cheaply override this."""
        return PackedSlice(self, dim, start, n, what)


_DENSE_REASONS_LOGGED: set[str] = set()


def log_dense_at_load(reason: str) -> None:
    """Say once per reason (not per layer: a model has hundreds) that weights kept quantized on the device come dense
    instead, because the planes cannot hold their layout; the values are the checkpoint's own, only bigger."""
    if reason not in _DENSE_REASONS_LOGGED:
        _DENSE_REASONS_LOGGED.add(reason)
        logging.getLogger("voltllm").warning("quantized layers dequantized at load (the planes cannot hold them): %s",
                                             reason)


class MisalignedCut(ValueError):
    """A tensor-parallel column cut that would split a quantized block / group (PackedSlice)."""


class PackedSlice(PackedWeight):
    """Rows or input columns [start, start + n) of another packed weight, cut right after it is re-laid (so a rank
    holds the whole weight only while it loads that one layer) or dequantized. Column cuts must fall on the planes'
    block / group boundaries (gguf_planes.column_multiple): a cut that does not raises, naming the layer, the kind
    and the multiple, rather than mixing groups."""

    def __init__(self, inner: PackedWeight, dim: int, start: int, n: int, what: str = ""):
        self.inner, self.dim, self.start, self.n, self.what = inner, dim, start, n, what
        self.out_features = n if dim == 0 else inner.out_features
        self.in_features = inner.in_features if dim == 0 else n

    def to_weight(self, device: Optional[torch.device], dtype: torch.dtype) -> Union[Planes, torch.Tensor]:
        w = self.inner.to_weight(device, dtype)
        if isinstance(w, torch.Tensor):  # a layout the planes cannot hold: dense, cut as dense
            return self._cut_dense(w)
        if self.dim == 0:
            return row_shard(w, self.start, self.n)
        mult = column_multiple(w.kind)
        if self.start % mult or self.n % mult:
            raise MisalignedCut(f"{self.what or 'a row-parallel projection'}: this rank's input columns [{self.start}, "
                             f"{self.start + self.n}) of a weight kept quantized as {w.kind.name} must start and end "
                             f"on multiples of {mult} inputs (its blocks / groups); choose a --tensor-parallel-size "
                             f"that gives each rank a multiple of {mult} inputs, or drop --quantization to dequantize "
                             "at load")
        return col_band(w, self.start, self.start + self.n)

    def dequantize(self, dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None) -> torch.Tensor:
        return self._cut_dense(self.inner.dequantize(dtype, device))

    def _cut_dense(self, w: torch.Tensor) -> torch.Tensor:
        from voltllm.distributed.sharding import take_cols, take_rows as take_dense_rows

        return (take_dense_rows(w, self.start, self.n) if self.dim == 0 else take_cols(w, self.start, self.n)).clone()


@dataclass
class GGUFBlocks(PackedWeight):
    """A weight as the GGUF file stores it: blocks of `type_name`, uint8 [out_features, row bytes] (any device)."""
    type_name: str
    raw: torch.Tensor
    out_features: int
    in_features: int

    def take_rows(self, index: torch.Tensor) -> "GGUFBlocks":
        return GGUFBlocks(self.type_name, self.raw[index], self.out_features, self.in_features)

    def cut(self, dim: int, start: int, n: int, what: str = "") -> PackedWeight:
        if dim == 1:
            return PackedSlice(self, dim, start, n, what)
        # rows of whole blocks, all-zero blocks past the end (scale 0: every type's value 0)
        from voltllm.distributed.sharding import take_rows as take_dense_rows

        return GGUFBlocks(self.type_name, take_dense_rows(self.raw, start, n), n, self.in_features)

    def to_weight(self, device: Optional[torch.device], dtype: torch.dtype) -> Planes:
        return planes_from_blocks(self.raw, self.type_name, self.in_features, device)

    def dequantize(self, dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None) -> torch.Tensor:
        return dequantize_planes(self.to_weight(device, dtype)).to(dtype)


class PackedRows(PackedWeight):
    """Rows `index` of a packed weight, in that order: a checkpoint tensor that holds several of a layer's shards
    interleaved (Qwen3-Next's in_proj_qkvz, grouped per key head). The shards cut from one tensor share `source`, so
    it is re-laid (or dequantized) once, then each shard takes its rows."""

    def __init__(self, source: "_SharedPacked", index: torch.Tensor):
        self.source, self.index = source, index
        self.out_features, self.in_features = index.numel(), source.packed.in_features

    def to_weight(self, device: Optional[torch.device], dtype: torch.dtype) -> Union[Planes, torch.Tensor]:
        w = self.source.weight(device, dtype)
        idx = self.index.to(w.device)
        return take_rows(w, idx) if isinstance(w, Planes) else w.index_select(0, idx)

    def dequantize(self, dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None) -> torch.Tensor:
        w = self.source.dense(dtype, device)
        return w.index_select(0, self.index.to(w.device))

    def cut(self, dim: int, start: int, n: int, what: str = "") -> PackedWeight:
        if dim == 0 and start + n <= self.index.numel():  # fewer rows of the same source
            return PackedRows(self.source, self.index[start:start + n])
        return PackedSlice(self, dim, start, n, what)


class _SharedPacked:
    """One packed weight and its conversions (planes or dense, by device and dtype), for the PackedRows cut from it;
    freed with them."""

    def __init__(self, packed: PackedWeight):
        self.packed = packed
        self.cached: dict[tuple, Union[Planes, torch.Tensor]] = {}

    def _get(self, key: tuple, make):
        if key not in self.cached:
            self.cached[key] = make()
        return self.cached[key]

    def weight(self, device, dtype):
        return self._get(("weight", device, dtype), lambda: self.packed.to_weight(device, dtype))

    def dense(self, dtype, device):
        return self._get(("dense", device, dtype), lambda: self.packed.dequantize(dtype, device))


def split_rows(tensor: Union[PackedWeight, torch.Tensor], indices: list[torch.Tensor]) -> list:
    """The rows `indices[i]` of a dense or packed [N, K] weight, one part per index (packed parts stay packed)."""
    if isinstance(tensor, PackedWeight):
        source = _SharedPacked(tensor)
        return [PackedRows(source, idx) for idx in indices]
    return [tensor.index_select(0, idx.to(tensor.device)) for idx in indices]


def dense_tensor(tensor: Union[PackedWeight, torch.Tensor]) -> torch.Tensor:
    """A weight for a layer held dense (router, shared-expert gate, norms): a packed one dequantized (fp32)."""
    return tensor.dequantize(torch.float32) if isinstance(tensor, PackedWeight) else tensor


@dataclass
class Segment:
    """Output columns [offset, offset + size) of a layer: quantized planes or a dense weight."""
    offset: int
    size: int
    weight: Union[Planes, torch.Tensor]


class QuantizedLinearMethod(LinearMethod):
    """The same forms on both routes: the dequant-GEMM needs no tensor cores, cuBLAS uses SM70's."""

    def __init__(self, dot_max_rows: int = 0, dot_tiles: Optional[dict] = None, moe_tiles: Optional[dict] = None,
                 moe_max_rows: Optional[int] = None):
        self.fma_max_rows = FMA_MAX_ROWS
        self.dot_max_rows = dot_max_rows  # 0: no tiled dequant-GEMM (the CPU)
        self.dot_tiles = dot_tiles  # the tiled dequant-GEMM's row classes (kernels/quant_dot.dot_table; None:
        # DOT_CONFIGS)
        self.moe_tiles = moe_tiles  # the same for the grouped MoE kernel of quantized experts (quant_dot.moe_table)
        self.moe_max_rows = moe_max_rows  # and its row limit (quant_dot.grouped_max_rows; None: the device's)
        self.workspace_max_bytes = WORKSPACE_MAX_BYTES
        # dequant-GEMM tiles chosen at start-up (worker/quant_tuning.py): (kind, N, K, row_class) -> config,
        # (BLOCK_N, U, num_warps) of quant_gemv's fp32 form, (HALF2 | HALF2_ROWS, BLOCK_N, U, num_warps) of
        # quant_half2's, (MMA, KU, num_warps) of quant_mma's or (DOT,); the 5-8 / 9-16-row classes only where MMA was
        # timed
        self.tiles: dict[tuple[str, int, int, int], tuple] = {}

    def create_weights(self, layer, in_features, out_features, dtype):
        layer.weight = None  # no dense weight: the start-up GEMM tuner and fused decode paths skip this layer
        layer.gguf_dtype = dtype
        layer.gguf_device = torch.empty(0).device  # the model is built under `with torch.device(...)`
        layer.gguf_shards = [None] * len(layer.shard_sizes)
        layer.gguf_segments = []

    def load_shard(self, layer, tensor, offset, size):
        shard = [layer.shard_offset(i) for i in range(len(layer.shard_sizes))].index(offset)
        if isinstance(tensor, PackedWeight):
            if (tensor.out_features, tensor.in_features) != (size, layer.in_features):
                raise ValueError(f"quantized weight of shape {(tensor.out_features, tensor.in_features)}, expected "
                                 f"{(size, layer.in_features)}")
            weight = tensor.to_weight(layer.gguf_device, layer.gguf_dtype)
        else:
            if tensor.shape != (size, layer.in_features):
                raise ValueError(f"weight shard of shape {tuple(tensor.shape)}, expected {(size, layer.in_features)}")
            weight = tensor.to(dtype=layer.gguf_dtype, device=layer.gguf_device)
        layer.gguf_shards[shard] = weight
        if all(s is not None for s in layer.gguf_shards):
            layer.gguf_segments = _merge(layer.gguf_shards, layer.shard_sizes)
            layer.gguf_shards = [None] * len(layer.shard_sizes)

    def apply(self, layer, x):
        if not layer.gguf_segments:
            raise RuntimeError("GGUF linear layer used before all its shards were loaded")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        segs = layer.gguf_segments
        if len(segs) == 1:
            y = self.segment_product(x2, segs[0], layer.bias, None)
        else:
            y = torch.empty(x2.shape[0], layer.out_features, dtype=x.dtype, device=x.device)
            for s in segs:
                bias = None if layer.bias is None else layer.bias[s.offset:s.offset + s.size]
                self.segment_product(x2, s, bias, y[:, s.offset:s.offset + s.size])
        return y.reshape(*lead, layer.out_features)

    def segment_product(self, x: torch.Tensor, seg: Segment, bias: Optional[torch.Tensor], out: Optional[torch.Tensor]):
        w = seg.weight
        if isinstance(w, Planes):
            rows = x.shape[0]
            tile = self.tiles.get((w.kind.name, w.n, w.k, row_class(rows))) if rows <= MMA_MAX_ROWS else None
            if x.is_cuda and (rows <= self.fma_max_rows or tile is not None):
                from voltllm.kernels.quant_half2 import few_row_matmul

                return few_row_matmul(x, w, bias, out=out, config=tile, dot_tiles=self.dot_tiles)
            if x.is_cuda and rows <= self.dot_max_rows:
                from voltllm.kernels.quant_dot import pick_config, quant_dot

                return quant_dot(x, w, bias, out=out, config=pick_config(rows, self.dot_tiles))
            step = max(1, self.workspace_max_bytes // (w.k * x.element_size()))
            if w.n > step:  # a vocabulary-sized matrix: dequantize a band of rows at a time
                if out is None:
                    out = torch.empty(rows, w.n, dtype=x.dtype, device=x.device)
                for a in range(0, w.n, step):
                    b = min(w.n, a + step)
                    out[:, a:b] = F.linear(x, dequantized(row_band(w, a, b), x.dtype),
                                           None if bias is None else bias[a:b])
                return out
            w = dequantized(w, x.dtype)
        y = F.linear(x, w, bias)
        if out is None:
            return y
        out.copy_(y)
        return out


class QuantEmbedding(nn.Module):
    """A GGUF token-embedding matrix kept quantized (or dense, for types without a plane layout): a lookup
    dequantizes only the rows it gathers; a tied LM head multiplies by the same planes (QuantizedLinearMethod's routes),
    so the vocabulary matrix is held once, at its quantized size, and read at that size per decode step.

    Under tensor parallelism (`tp`) it is vocabulary-parallel like layers.vocab_parallel.VocabParallelEmbedding: each
    rank holds its ceil(V / N) rows, still quantized (the padded tail: all-zero planes, whose value is 0); a lookup
    reads the ids this rank holds and the ranks sum; the tied head's logits are gathered by the model."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, method: QuantizedLinearMethod,
                 tp=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype, self.method = num_embeddings, embedding_dim, dtype, method
        self.device = torch.empty(0).device  # the model is built under `with torch.device(...)`
        self.table: Optional[Segment] = None
        self.tp = tp
        self.rows, self.start = num_embeddings, 0
        if tp is not None:
            from voltllm.distributed.sharding import vocab_rows

            self.rows = vocab_rows(num_embeddings, tp.size)
            self.start = tp.rank * self.rows

    @property
    def weight(self) -> Optional[torch.Tensor]:
        """The dense matrix when the file's type has no plane layout, else None (quantized)."""
        return self.table.weight if self.table is not None and isinstance(self.table.weight, torch.Tensor) else None

    def load(self, tensor: Union[PackedWeight, torch.Tensor]) -> None:
        shape = (tensor.out_features, tensor.in_features) if isinstance(tensor, PackedWeight) else tuple(tensor.shape)
        if shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"embedding of shape {shape}, expected {(self.num_embeddings, self.embedding_dim)}")
        if self.tp is not None:
            from voltllm.distributed.sharding import take_rows as take_shard

            tensor = take_shard(tensor, self.start, self.rows)
        w = (tensor.to_weight(self.device, self.dtype) if isinstance(tensor, PackedWeight)
             else tensor.to(dtype=self.dtype, device=self.device))
        self.table = Segment(0, self.rows, w)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        held = None
        if self.tp is not None:  # this rank's rows, as VocabParallelEmbedding
            from voltllm.model.layers.vocab_parallel import shard_ids

            ids, held = shard_ids(ids, self.start, self.rows)
        w = self.table.weight
        if isinstance(w, torch.Tensor):
            out = F.embedding(ids, w)
        else:
            out = dequantized(take_rows(w, ids.reshape(-1)), self.dtype).reshape(*ids.shape, self.embedding_dim)
        if held is None:
            return out
        from voltllm.model.layers.vocab_parallel import sum_over_ranks

        return sum_over_ranks(out, held, self.tp)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, dim] times the table^T: the tied LM head."""
        return self.method.segment_product(hidden, self.table, None, None)


def dequantized(p: Planes, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in `dtype`: the Triton kernel on CUDA, the torch reference elsewhere."""
    if p.device.type == "cuda":
        from voltllm.kernels.quant_gemv import dequantize

        return dequantize(p, dtype)
    return dequantize_planes(p).to(dtype)


def _merge(shards: list, sizes: list[int]) -> list[Segment]:
    """Consecutive shards of one plane kind (or all dense) become one segment."""
    segments: list[Segment] = []
    offset = 0
    for w, size in zip(shards, sizes):
        prev = segments[-1] if segments else None
        if prev is not None and isinstance(w, Planes) and isinstance(prev.weight, Planes) and \
                prev.weight.kind == w.kind:
            prev.weight = concat_rows([prev.weight, w])
            prev.size += size
        elif prev is not None and isinstance(w, torch.Tensor) and isinstance(prev.weight, torch.Tensor):
            prev.weight = torch.cat([prev.weight, w])
            prev.size += size
        else:
            segments.append(Segment(offset, size, w))
        offset += size
    return segments


def _segment_bytes(seg: Segment) -> int:
    w = seg.weight
    return w.nbytes if isinstance(w, Planes) else w.numel() * w.element_size()


def held_segments(mod: nn.Module) -> list[Segment]:
    """The GGUF segments a layer (or a quantized embedding table) holds outside its parameters."""
    if isinstance(mod, QuantEmbedding):
        return [mod.table] if mod.table is not None else []
    return getattr(mod, "gguf_segments", None) or []


def held_matrix(mod: nn.Module) -> Optional[tuple[int, int]]:
    """(bytes, elements) of the quantized matrices a layer, embedding or MoE block (its experts) holds outside its
    parameters; None for others."""
    experts = getattr(mod, "qexperts", None)
    if experts is not None and experts.ready:
        return experts.nbytes, 3 * experts.num_experts * experts.inter * experts.hidden
    segs = held_segments(mod)
    if not segs:
        return None
    cols = mod.embedding_dim if isinstance(mod, QuantEmbedding) else mod.in_features
    return sum(_segment_bytes(s) for s in segs), sum(s.size for s in segs) * cols


def describe_quantized(model: torch.nn.Module) -> str:
    """What the linear layers and embeddings hold, for the start-up log: bytes per plane kind and of dense weights."""
    by_kind: dict[str, int] = {}
    for mod in model.modules():
        for s in held_segments(mod):
            key = s.weight.kind.name if isinstance(s.weight, Planes) else f"dense {s.weight.dtype}"
            by_kind[key] = by_kind.get(key, 0) + _segment_bytes(s)
        experts = getattr(mod, "qexperts", None)
        if experts is not None and experts.ready:
            key = f"MoE experts {experts.w13.kind.name}"
            by_kind[key] = by_kind.get(key, 0) + experts.nbytes
    return ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(by_kind.items())) or "no GGUF matrices"
