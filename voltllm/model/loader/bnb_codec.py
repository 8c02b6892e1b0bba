"""bitsandbytes' weight formats in plain PyTorch: the reference codec behind bnb_checkpoint.py.

4-bit (NF4 / FP4, what `load_in_4bit` checkpoints hold). A weight [N, K] is flattened row-major and cut into blocks of
`blocksize` elements (64 by default; the last block may be partial). Each block keeps its absmax (fp32) and each
element a 4-bit index into a 16-entry table of values in [-1, 1]: w = table[q] * absmax. The table is NF4 (the
normal-distribution quantiles of the QLoRA paper, NF4_VALUES) or bitsandbytes' own 4-bit float FP4 (FP4_VALUES).
Two codes share a byte, the even element in the high nibble. With double quantization (`nested`) the absmax are
themselves quantized: offset = their mean, and (absmax - offset) is coded to 8 bits with the signed dynamic map
(dynamic_map) in blocks of 256, each with its own fp32 absmax: absmax = map[c] * nested_absmax + offset.

Dequantized as bitsandbytes' CUDA kernels (what vLLM runs) do: the absmax in fp32 ((map[c] * nested_absmax) rounded,
then + offset rounded), table[q] * absmax rounded once to fp32, then converted to the layer's stored dtype.

8-bit (LLM.int8(), `load_in_8bit`): int8 codes [N, K] and one fp32 absmax per row (SCB): w = q * SCB * (1 / 127).

The quantizers (quantize_4bit, for `--quantization bitsandbytes` on an unquantized checkpoint and for the tests'
checkpoints) pick the nearest table entry (a tie goes to the lower value, as the CUDA kernels' decision trees do).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

BLOCKSIZE = 64
NESTED_BLOCKSIZE = 256
QUANT_TYPES = ("nf4", "fp4")
# NF4 (the fp32 values bitsandbytes' kernels hard-code): normal_map() derives them
NF4_VALUES = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)
# bitsandbytes' FP4: code bit 3 the sign, codes 0..7 the magnitudes below, all divided by the largest (12)
_FP4_MAGNITUDES = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0)
INT8_SCALE = 1 / 127  # (as fp32 where it multiplies)


def table(quant_type: str) -> torch.Tensor:
    """The 16 fp32 values a 4-bit code indexes."""
    if quant_type == "nf4":
        return torch.tensor(NF4_VALUES, dtype=torch.float32)
    if quant_type == "fp4":
        mags = torch.tensor(_FP4_MAGNITUDES, dtype=torch.float32)
        return torch.cat([mags, -mags]) / 12.0
    raise ValueError(f"bitsandbytes 4-bit type {quant_type!r}: expected one of {', '.join(QUANT_TYPES)}")


def normal_map(offset: float = 0.9677083) -> torch.Tensor:
    """NF4 from its definition: 8 positive and 7 negative quantiles of the standard normal, evenly spaced in
    probability from `offset` to 0.5 (excluded), with 0, scaled so the largest is 1 (the probabilities in fp32, the
    quantiles in fp64, then fp32, as bitsandbytes builds its table)."""
    def quantiles(count: int) -> torch.Tensor:
        p = torch.linspace(offset, 0.5, count, dtype=torch.float32)[:-1].double()
        return math.sqrt(2.0) * torch.erfinv(2.0 * p - 1.0)

    values = torch.cat([quantiles(9), torch.zeros(1, dtype=torch.float64), -quantiles(8)]).float().sort().values
    return values / values.max()


def dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (256 fp32 values, sorted), which codes the absmax of double
    quantization: for i = 0..6, the midpoints of 2^i + 1 even steps over [0.1, 1], times 10^(i - 6), both signs;
    with 0 and 1."""
    values = [0.0, 1.0]
    for i in range(7):
        edges = torch.linspace(0.1, 1.0, 2 ** i + 1, dtype=torch.float32)
        means = (edges[:-1] + edges[1:]) / 2.0
        scale = 10.0 ** (i - 6)
        values += (scale * means).tolist() + (-scale * means).tolist()
    return torch.tensor(sorted(values), dtype=torch.float32)


@dataclass
class NestedAbsmax:
    """Double quantization's second level: the 8-bit map, one fp32 absmax per `blocksize` codes, the offset."""
    quant_map: torch.Tensor  # fp32 [256]
    absmax: torch.Tensor  # fp32 [ceil(blocks / blocksize)]
    blocksize: int
    offset: float


@dataclass
class Bnb4bitState:
    """What dequantizes one 4-bit weight (bitsandbytes' QuantState): `absmax` fp32 per block, or uint8 codes with
    `nested`."""
    quant_type: str
    blocksize: int
    shape: tuple[int, ...]
    dtype: torch.dtype  # the weight's dtype before quantization (the dequantized weight's)
    absmax: torch.Tensor
    nested: Optional[NestedAbsmax] = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def blocks(self) -> int:
        return -(-self.numel // self.blocksize)


def _nearest(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The index of the value nearest each element of x (a tie: the lower value; repeated values: the first
    index), as uint8."""
    first: dict[float, int] = {}
    for i, v in enumerate(values.tolist()):
        first.setdefault(v, i)  # (-0.0 == 0.0: FP4's code 0 keeps zero)
    order = sorted(first, key=float)
    sorted_values = torch.tensor(order, dtype=torch.float32)
    codes = torch.tensor([first[v] for v in order], dtype=torch.uint8)
    midpoints = (sorted_values[:-1] + sorted_values[1:]) / 2
    return codes[torch.bucketize(x.contiguous(), midpoints)]


def _blockwise(x: torch.Tensor, values: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (flat) in blocks: (codes uint8 [n], absmax fp32 [blocks]); an element is scaled by 1 / absmax (an
    all-zero block by 0) and clamped to [-1, 1] before its nearest value is chosen."""
    n = x.numel()
    blocks = torch.nn.functional.pad(x.float(), (0, -n % blocksize)).view(-1, blocksize)
    absmax = blocks.abs().amax(dim=1)
    inverse = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))
    scaled = (blocks * inverse[:, None]).clamp(-1, 1).reshape(-1)[:n]
    return _nearest(scaled, values), absmax


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [n] -> uint8 [ceil(n / 2), 1]: element 2i in the high nibble of byte i, 2i + 1 in the low."""
    c = torch.nn.functional.pad(codes.reshape(-1).to(torch.uint8), (0, codes.numel() % 2))
    return ((c[0::2] << 4) | c[1::2]).reshape(-1, 1)


def unpack_codes(packed: torch.Tensor, n: int) -> torch.Tensor:
    """pack_codes' inverse: uint8 codes [n] (any storage dtype is read as its bytes)."""
    b = packed.contiguous().view(torch.uint8).reshape(-1)
    return torch.stack([b >> 4, b & 15], dim=1).reshape(-1)[:n]


def quantize_4bit(w: torch.Tensor, quant_type: str = "nf4", blocksize: int = BLOCKSIZE, double_quant: bool = True,
                  nested_blocksize: int = NESTED_BLOCKSIZE) -> tuple[torch.Tensor, Bnb4bitState]:
    """(packed uint8 [ceil(numel / 2), 1], state) of w; double_quant codes the absmax to 8 bits (offset: their
    mean)."""
    codes, absmax = _blockwise(w.reshape(-1), table(quant_type), blocksize)
    state = Bnb4bitState(quant_type, blocksize, tuple(w.shape), w.dtype, absmax)
    if double_quant:
        offset = absmax.mean()
        absmax_codes, nested_absmax = _blockwise(absmax - offset, dynamic_map(), nested_blocksize)
        state.absmax = absmax_codes
        state.nested = NestedAbsmax(dynamic_map(), nested_absmax, nested_blocksize, offset.item())
    return pack_codes(codes), state


def block_absmax(state: Bnb4bitState) -> torch.Tensor:
    """Each block's absmax, fp32 [blocks] (double quantization decoded: map[c] * nested absmax, then + offset)."""
    if state.nested is None:
        return state.absmax.to(torch.float32)
    nest = state.nested
    values = nest.quant_map.to(torch.float32)[state.absmax.long()]
    scales = nest.absmax.to(torch.float32).repeat_interleave(nest.blocksize)[: values.numel()]
    return values * scales + torch.tensor(nest.offset, dtype=torch.float32)


def dequantize_4bit(packed: torch.Tensor, state: Bnb4bitState) -> torch.Tensor:
    """The weight [shape] in state.dtype: table[q] * absmax in fp32, rounded once to that dtype."""
    n, bs = state.numel, state.blocksize
    values = table(state.quant_type)[unpack_codes(packed, n).long()]
    blocks = torch.nn.functional.pad(values, (0, -n % bs)).view(-1, bs)
    w = (blocks * block_absmax(state)[:, None]).reshape(-1)[:n]
    return w.to(state.dtype).reshape(state.shape)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LLM.int8()'s row-wise form: (int8 codes [N, K], SCB fp32 [N]: each row's absmax), q = round(w * 127 / SCB)."""
    scb = w.float().abs().amax(dim=1)
    scale = torch.where(scb > 0, 127.0 / scb, torch.zeros_like(scb))
    return torch.round(w.float() * scale[:, None]).clamp(-127, 127).to(torch.int8), scb


def dequantize_int8(codes: torch.Tensor, scb: torch.Tensor) -> torch.Tensor:
    """q * SCB * (1 / 127), fp32 [N, K] (two roundings, bitsandbytes' order)."""
    return (codes.to(torch.float32) * scb.to(torch.float32).reshape(-1, 1)) * torch.tensor(INT8_SCALE,
                                                                                           dtype=torch.float32)
