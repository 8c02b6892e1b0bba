"""KV cache dtype spec: what `--kv-cache-dtype` means for storage, capacity and the attention backends.

| flag value                | stored as                      | bytes/elem | read as                          |
|---------------------------|--------------------------------|------------|----------------------------------|
| auto                      | the model dtype                | 2 (fp16)   | as stored                        |
| float16/bfloat16/float32  | that dtype (= the model dtype) | 2 / 2 / 4  | as stored                        |
| fp8, fp8_e4m3             | uint8 E4M3FN codes             | 1          | decode(code) * scale (software)  |
| fp8_e5m2                  | uint8 E5M2 codes               | 1          | decode(code) * scale (software)  |

The cache layout is the same for every dtype: (2, num_blocks, block_size, num_kv_heads, head_dim).
An fp8 cache is plain uint8 so that the same code runs on GPUs without fp8 types (sm_70/sm_75) and
on the CPU; the codec is voltllm.kernels.fp8_codec (integer bit operations, RNE, E4M3 saturates).

Scales: every attention layer owns `k_scale` / `v_scale` buffers (fp32 scalar tensors, 1.0 unless
the checkpoint has them) and passes them to `backend.forward`. stored = encode(x / scale),
read = decode(code) * scale. They are tensors, not floats, so that CUDA graphs replay with them.
`--calculate-kv-scales` (vLLM's flag) sets them once, from the K/V of the first real forward, before
that forward writes the cache: scale = amax|x| / K_SCALE_RANGE (K) or / V_SCALE_RANGE (V), in place.
Scales the checkpoint gives take precedence and are kept.

Key offsets (`--calculate-key-offsets`, fp8 caches): the first real forward also sets each attention layer's
`k_offset` [kv_heads, head_dim] to the mean of its rotated keys, and from then on every key is stored as
k - k_offset. Attention does not change: a query's scores all shift by the same q . k_offset, which softmax
removes. What changes is the fp8 error: keys with a large per-channel mean (a QKV bias, as in Qwen2) lose
precision to it, and centered keys keep the 3-bit mantissa for what varies between tokens. Scales
calculated in the same forward see the centered keys.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch

logger = logging.getLogger("voltllm")

FP8_KV_DTYPES = {"fp8": "e4m3", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}
_FLOAT_KV_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class KVCacheSpec:
    name: str  # canonical: "auto" | "float16" | "bfloat16" | "float32" | "fp8_e4m3" | "fp8_e5m2"
    storage_dtype: torch.dtype  # dtype of the cache tensors
    fp8_format: Optional[str] = None  # "e4m3" | "e5m2" for fp8 caches

    @property
    def is_fp8(self) -> bool:
        return self.fp8_format is not None

    @property
    def element_size(self) -> int:
        return torch.tensor([], dtype=self.storage_dtype).element_size()

    @property
    def fmt(self) -> int:
        """FMT constexpr of the Triton kernels (fp8_codec.FP8_E4M3 / FP8_E5M2); -1 for float caches."""
        if self.fp8_format is None:
            return -1
        return 0 if self.fp8_format == "e4m3" else 1


def kv_cache_dtype_error(kv_cache_dtype: str, model_dtype: torch.dtype,
                         no_bf16: Optional[str] = None) -> Optional[str]:
    """Why `--kv-cache-dtype kv_cache_dtype` cannot run with a model in model_dtype (None: it can). no_bf16: what
    lacks bf16 on this device ("the sm70 route", ...; config._no_bf16_reason), None where bf16 runs."""
    name = (kv_cache_dtype or "auto").lower()
    if name == "auto" or name in FP8_KV_DTYPES:
        return None
    if name == "bfloat16" and no_bf16 is not None:
        return (f"--kv-cache-dtype bfloat16: {no_bf16} has no bf16 (the model runs in "
                f"{str(model_dtype).removeprefix('torch.')}); use auto (the model dtype) or fp8 / fp8_e5m2 "
                f"(half the bytes)")
    if name in _FLOAT_KV_DTYPES:
        if _FLOAT_KV_DTYPES[name] != model_dtype:
            return (f"--kv-cache-dtype {name} differs from the model dtype {str(model_dtype).removeprefix('torch.')}; "
                    f"a float KV cache uses the model dtype: use auto (or fp8, fp8_e4m3, fp8_e5m2)")
        return None
    return (f"--kv-cache-dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2, float16, bfloat16, float32; "
            f"got {kv_cache_dtype!r}")


def kv_cache_spec(kv_cache_dtype: Optional[str], model_dtype: torch.dtype) -> KVCacheSpec:
    """The spec of a validated flag value (see kv_cache_dtype_error)."""
    name = (kv_cache_dtype or "auto").lower()
    err = kv_cache_dtype_error(name, model_dtype)
    if err:
        raise ValueError(err)
    if name in FP8_KV_DTYPES:
        fmt = FP8_KV_DTYPES[name]
        return KVCacheSpec(name=f"fp8_{fmt}", storage_dtype=torch.uint8, fp8_format=fmt)
    return KVCacheSpec(name=name, storage_dtype=model_dtype)


# --- per-layer scales ------------------------------------------------------------------------------
def new_kv_scale() -> torch.Tensor:
    """A layer's default k/v scale buffer: fp32 scalar 1.0 (on the current default device)."""
    return torch.ones((), dtype=torch.float32)


_ONES: dict[str, torch.Tensor] = {}


def unit_scale(device: torch.device) -> torch.Tensor:
    """A cached fp32 scalar 1.0 on `device`, for callers that pass no scale (kept: graph-capture safe)."""
    key = str(device)
    t = _ONES.get(key)
    if t is None:
        t = _ONES[key] = torch.ones((), dtype=torch.float32, device=device)
    return t


# checkpoint names of KV-cache scales, as vLLM / compressed-tensors / ModelOpt write them:
#   layers.N.self_attn.k_scale            layers.N.self_attn.attn.k_scale
#   layers.N.self_attn.k_proj.k_scale     layers.N.self_attn.kv_scale (both K and V, older checkpoints)
_SCALE_RE = re.compile(r"^(?P<attn>.*\.self_attn)\.(?:(?:attn|k_proj|v_proj)\.)?(?P<kind>k_scale|v_scale|kv_scale)$")


def kv_scale_target(name: str) -> Optional[tuple[str, tuple[str, ...]]]:
    """(attention module path, buffer names) a checkpoint tensor `name` sets, or None if it is not a
    KV-cache scale. E.g. 'layers.3.self_attn.k_proj.k_scale' -> ('layers.3.self_attn', ('k_scale',))."""
    m = _SCALE_RE.match(name)
    if m is None:
        return None
    kind = m.group("kind")
    return m.group("attn"), (("k_scale", "v_scale") if kind == "kv_scale" else (kind,))


def load_kv_scale(buffer: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """Copy a checkpoint scale (shape [] or [1]) into a layer's fp32 scalar buffer."""
    if tensor.numel() != 1:
        raise ValueError(f"{name}: a KV-cache scale must have one element, got shape {tuple(tensor.shape)}")
    value = tensor.reshape(()).to(dtype=torch.float32, device=buffer.device)
    if not bool(torch.isfinite(value)) or float(value) <= 0.0:
        raise ValueError(f"{name}: KV-cache scale must be finite and > 0, got {float(value)}")
    buffer.copy_(value)


def load_checkpoint_kv_scale(attn: Any, buf: str, tensor: torch.Tensor, name: str) -> None:
    """Load a checkpoint scale into attn.<buf> and remember it came from the checkpoint: --calculate-kv-scales
    keeps it."""
    load_kv_scale(getattr(attn, buf), tensor, name)
    attn.checkpoint_kv_scales.add(buf)


# --- --calculate-kv-scales ---------------------------------------------------------------------------
# vLLM's defaults (K_SCALE_CONSTANT / V_SCALE_CONSTANT): the first forward's amax maps to 200 (K) / 100 (V),
# leaving 2.2x / 4.5x headroom below E4M3's 448 for larger values in later tokens (E4M3 saturates there).
K_SCALE_RANGE = 200.0
V_SCALE_RANGE = 100.0


def kv_scales_to_calculate(model: Any, calculate_kv_scales: bool) -> bool:
    """Whether the runner must calculate scales on its first real forward: the flag is on (the config turns
    it off for float caches) and some attention layer has a scale the checkpoint did not give."""
    if not calculate_kv_scales:
        return False
    attns = [m for m in model.modules() if hasattr(m, "checkpoint_kv_scales")]
    kept = sum(len(m.checkpoint_kv_scales) for m in attns)
    if kept:
        logger.warning("--calculate-kv-scales: %d of %d k/v scales come from the checkpoint and take precedence; "
                       "%s", kept, 2 * len(attns), "nothing is calculated" if kept == 2 * len(attns) else
                       "the others are calculated on the first forward")
    return kept < 2 * len(attns)


@torch.no_grad()
def calc_kv_scales(attn: Any, k: torch.Tensor, v: torch.Tensor) -> None:
    """attn.k_scale = amax|k| / K_SCALE_RANGE, attn.v_scale = amax|v| / V_SCALE_RANGE, written in place (device
    ops, no host sync: CUDA graphs read these tensors). Checkpoint scales are kept; an all-zero or
    non-finite amax keeps the current scale (a zero scale would divide by zero)."""
    for buf, x, rng in (("k_scale", k, K_SCALE_RANGE), ("v_scale", v, V_SCALE_RANGE)):
        if buf in attn.checkpoint_kv_scales or x.numel() == 0:
            continue
        scale = getattr(attn, buf)
        amax = x.abs().amax().to(torch.float32)
        scale.copy_(torch.where(torch.isfinite(amax) & (amax > 0), amax / rng, scale))


def maybe_calc_kv_scales(attn: Any, k: torch.Tensor, v: torch.Tensor, ctx: Any) -> None:
    """Called by attention layers just before backend.forward (which writes K/V with the scales)."""
    if ctx.calc_kv_scales:
        n = ctx.meta.num_tokens  # rows past it are padding
        calc_kv_scales(attn, k[:n], v[:n])


# --- --calculate-key-offsets ----------------------------------------------------------------------------
def enable_key_offsets(model: Any) -> int:
    """Give every attention layer a zero `k_offset` [kv_heads, head_dim] buffer in the model dtype (before CUDA
    graphs are captured: they read it); the first real forward fills it. Returns the number of layers."""
    heads, dim = model.kv_heads_and_dim
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float16)
    attns = [m for m in model.modules() if hasattr(m, "checkpoint_kv_scales")]
    for m in attns:
        m.k_offset = torch.zeros(heads, dim, dtype=dtype, device=m.k_scale.device)
    return len(attns)


@torch.no_grad()
def calc_key_offsets(attn: Any, k: torch.Tensor) -> None:
    """attn.k_offset = the mean over tokens of k [T, kv_heads, head_dim] (in place, no host sync); non-finite
    means keep the current offset."""
    if k.shape[0] == 0:
        return
    mean = k.float().mean(0)
    attn.k_offset.copy_(torch.where(torch.isfinite(mean), mean, attn.k_offset.float()))


def center_keys(attn: Any, k: torch.Tensor, ctx: Any) -> torch.Tensor:
    """k - attn.k_offset for layers with key offsets (calculated first on the calibrating forward); else k."""
    if getattr(attn, "k_offset", None) is None:
        return k
    if ctx.calc_key_offsets:
        calc_key_offsets(attn, k[:ctx.meta.num_tokens])  # rows past num_tokens are padding
    return k - attn.k_offset
