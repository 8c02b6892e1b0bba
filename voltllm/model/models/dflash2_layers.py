"""What DFlash2 adds to the DFlash drafter: grouped dynamic causal convolutions around every sublayer, and the
candidate selector that picks the block's drafts (configuration: voltllm/engine/dflash.py).

The convolution runs along the block's rows (the known token, then the mask rows), causally, zeros before the
block's first row: out[t] = sum over taps o of (base[o] + dynamic[t, o, group]) * x[t - o], with a static weight per
channel (`base_kernel` [2, taps, hidden]: the first half for the sublayer's input, the second for its output) and a
dynamic one per group of `conv_group_size` channels computed from the sublayer's normed input
(`kernel_projection` [2 * taps * groups, hidden]; the first half weights the input's convolution, the second the
output's). The context (the target's hidden states) is not convolved, so the drafter's context K / V are DFlash's.

The block's rows are decode rows of the paged attention (model/models/dflash.py), one request's rows consecutive
and in order, so row t's tap o is row t - o when that row belongs to the same block. That is read off the rows
themselves (`block_taps`; on a GPU inside the convolution's kernel, kernels/dflash2_conv.py): every row of a block
has the same context length (the whole block), and its positions step by one; rows of two blocks never meet both
conditions, and a graph's padding rows (position 0, one token of context) never do.

The selector replaces each draft's argmax: among the top `selector_top_k` tokens of every draft row it walks the
block from the known token, choosing at each position the candidate b with the largest
logit(b) + sum_r P[a, r] * h[r] * S[b, r], where a is the token chosen before it, P / S the predecessor / successor
codebooks [vocab, rank] and h the row's final hidden state through `hidden_projection` [rank, hidden].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from voltllm.model.forward_context import ForwardContext
from voltllm.model.models.llama import DecoderLayer, LlamaForCausalLM, residual_stream

ROWS_KEY = "dflash2_rows"  # ForwardContext.extra: the forward's BlockRows


def block_taps(positions: torch.Tensor, seq_lens: torch.Tensor, taps: int) -> list[Optional[torch.Tensor]]:
    """For each tap o (0 .. taps - 1): a [rows, 1] float mask, 1 where row t - o is in row t's block (None for o =
    0: every row is its own tap 0). Device tensors only, so a CUDA graph captures it."""
    out: list[Optional[torch.Tensor]] = [None]
    n = positions.shape[0]
    lens = seq_lens[:n]
    for o in range(1, taps):
        valid = torch.zeros(n, dtype=torch.bool, device=positions.device)
        if n > o:
            valid[o:] = (lens[o:] == lens[:-o]) & (positions[o:] - positions[:-o] == o)
        out.append(valid.to(torch.float32)[:, None])
    return out


@dataclass
class BlockRows:
    """What tells the convolutions which rows are a block's: the forward's positions and context lengths (the GPU
    kernel reads them itself; the torch form turns them into per-tap masks once per forward)."""
    positions: torch.Tensor
    seq_lens: torch.Tensor
    taps: int
    _masks: Optional[list] = None

    def masks(self) -> list[Optional[torch.Tensor]]:
        if self._masks is None:
            self._masks = block_taps(self.positions, self.seq_lens, self.taps)
        return self._masks


class GroupedDynamicConv(nn.Module):
    def __init__(self, hidden: int, taps: int, group_size: int, dtype: torch.dtype):
        super().__init__()
        self.taps, self.groups, self.group_size = taps, hidden // group_size, group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden, dtype=dtype), requires_grad=False)
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False, dtype=dtype)

    def prepare(self, x: torch.Tensor, rows: BlockRows) -> tuple[torch.Tensor, torch.Tensor]:
        """The sublayer's convolved input, and the dynamic weights its output's convolution takes ([rows, taps,
        groups])."""
        dynamic = self.kernel_projection(x).float().view(x.shape[0], 2, self.taps, self.groups)
        return self._convolve(x, dynamic[:, 0], self.base_kernel[0], rows), dynamic[:, 1]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor, rows: BlockRows) -> torch.Tensor:
        return self._convolve(x, dynamic, self.base_kernel[1], rows)

    def _convolve(self, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, rows: BlockRows) -> torch.Tensor:
        if x.is_cuda:  # one launch (kernels/dflash2_conv.py)
            from voltllm.kernels.dflash2_conv import block_conv

            return block_conv(x, dynamic, base, rows.positions, rows.seq_lens)
        return conv_torch(x, dynamic, base, rows.masks(), self.group_size)


def conv_torch(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, masks: list, group_size: int
               ) -> torch.Tensor:
    """The convolution in torch (the CPU path, the GPU kernel's reference): x [T, H], dynamic [T, taps, groups]
    fp32, base [taps, H], masks from block_taps."""
    n, hidden = x.shape
    taps, groups = dynamic.shape[1], hidden // group_size
    xf = x.float()
    out = torch.zeros(n, groups, group_size, dtype=torch.float32, device=x.device)
    for o in range(taps):
        if o == 0:
            shifted = xf
        else:  # row t - o of the same block, zeros where there is none
            shifted = torch.cat([xf.new_zeros(min(o, n), hidden), xf[:max(n - o, 0)]]) * masks[o]
        weight = base[o].float().view(1, groups, group_size) + dynamic[:, o, :, None]
        out += weight * shifted.view(n, groups, group_size)
    return out.view(n, hidden).to(x.dtype)


class DFlash2DecoderLayer(DecoderLayer):
    """A Qwen3 decoder layer with DFlash2's convolutions around its attention and its MLP (unfused path only)."""

    def __init__(self, cfg: Any, idx: int, dtype: torch.dtype, *args, **kwargs):
        super().__init__(cfg, idx, dtype, *args, **kwargs)
        taps, group = cfg.conv_kernel_size, cfg.conv_group_size
        self.attention_conv = GroupedDynamicConv(cfg.hidden_size, taps, group, dtype)
        self.mlp_conv = GroupedDynamicConv(cfg.hidden_size, taps, group, dtype)

    def forward(self, positions, x, residual, ctx, fused: bool = False):
        rows = ctx.extra[ROWS_KEY]
        if residual is None:
            residual = residual_stream(x)
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x, post = self.attention_conv.prepare(x, rows)
        x = self.attention_conv.finish(self.self_attn(positions, x, ctx), post, rows)
        x, residual = self.post_attention_layernorm(x, residual)
        x, post = self.mlp_conv.prepare(x, rows)
        return self.mlp_conv.finish(self.mlp(x), post, rows), residual


class DFlash2Body(LlamaForCausalLM):
    """The drafter's decoder (Qwen3 layers with convolutions); its config carries conv_kernel_size and
    conv_group_size at the top level."""
    decoder_layer_cls = DFlash2DecoderLayer

    def fused_decode(self, input_ids: torch.Tensor) -> bool:
        return False  # (the fused one-row path has no place for the convolutions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        ctx.extra[ROWS_KEY] = BlockRows(positions, ctx.meta.seq_lens, self.config.conv_kernel_size)
        return super().forward(input_ids, positions, ctx)


class CandidateSelector(nn.Module):
    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int, dtype: torch.dtype):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank, dtype=dtype), requires_grad=False)
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank, dtype=dtype), requires_grad=False)
        self.hidden_projection = nn.Linear(hidden, rank, bias=False, dtype=dtype)

    def select(self, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """The drafts of n blocks: hidden / logits [kmax * n, ...] of the draft rows (draft-major: draft j of block
        i at j * n + i), anchors [n] the blocks' known tokens. Returns [kmax, n] token ids (fp32 scores; the walk in
        one Triton launch on a GPU, kernels/dflash2_select.py)."""
        from voltllm.kernels.dflash2_select import walk, walk_torch

        unary, cand = logits.float().topk(self.top_k, dim=-1)  # (descending: a tie keeps the higher logit)
        proj = self.hidden_projection(hidden).float()
        return (walk if logits.is_cuda else walk_torch)(cand, unary, proj, self.predecessor_codebook,
                                                         self.successor_codebook, anchors)
