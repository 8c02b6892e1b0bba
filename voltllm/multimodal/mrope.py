"""Multimodal RoPE (M-RoPE): each token has a (t, h, w) position, and each frequency of the rotary half turns with
one of the three. Two rules split the frequencies between the axes:
- interleaved (Qwen3.5, Qwen3-VL): frequency j rotates by the h position when j % 3 == 1 (j < 3 * section_h), by w
  when j % 3 == 2 (j < 3 * section_w), else by t;
- contiguous (Qwen2-VL, Qwen2.5-VL): the first section_t frequencies by t, the next section_h by h, the last
  section_w by w.
Text tokens have t == h == w, so their rotation is plain 1-D RoPE either way: only image tokens need rows of their
own."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def time_positions(t: int, step: float) -> np.ndarray:
    """The time positions of a grid's t temporal patches past its start: floor(k x step), k x step in float32 as
    transformers' get_vision_position_ids computes it (Qwen2.5-VL's step, tokens_per_second x second_per_grid_ts,
    may be fractional)."""
    return (np.arange(t, dtype=np.float32) * np.float32(step)).astype(np.int64)


def prompt_positions(num_tokens: int, images: Sequence[tuple], spatial_merge_size: int) -> tuple[np.ndarray, int]:
    """M-RoPE positions [3, num_tokens] of a prompt whose images are (offset, grid_thw) or (offset, grid_thw, time
    step) in prompt order, and the delta of the tokens after it (position of token i = i + delta). As the Qwen
    models' get_rope_index (transformers', vLLM's): text runs continue from the running position; an image's
    tokens take (cur + time, cur + row, cur + col) over its merged grid, time being temporal patch k's
    time_positions (an image, or one of Qwen3.x's per-patch video grids, has t 1; a Qwen2-VL video's grid holds
    all its patches, step 1; Qwen2.5-VL's steps by tokens_per_second x second_per_grid_ts), after which the running
    position is one past the grid's largest: cur + max(last time + 1, h / merge, w / merge).

    (transformers 5's get_rope_index advances by max(h, w) / merge alone, so a video whose time positions pass its
    rows and columns gives the text after it positions that overlap the video's; the Qwen models' original code, and
    vLLM's, continue one past the largest, as here. The two agree for every image and for such videos as not.)"""
    pos = np.empty((3, num_tokens), dtype=np.int64)
    cur, at = 0, 0
    for item in images:
        offset, (t, h, w) = item[0], item[1]
        step = item[2] if len(item) > 2 else 1.0
        if offset < at:
            raise ValueError(f"image placeholders overlap or are out of order (one at {offset}, text up to {at})")
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        n = t * gh * gw
        if offset + n > num_tokens:
            raise ValueError(f"an image's {n} tokens at {offset} run past the prompt's {num_tokens}")
        pos[:, at:offset] = np.arange(offset - at) + cur
        cur += offset - at
        tt, hh, ww = np.meshgrid(time_positions(t, step), np.arange(gh), np.arange(gw), indexing="ij")
        pos[0, offset:offset + n] = tt.reshape(-1) + cur
        pos[1, offset:offset + n] = hh.reshape(-1) + cur
        pos[2, offset:offset + n] = ww.reshape(-1) + cur
        cur += max(int(tt.max()) + 1 if n else 0, gh, gw)
        at = offset + n
    pos[:, at:] = np.arange(num_tokens - at) + cur
    delta = int(pos.max()) + 1 - num_tokens if num_tokens else 0
    return pos, delta


def axis_of_frequency(half: int, section: Sequence[int], interleaved: bool = True) -> np.ndarray:
    """For each of the rotary half's `half` frequencies, the axis (0 t, 1 h, 2 w) whose position rotates it.
    Interleaved: as transformers applies the section, also when it does not add up to `half` (a small test model's).
    Contiguous: the sections in order, which must add up to `half` (transformers splits the frequencies by them)."""
    if len(section) != 3:
        raise ValueError(f"mrope_section must have 3 entries (t, h, w), got {list(section)}")
    if not interleaved:
        if sum(section) != half or min(section) < 0:
            raise ValueError(f"mrope_section {list(section)} must split the rotary half's {half} frequencies "
                             "(contiguous M-RoPE: its entries add up to head_dim / 2)")
        return np.repeat(np.arange(3, dtype=np.int64), section)
    j = np.arange(half)
    axis = np.zeros(half, dtype=np.int64)
    axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return axis


# model type -> (interleaved, transformers' default mrope_section when the config gives none)
_MROPE_LAYOUT = {"qwen3_5": (True, [11, 11, 10]), "qwen3_5_moe": (True, [11, 11, 10]),
                 "qwen4_exp": (True, [11, 11, 10]),  # (its text model is Qwen3.5-MoE's rotary)
                 "qwen3_vl": (True, [24, 20, 20]), "qwen3_vl_moe": (True, [24, 20, 20]),
                 "qwen2_vl": (False, [16, 24, 24]), "qwen2_5_vl": (False, [16, 24, 24])}


def mrope_layout(model_type: str, rope_parameters: dict) -> tuple[bool, list[int]]:
    """(interleaved, mrope_section) of a multimodal model's text rotary. The config's `mrope_interleaved` decides
    when it says (Qwen3.5's and Qwen3-VL's configs say true), else the model type (transformers' Qwen2-VL and
    Qwen2.5-VL are contiguous, its Qwen3.x interleaved); the section is the config's, else transformers' default."""
    if model_type not in _MROPE_LAYOUT:
        raise ValueError(f"no M-RoPE layout is known for model type {model_type!r}")
    interleaved, section = _MROPE_LAYOUT[model_type]
    flag = rope_parameters.get("mrope_interleaved")
    if flag is not None:
        interleaved = bool(flag)
    return interleaved, list(rope_parameters.get("mrope_section") or section)


def rotation_rows(positions: torch.Tensor, inv_freq: torch.Tensor, axis: torch.Tensor,
                  scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin rows [N, half] for tokens with (t, h, w) positions [3, N]: the rows a 1-D RoPE table would hold
    at a position, with each frequency taking its axis's position."""
    chosen = positions.to(torch.float64).index_select(0, axis.to(positions.device))  # [half, N]: per-frequency pos
    angles = chosen.t() * inv_freq.to(device=positions.device, dtype=torch.float64)
    return (angles.cos() * scale).float(), (angles.sin() * scale).float()
