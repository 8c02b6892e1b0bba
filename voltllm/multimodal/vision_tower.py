"""Qwen3.5's and Qwen3-VL's vision encoder: image patches -> rows of the text model's hidden size, one per merged 2x2
patch window.

The processor (transformers' Qwen2-VL image processor) gives each image as t*h*w rows, one flattened
(channel, temporal, patch, patch) patch each, laid out window by window: the patches of each spatial_merge_size
square are consecutive. The tower keeps that order throughout: a linear patch embedding, a learned position table
resampled bilinearly to the image's grid, blocks of non-causal attention (within one frame of one image) with an
axial (row, column) rotary, and the merger, which turns each window's consecutive rows into one output row.
Qwen3-VL's tower is the same plus deepstack: after each block listed in `deepstack_visual_indexes` a merger of its own
(LayerNorm over the whole merged window instead of per patch) turns that block's output into one more set of rows,
which the text model adds to the image tokens' hidden states after its first layers (models/llama.py).

LayerNorm and the rotary run in fp32 whatever the tower's dtype; attention runs in the tower's dtype through
scaled_dot_product_attention, whose fused kernels keep the softmax and its sums in fp32."""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

VISUAL_PREFIXES = ("model.visual.", "visual.")
_ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
                "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "silu": F.silu}


def _field(cfg: Any, name: str, default: Any = None) -> Any:
    """A vision_config field, whether the config is a transformers config object or a plain dict."""
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


def image_token_count(grid_thw: Sequence[int], merge: int) -> int:
    """Tokens an image of patch grid (t, h, w) takes in the prompt: one per merge x merge window."""
    t, h, w = (int(v) for v in grid_thw)
    if h % merge or w % merge:
        raise ValueError(f"image grid {tuple(grid_thw)} is not a multiple of the spatial merge size {merge}")
    return t * h * w // (merge * merge)


def _layer_norm(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x.float(), norm.normalized_shape, norm.weight, norm.bias, norm.eps).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on [N, heads, head_dim] with cos / sin rows [N, head_dim] (halves paired as in rotate_half), in fp32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def _segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[int]) -> torch.Tensor:
    """Non-causal attention of [N, heads, head_dim] rows within consecutive segments (a frame of an image, or a
    Qwen2.5-VL window): the segments of one length run as one batched call (an image has hundreds of windows but at
    most four window sizes)."""
    out = torch.empty_like(q)
    starts: dict[int, list[int]] = {}
    at = 0
    for length in segments:
        starts.setdefault(length, []).append(at)
        at += length
    for length, firsts in starts.items():
        if not length:
            continue
        rows = (torch.tensor(firsts, device=q.device)[:, None] + torch.arange(length, device=q.device)).reshape(-1)
        pick = lambda x: x.index_select(0, rows).view(len(firsts), length, *x.shape[1:]).transpose(1, 2)  # noqa: E731
        o = F.scaled_dot_product_attention(pick(q), pick(k), pick(v))  # [segments, heads, length, head_dim]
        out.index_copy_(0, rows, o.transpose(1, 2).reshape(-1, *q.shape[1:]))
    return out


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, dtype: torch.dtype):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, dtype=dtype)
        self.proj = nn.Linear(hidden, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)  # each [N, heads, head_dim]
        out = _segment_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, segments)
        return self.proj(out.reshape(n, -1))

class _Mlp(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, dtype: torch.dtype):
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, intermediate, dtype=dtype)
        self.linear_fc2 = nn.Linear(intermediate, hidden, dtype=dtype)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, act: str, dtype: torch.dtype):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, eps=1e-6, dtype=torch.float32)
        self.norm2 = nn.LayerNorm(hidden, eps=1e-6, dtype=torch.float32)
        self.attn = _Attention(hidden, heads, dtype)
        self.mlp = _Mlp(hidden, intermediate, act, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]) -> torch.Tensor:
        x = x + self.attn(_layer_norm(self.norm1, x), cos, sin, segments)
        return x + self.mlp(_layer_norm(self.norm2, x))


class _Merger(nn.Module):
    """LayerNorm per patch (norm_window: over the merged window, Qwen3-VL's deepstack mergers), then each window's
    merge**2 consecutive rows as one row -> linear, GELU, linear."""

    def __init__(self, hidden: int, merge: int, out_hidden: int, dtype: torch.dtype, norm_window: bool = False):
        super().__init__()
        self.window = hidden * merge * merge
        self.norm_window = norm_window
        self.norm = nn.LayerNorm(self.window if norm_window else hidden, eps=1e-6, dtype=torch.float32)
        self.linear_fc1 = nn.Linear(self.window, self.window, dtype=dtype)
        self.linear_fc2 = nn.Linear(self.window, out_hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_window:
            x = _layer_norm(self.norm, x.reshape(-1, self.window))
        else:
            x = _layer_norm(self.norm, x).reshape(-1, self.window)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class _PatchEmbed(nn.Module):
    def __init__(self, patch_dim: int, hidden: int, dtype: torch.dtype, bias: bool = True):
        super().__init__()
        # The checkpoint's Conv3d has stride == kernel over exactly one kernel's worth of input: a linear map.
        self.proj = nn.Linear(patch_dim, hidden, bias=bias, dtype=dtype)


def patch_order(h: int, w: int, merge: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each patch of an h x w grid in the processor's window-by-window order (the patches of each
    merge x merge square consecutive)."""
    m = merge
    rows = torch.arange(h, device=device).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
    cols = torch.arange(w, device=device).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
    return rows.permute(0, 2, 1, 3).reshape(-1), cols.permute(0, 2, 1, 3).reshape(-1)


def load_tower_weights(tower: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors (named without the "model.visual." / "visual." prefix) into a tower's parameters;
    every parameter must come, and no other tensor."""
    params = dict(tower.named_parameters())
    loaded, unknown = set(), []
    for name, tensor in weights:
        param = params.get(name)
        if param is None:
            unknown.append(name)
            continue
        if name == "patch_embed.proj.weight":
            tensor = tensor.reshape(tensor.shape[0], -1)  # Conv3d [out, C, T, P, P] -> [out, C*T*P*P]
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"vision tensor {name} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(param.shape)} from the vision_config")
        with torch.no_grad():
            param.copy_(tensor.to(device=param.device, dtype=param.dtype))
        loaded.add(name)
    if unknown:
        raise ValueError(f"unknown vision tensors in the checkpoint: {sorted(unknown)}")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"vision tensors missing from the checkpoint: {missing}")


class VisionTower(nn.Module):
    """Qwen3.5's vision encoder (transformers' Qwen3_5VisionModel's math), with Qwen3-VL's deepstack mergers when the
    config lists deepstack_visual_indexes (Qwen3VLVisionModel's), parameters named as the checkpoint's below its
    "model.visual." prefix."""

    def __init__(self, vision_config: Any, dtype: torch.dtype):
        super().__init__()
        f = lambda name, default=None: _field(vision_config, name, default)  # noqa: E731
        self.hidden = int(f("hidden_size"))
        self.heads = int(f("num_heads"))
        self.merge = int(f("spatial_merge_size", 2))
        self.in_channels = int(f("in_channels", 3))
        self.temporal_patch = int(f("temporal_patch_size", 2))
        self.patch = int(f("patch_size"))
        self.out_hidden = int(f("out_hidden_size"))
        self.dtype = dtype
        act = f("hidden_act", "gelu_pytorch_tanh")
        positions = int(f("num_position_embeddings"))
        self.side = math.isqrt(positions)
        rope = f("rope_parameters") or {}
        self.rope_theta = float(rope.get("rope_theta", 10000.0))
        head_dim = self.hidden // self.heads if self.heads else 0
        if not self.heads or self.hidden % self.heads or head_dim % 4:
            raise ValueError(f"vision hidden_size {self.hidden} over num_heads {self.heads} must give a head size "
                             "that is a multiple of 4 (the axial rotary splits it between rows and columns)")
        if self.side * self.side != positions:
            raise ValueError(f"vision num_position_embeddings {positions} is not a square grid")
        if act not in _ACTIVATIONS:
            raise ValueError(f"vision hidden_act {act!r} is not supported (supported: {sorted(_ACTIVATIONS)})")
        depth = int(f("depth"))
        # block index -> its deepstack merger (the one at the index's place in the list); the levels are in block order
        deepstack = [int(i) for i in f("deepstack_visual_indexes", None) or ()]
        if len(set(deepstack)) != len(deepstack) or any(not 0 <= i < depth for i in deepstack):
            raise ValueError(f"vision deepstack_visual_indexes {deepstack} must be distinct block indices below the "
                             f"depth {depth}")
        self.deepstack_merger_of_block = {i: deepstack.index(i) for i in deepstack}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision rope_type {rope.get('rope_type')!r} is not supported (only 'axial')")
        self.head_dim = head_dim
        self.patch_dim = self.in_channels * self.temporal_patch * self.patch * self.patch
        self.patch_embed = _PatchEmbed(self.patch_dim, self.hidden, dtype)
        self.pos_embed = nn.Embedding(positions, self.hidden, dtype=dtype)
        self.blocks = nn.ModuleList(_Block(self.hidden, self.heads, int(f("intermediate_size")), act, dtype)
                                    for _ in range(depth))
        self.merger = _Merger(self.hidden, self.merge, self.out_hidden, dtype)
        if deepstack:  # (absent for Qwen3.5: its checkpoints have no deepstack_merger_list tensors)
            self.deepstack_merger_list = nn.ModuleList(
                _Merger(self.hidden, self.merge, self.out_hidden, dtype, norm_window=True) for _ in deepstack)

    @property
    def deepstack_levels(self) -> int:
        """How many sets of deepstack rows forward_with_deepstack gives (0: a Qwen3.5 tower)."""
        return len(self.deepstack_merger_of_block)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint tensors named without the "model.visual." / "visual." prefix; every parameter must come."""
        load_tower_weights(self, weights)

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values: the images' processor rows, concatenated in the order of grids (their (t, h, w) patch
        grids). Returns [sum of image_token_count, out_hidden_size] in the tower's dtype."""
        return self.forward_with_deepstack(pixel_values, grids)[0]

    def forward_with_deepstack(self, pixel_values: torch.Tensor, grids: Sequence[tuple[int, int, int]]
                               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """forward's rows, and the deepstack rows of each level (deepstack_levels of them, each shaped as the rows:
        level k is added to the image tokens' hidden states after text decoder layer k)."""
        grids = [tuple(int(v) for v in g) for g in grids]
        for g in grids:
            image_token_count(g, self.merge)  # checks each grid divides into merge windows
        rows = sum(t * h * w for t, h, w in grids)
        if pixel_values.dim() != 2 or tuple(pixel_values.shape) != (rows, self.patch_dim):
            raise ValueError(f"pixel_values of shape {tuple(pixel_values.shape)} do not match the grids "
                             f"{grids}: expected ({rows}, {self.patch_dim})")
        device = self.pos_embed.weight.device
        x = self.patch_embed.proj(pixel_values.to(device=device, dtype=self.dtype))
        x = x + self._position_embeddings(grids, device).to(self.dtype)
        cos, sin = self._rotary(grids, device)
        segments = [h * w for t, h, w in grids for _ in range(t)]
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, segments)
            merger = self.deepstack_merger_of_block.get(i)
            if merger is not None:
                deepstack.append(self.deepstack_merger_list[merger](x))
        return self.merger(x), deepstack

    def _position_embeddings(self, grids: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
        """The learned side x side table resampled (bilinear, corners aligned) to each grid, in window order, fp32."""
        table = self.pos_embed.weight.float().t().reshape(1, self.hidden, self.side, self.side)
        parts = []
        for t, h, w in grids:
            grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]  # [hidden, h, w]
            rows, cols = patch_order(h, w, self.merge, device)
            parts.append(grid[:, rows, cols].t().repeat(t, 1))
        return torch.cat(parts)

    def _rotary(self, grids: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin rows [N, head_dim], fp32: the first quarter of frequencies turn with the patch's row, the next
        with its column, and the second half repeats the first (rotate_half pairing)."""
        quarter = self.head_dim // 4
        inv_freq = 1.0 / self.rope_theta ** (torch.arange(quarter, device=device, dtype=torch.float32) / quarter)
        angles = []
        for t, h, w in grids:
            rows, cols = patch_order(h, w, self.merge, device)
            a = torch.cat((rows[:, None] * inv_freq, cols[:, None] * inv_freq), dim=-1)
            angles.append(a.repeat(t, 1))
        a = torch.cat(angles)
        a = torch.cat((a, a), dim=-1)
        return a.cos(), a.sin()


def deepstack_levels(hf_config: Any) -> int:
    """How many sets of deepstack rows the model's tower gives (Qwen3-VL; 0 for Qwen3.5 or no vision_config)."""
    vision_config = _field(hf_config, "vision_config")
    return 0 if vision_config is None else len(_field(vision_config, "deepstack_visual_indexes", None) or ())


def vision_tower_for(hf_config: Any, dtype: torch.dtype) -> Optional[nn.Module]:
    """The (unloaded) vision tower of a model config, or None when it has no vision_config: Qwen2-VL's or
    Qwen2.5-VL's (multimodal/qwen2_vision_tower.py) for their vision_config, else Qwen3.5's / Qwen3-VL's."""
    vision_config = _field(hf_config, "vision_config")
    if vision_config is None:
        return None
    from voltllm.multimodal.qwen2_vision_tower import Qwen2VisionTower, qwen2_vision_family

    if qwen2_vision_family(vision_config) is not None:
        return Qwen2VisionTower(vision_config, dtype)
    return VisionTower(vision_config, dtype)


def load_vision_tower(model_dir: str, hf_config: Any, dtype: torch.dtype, device: Any,
                      mmproj: Optional[str] = None) -> nn.Module:
    """Build the tower on `device` and load only the checkpoint's visual tensors into it (mmproj: from that
    llama.cpp projector file instead, model/loader/gguf_mmproj.py)."""
    from voltllm.model.loader.safetensors_loader import safetensors_weights

    with torch.device("meta"):  # no throwaway random init: load_weights fills every parameter
        tower = vision_tower_for(hf_config, dtype)
    if tower is None:
        raise ValueError(f"the model at {model_dir} has no vision_config: it takes no image input")
    tower = tower.to_empty(device=device)
    if mmproj is not None:
        from voltllm.model.loader.gguf_mmproj import mmproj_weights, read_mmproj

        tower.load_weights(mmproj_weights(read_mmproj(mmproj)))
        return tower.eval().requires_grad_(False)
    weights = safetensors_weights(model_dir, only=lambda name: name.startswith(VISUAL_PREFIXES))
    tower.load_weights((_strip_prefix(name), tensor) for name, tensor in weights)
    return tower.eval().requires_grad_(False)  # inference only: kept rows must not hold an autograd graph


def _strip_prefix(name: str) -> str:
    for prefix in VISUAL_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name
