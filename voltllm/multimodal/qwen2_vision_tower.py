"""Qwen2-VL's and Qwen2.5-VL's vision encoders: image patches -> rows of the text model's hidden size, one per merged
2x2 patch window (the same API as vision_tower.VisionTower).

The processor's rows come window by window (the patches of each spatial_merge_size square consecutive). Both towers
embed them linearly (no bias, no learned position table), run blocks of non-causal attention with an axial (row,
column) rotary, and merge each square's consecutive rows into one (norm per patch, then linear, GELU, linear).
- Qwen2-VL: LayerNorm blocks, a QuickGELU MLP (fc1 / fc2); every block attends over one frame of one image. Its
  vision_config calls the tower's width `embed_dim` and the output width `hidden_size`.
- Qwen2.5-VL: RMSNorm blocks, a gated MLP (gate / up / down, with biases), and window attention: the merged squares
  are reordered window by window (windows of window_size pixels a side, the image's last row and column of windows
  cut short), the blocks in fullatt_block_indexes attend over the whole frame and the others within one window, and
  the merger's rows are put back in the processor's order.

Norms and the rotary run in fp32 whatever the tower's dtype; attention runs in the tower's dtype through
scaled_dot_product_attention."""
from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from voltllm.multimodal.vision_tower import (_ACTIVATIONS, _Attention, _field, _layer_norm, _PatchEmbed,
                                             image_token_count, load_tower_weights, patch_order)

QWEN2_VL, QWEN2_5_VL = "qwen2_vl", "qwen2_5_vl"


def qwen2_vision_family(vision_config: Any) -> Optional[str]:
    """"qwen2_vl" / "qwen2_5_vl" for those towers' vision_config (a transformers config or a checkpoint's dict, whose
    model_type may be absent), else None. Qwen2.5-VL's lists fullatt_block_indexes; Qwen2-VL's has embed_dim."""
    kind = str(_field(vision_config, "model_type", "") or "")
    if kind.startswith(QWEN2_5_VL) or _field(vision_config, "fullatt_block_indexes") is not None:
        return QWEN2_5_VL
    if kind.startswith(QWEN2_VL) or _field(vision_config, "embed_dim") is not None:
        return QWEN2_VL
    return None


def qwen2_vision_dims(vision_config: Any) -> dict:
    """The tower's sizes under one naming: hidden (its width), intermediate (the MLP's), out (the merger's output),
    gated (a gate / up / down MLP), window_units (a window's side in merged squares; 0: no window attention) and
    full_blocks (the blocks that attend over the whole frame)."""
    f = lambda name, default=None: _field(vision_config, name, default)  # noqa: E731
    family = qwen2_vision_family(vision_config)
    depth = int(f("depth"))
    merge, patch = int(f("spatial_merge_size", 2)), int(f("patch_size"))
    if family == QWEN2_VL:
        hidden = int(f("embed_dim"))
        return dict(hidden=hidden, intermediate=int(hidden * float(f("mlp_ratio", 4))), out=int(f("hidden_size")),
                    gated=False, act=f("hidden_act", "quick_gelu"), window_units=0, full_blocks=frozenset(range(depth)))
    if family != QWEN2_5_VL:
        raise ValueError("not a Qwen2-VL or Qwen2.5-VL vision_config")
    window = int(f("window_size"))
    units = window // merge // patch
    if units < 1:
        raise ValueError(f"vision window_size {window} is smaller than one merged square ({merge} x {patch} pixels)")
    full = [int(i) for i in f("fullatt_block_indexes", None) or ()]
    if any(not 0 <= i < depth for i in full):
        raise ValueError(f"vision fullatt_block_indexes {full} must be block indices below the depth {depth}")
    return dict(hidden=int(f("hidden_size")), intermediate=int(f("intermediate_size")), out=int(f("out_hidden_size")),
                gated=True, act=f("hidden_act", "silu"), window_units=units, full_blocks=frozenset(full))


def window_layout(grids: Sequence[tuple[int, int, int]], merge: int, window_units: int
                  ) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's window attention over the images' merged squares (numbered in the processor's order): the squares
    in window order (image, frame, window row, window column, then row and column inside the window) and each
    window's patch count. window_units 0: one window per frame, in the processor's order."""
    order, lengths, first = [], [], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        squares = torch.arange(first, first + t * gh * gw).view(t, gh, gw)
        side_h, side_w = (window_units, window_units) if window_units else (gh, gw)
        for frame in squares:
            for r in range(0, gh, side_h):
                for c in range(0, gw, side_w):
                    window = frame[r:r + side_h, c:c + side_w].reshape(-1)
                    order.append(window)
                    lengths.append(window.numel() * merge * merge)
        first += t * gh * gw
    return torch.cat(order), lengths


def _rms_norm(norm: "_RMSNorm", x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight).to(x.dtype)


class _RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=torch.float32))


def _norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _rms_norm(norm, x) if isinstance(norm, _RMSNorm) else _layer_norm(norm, x)



class _Mlp(nn.Module):
    """Qwen2-VL's: fc1, activation, fc2."""

    def __init__(self, hidden: int, intermediate: int, act: str, dtype: torch.dtype):
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate, dtype=dtype)
        self.fc2 = nn.Linear(intermediate, hidden, dtype=dtype)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _GatedMlp(nn.Module):
    """Qwen2.5-VL's: down(act(gate(x)) * up(x)), each with a bias."""

    def __init__(self, hidden: int, intermediate: int, act: str, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, dtype=dtype)
        self.up_proj = nn.Linear(hidden, intermediate, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, dtype=dtype)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, dims: dict, heads: int, dtype: torch.dtype):
        super().__init__()
        hidden = dims["hidden"]
        norm = (lambda: _RMSNorm(hidden)) if dims["gated"] else (
            lambda: nn.LayerNorm(hidden, eps=1e-6, dtype=torch.float32))
        self.norm1, self.norm2 = norm(), norm()
        self.attn = _Attention(hidden, heads, dtype)
        mlp = _GatedMlp if dims["gated"] else _Mlp
        self.mlp = mlp(hidden, dims["intermediate"], dims["act"], dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]) -> torch.Tensor:
        x = x + self.attn(_norm(self.norm1, x), cos, sin, segments)
        return x + self.mlp(_norm(self.norm2, x))


class _Merger(nn.Module):
    """ln_q per patch (LayerNorm; Qwen2.5-VL: RMSNorm), then each square's merge**2 consecutive rows as one row ->
    mlp.0, GELU, mlp.2 (the checkpoint's nn.Sequential names)."""

    def __init__(self, hidden: int, merge: int, out: int, rms: bool, dtype: torch.dtype):
        super().__init__()
        self.square = hidden * merge * merge
        self.ln_q = _RMSNorm(hidden) if rms else nn.LayerNorm(hidden, eps=1e-6, dtype=torch.float32)
        self.mlp = nn.ModuleList([nn.Linear(self.square, self.square, dtype=dtype), nn.Identity(),
                                  nn.Linear(self.square, out, dtype=dtype)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _norm(self.ln_q, x).reshape(-1, self.square)
        return self.mlp[2](F.gelu(self.mlp[0](x)))


class Qwen2VisionTower(nn.Module):
    """Qwen2-VL's tower (transformers' Qwen2VisionTransformerPretrainedModel's math) or Qwen2.5-VL's
    (Qwen2_5_VisionTransformerPretrainedModel's), parameters named as the checkpoint's below "model.visual." /
    "visual."."""

    deepstack_levels = 0  # (no deepstack: forward_with_deepstack gives no levels)

    def __init__(self, vision_config: Any, dtype: torch.dtype):
        super().__init__()
        f = lambda name, default=None: _field(vision_config, name, default)  # noqa: E731
        dims = qwen2_vision_dims(vision_config)
        self.family = qwen2_vision_family(vision_config)
        self.hidden, self.out_hidden = dims["hidden"], dims["out"]
        self.heads = int(f("num_heads"))
        self.merge = int(f("spatial_merge_size", 2))
        self.in_channels = int(f("in_channels", 3))
        self.temporal_patch = int(f("temporal_patch_size", 2))
        self.patch = int(f("patch_size"))
        self.window_units = dims["window_units"]
        self.full_blocks = dims["full_blocks"]
        self.dtype = dtype
        rope = f("rope_parameters") or {}
        self.rope_theta = float(rope.get("rope_theta", 10000.0))
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision rope_type {rope.get('rope_type')!r} is not supported (only 'axial')")
        self.head_dim = self.hidden // self.heads if self.heads else 0
        if not self.heads or self.hidden % self.heads or self.head_dim % 4:
            raise ValueError(f"vision width {self.hidden} over num_heads {self.heads} must give a head size that is a "
                             "multiple of 4 (the axial rotary splits it between rows and columns)")
        if dims["act"] not in _ACTIVATIONS:
            raise ValueError(f"vision hidden_act {dims['act']!r} is not supported (supported: {sorted(_ACTIVATIONS)})")
        self.patch_dim = self.in_channels * self.temporal_patch * self.patch * self.patch
        self.patch_embed = _PatchEmbed(self.patch_dim, self.hidden, dtype, bias=False)
        self.blocks = nn.ModuleList(_Block(dims, self.heads, dtype) for _ in range(int(f("depth"))))
        self.merger = _Merger(self.hidden, self.merge, self.out_hidden, dims["gated"], dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint tensors named without the "model.visual." / "visual." prefix; every parameter must come."""
        load_tower_weights(self, weights)

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values: the images' processor rows, concatenated in the order of grids (their (t, h, w) patch
        grids). Returns [sum of image_token_count, out_hidden] in the tower's dtype, in the processor's order."""
        grids = [tuple(int(v) for v in g) for g in grids]
        for g in grids:
            image_token_count(g, self.merge)  # checks each grid divides into merge squares
        rows = sum(t * h * w for t, h, w in grids)
        if pixel_values.dim() != 2 or tuple(pixel_values.shape) != (rows, self.patch_dim):
            raise ValueError(f"pixel_values of shape {tuple(pixel_values.shape)} do not match the grids "
                             f"{grids}: expected ({rows}, {self.patch_dim})")
        device = self.patch_embed.proj.weight.device
        unit = self.merge * self.merge
        order, windows = window_layout(grids, self.merge, self.window_units)
        order = order.to(device)
        frames = [h * w for t, h, w in grids for _ in range(t)]  # (frames stay contiguous in window order)

        def windowed(x: torch.Tensor) -> torch.Tensor:  # the rows of each merged square, squares in window order
            return x.view(-1, unit, x.shape[-1]).index_select(0, order).view(-1, x.shape[-1])

        x = windowed(self.patch_embed.proj(pixel_values.to(device=device, dtype=self.dtype)))
        cos, sin = (windowed(r) for r in self._rotary(grids, device))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in self.full_blocks else windows)
        merged = self.merger(x)
        return torch.empty_like(merged).index_copy_(0, order, merged)  # back to the processor's order

    def forward_with_deepstack(self, pixel_values: torch.Tensor, grids: Sequence[tuple[int, int, int]]
                               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.forward(pixel_values, grids), []

    def _rotary(self, grids: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin rows [N, head_dim] in the processor's order, fp32: the first quarter of frequencies turn with the
        patch's row, the next with its column, the second half repeats the first (rotate_half pairing)."""
        quarter = self.head_dim // 4
        inv_freq = 1.0 / self.rope_theta ** (torch.arange(quarter, device=device, dtype=torch.float32) / quarter)
        angles = []
        for t, h, w in grids:
            rows, cols = patch_order(h, w, self.merge, device)
            angles.append(torch.cat((rows[:, None] * inv_freq, cols[:, None] * inv_freq), dim=-1).repeat(t, 1))
        a = torch.cat(angles)
        a = torch.cat((a, a), dim=-1)
        return a.cos(), a.sin()
