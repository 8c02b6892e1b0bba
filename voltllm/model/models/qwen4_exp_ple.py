"""Qwen4-Exp Per-Layer Embedding (PLE): hashed token n-gram embeddings injected into the hyper-connection residual
of chosen linear-attention layers (transformers' Qwen4ExpTextNGramEmbedding / Qwen4ExpTextPLELayer).

Per step, once for the whole model (NGramContext): each token's window of the ngram_size previous tokens, taken
from the request's history (its last ngram_size - 1 tokens, a per-slot state; eos_token_id padding for a new
request), where the context resets after an EOS: shifted token s of position p is token[p - s] unless an EOS lies
in positions [p - s, p - 1], else eos_token_id.

Per PLE layer (ple_layer_index i over the model's PLE layers):
  ids_n,h  = (XOR_{s<n} window_s * m_s  mod  V_h) + offset_h      n = 2..ngram_size, heads_per_ngram heads h each;
             int64 wrap-around products; m_s from splitmix64(seed + 10007 i, s); V_h the (i * heads + h + 1)-th prime
             after ngram_vocab_size_base - 1
  e        = concat_h table[ids_h]                                 [T, ple_embed_dim]; the table stays in host memory
  gate_c   = signed_sqrt(<norm_key(e W_k)_c, norm_query(x)_c> / sqrt(H))   one per stream c (x: the hc * H residual)
  g        = sigmoid(gate_c) * (e W_v)                             [T, hc, H]
  out      = g + silu(dilated_depthwise_conv(norm_conv(g)))        kernel ple_conv_kernel_size, dilation ngram_size;
                                                                   state: the last (k - 1) * ngram_size normed rows
The layer adds `out` to the residual before its attention hyper-connection.

Memory: the n-gram tables are the checkpoint's largest tensors (~45B parameters in the real model, split over
split_ngram_parts shards per layer: `ple.ple_embedding.ngram_embedding.shard_<i>.weight`, concatenated here along
rows in shard order). They are kept in host (CPU) memory in the model dtype: the host needs the table's bytes (~90
GiB in bf16 for the real model) on top of everything else; the GPU holds none of it. Under tensor parallelism each
rank holds 1 / N of every table's columns (head_dim / N of each head's channels; ~90 / N GiB per rank's process): it
gathers its columns of the rows, key_proj / value_proj multiply them by their matching input columns and sum the
partial products over the ranks (_RankSum).

The gather (T x heads rows per layer per step) runs on the device, from row ids hashed on the device: on a GPU the
table is page-locked in place (cudaHostRegister) and read through a CUDA view of it (host_memory.device_view, unified
virtual addressing), so the kernel reads just the step's rows over the bus. Nothing in a step reads the device from
the host, and a decode step is captured in a CUDA graph like any other. Why not gather on the host before the step
into a staged device buffer: every n-gram includes the token itself, and under async scheduling a decode row's token
is the one the step in flight is still sampling (the runner fills it on the device, ModelRunner._fill_pending), so a
host gather would have to wait for that step, losing the overlap of the next step's host work with the GPU; a
device-resident table would not fit the GPU for the real model. The eager and graph forms run the same code.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

_MASK64 = (1 << 64) - 1
_SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
_SPLITMIX_M1 = 0xBF58476D1CE4E5B9
_SPLITMIX_M2 = 0x94D049BB133111EB
_PRIME_1 = 10007


def _splitmix64(value: int) -> int:
    value = (value + _SPLITMIX_GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _SPLITMIX_M1) & _MASK64
    value = ((value ^ (value >> 27)) * _SPLITMIX_M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def layer_multipliers(unigram_vocab_size: int, ngram_size: int, ple_layer_index: int, seed: int) -> list[int]:
    """The odd hash multiplier of each window position (< int64 max / vocab, so token * m never wraps)."""
    multiplier_max = ((1 << 63) - 1) // max(unigram_vocab_size, 1)
    half_bound = max(1, multiplier_max // 2)
    base_seed = seed + _PRIME_1 * ple_layer_index
    return [2 * (_splitmix64((base_seed + _SPLITMIX_GAMMA * (i + 1)) & _MASK64) % half_bound) + 1
            for i in range(ngram_size)]


def _is_prime(value: int) -> bool:
    if value < 2:
        return False
    if value % 2 == 0:
        return value == 2
    return all(value % d for d in range(3, math.isqrt(value) + 1, 2))


def primes_after(start: int, count: int) -> list[int]:
    """The first `count` primes greater than start."""
    out, p = [], start
    while len(out) < count:
        p += 1
        if _is_prime(p):
            out.append(p)
    return out


class ZeroCentredRMSNorm(nn.Module):
    """x / rms(x) * (1 + w) in fp32, over groups of `group` channels (the whole width when group is None)."""

    def __init__(self, width: int, eps: float, group: Optional[int] = None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width), requires_grad=False)
        self.eps = eps
        self.group = group or width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float().unflatten(-1, (-1, self.group))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = xf.flatten(-2) * (1.0 + self.weight.float())
        return out.to(x.dtype)


class NGramContext:
    """One step's n-gram windows for every PLE layer, and the per-slot token history they come from.

    state_ctx: the StateCache extra "ple_ctx" [rows, ngram_size - 1] int64 (the request's last tokens, oldest first).
    windows [ngram_size, T]: row s holds each token's shifted token s (row 0: the token itself), EOS-reset applied.
    A step of one token per request (decode, and every CUDA-graph step) takes device ops only: no index list
    uploaded, nothing read back, no shape from device data.
    """

    def __init__(self, input_ids: torch.Tensor, qsl: list[int], slots: torch.Tensor, has_initial: torch.Tensor,
                 state_ctx: torch.Tensor, ngram_size: int, eos: int):
        n_ctx = ngram_size - 1
        dev = input_ids.device
        ids = input_ids.long()
        n = len(qsl) - 1
        prev = torch.where(has_initial[:, None], state_ctx.index_select(0, slots),
                           torch.full((n, n_ctx), eos, dtype=torch.long, device=dev))  # [n, n_ctx]
        if ids.shape[0] == n:  # one token per request: its history is [its n_ctx previous tokens, itself]
            hist = torch.cat([prev, ids[:, None]], dim=1)  # [n, n_ctx + 1]

            def shifted_by(s: int) -> torch.Tensor:
                return hist[:, n_ctx - s]

            self.new_ctx = hist[:, 1:]
        else:
            hist, tok_pos, self.new_ctx = self._histories(ids, qsl, prev, n_ctx)

            def shifted_by(s: int) -> torch.Tensor:
                return hist.index_select(0, tok_pos - s)

        rows = [ids]
        valid = torch.ones_like(ids, dtype=torch.bool)
        for s in range(1, ngram_size):
            shifted = shifted_by(s)
            valid = valid & (shifted != eos)  # an EOS in [p - s, p - 1] ends the window
            rows.append(torch.where(valid, shifted, torch.full_like(shifted, eos)))
        self.windows = torch.stack(rows)

    @staticmethod
    def _histories(ids: torch.Tensor, qsl: list[int], prev: torch.Tensor, n_ctx: int):
        """Each request's history [its n_ctx previous tokens, its step tokens] back to back in one flat buffer:
        (the buffer, each step token's place in it, each request's last n_ctx tokens [n, n_ctx])."""
        dev, n = ids.device, len(qsl) - 1
        hist = torch.empty(n * n_ctx + ids.shape[0], dtype=torch.long, device=dev)
        tok_at, ctx_at, end_at = [], [], []
        for i in range(n):
            base = qsl[i] + i * n_ctx
            ctx_at.extend(range(base, base + n_ctx))
            tok_at.extend(range(base + n_ctx, base + n_ctx + qsl[i + 1] - qsl[i]))
            end = base + n_ctx + qsl[i + 1] - qsl[i]
            end_at.extend(range(end - n_ctx, end))
        index = torch.tensor(tok_at + ctx_at + end_at, dtype=torch.long, device=dev)
        t = ids.shape[0]
        tok_pos, ctx_pos, end_pos = index[:t], index[t:t + n * n_ctx], index[t + n * n_ctx:]
        hist.index_copy_(0, tok_pos, ids)
        hist.index_copy_(0, ctx_pos, prev.reshape(-1))
        return hist, tok_pos, hist.index_select(0, end_pos).view(n, n_ctx)

    def save(self, state_ctx: torch.Tensor, slots: torch.Tensor) -> None:
        state_ctx.index_copy_(0, slots, self.new_ctx)


class _RankSum(nn.Linear):
    """A linear layer over this rank's input columns whose partial products are summed over the ranks."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, tp):
        super().__init__(in_features, out_features, bias=False, dtype=dtype)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce_(super().forward(x))


class PLELayer(nn.Module):
    def __init__(self, cfg: Any, ple_layer_index: int, dtype: torch.dtype, tp=None):
        """tp: this rank's tensor-parallel group (its columns of the table, module docstring); None: all."""
        super().__init__()
        self.hidden = cfg.hidden_size
        self.hc = cfg.hc_count
        width = self.hc * self.hidden
        embed = cfg.ple_embed_dim or cfg.hidden_size
        self.ngram_size = cfg.ngram_size
        self.heads_per_ngram = cfg.heads_per_ngram
        heads = (self.ngram_size - 1) * self.heads_per_ngram
        self.head_dim = embed // heads
        rank, size = (tp.rank, tp.size) if tp is not None else (0, 1)
        if self.head_dim % size:
            raise ValueError(f"Qwen4-Exp PLE: the n-gram heads' {self.head_dim} channels do not divide by the {size} "
                             "tensor-parallel ranks")
        self.heads = heads
        self.cols = (rank * (self.head_dim // size), self.head_dim // size)  # (first, count) of each head's channels
        sizes = primes_after(cfg.ngram_vocab_size_base - 1, (ple_layer_index + 1) * heads)[-heads:]
        offsets = [sum(sizes[:h]) for h in range(heads)]
        div = cfg.make_ngram_vocab_size_divisible_by
        self.table_rows = -(-sum(sizes) // div) * div
        self.split_parts = cfg.split_ngram_parts
        # the checkpoint's shards: torch.chunk of the rows (transformers' save), so some counts give fewer pieces
        self.num_shards = -(-self.table_rows // -(-self.table_rows // self.split_parts))
        self.multipliers = layer_multipliers(cfg.vocab_size, self.ngram_size, ple_layer_index, cfg.seed)
        self.register_buffer("vocab_sizes", torch.tensor(sizes, dtype=torch.long), persistent=False)
        self.register_buffer("offsets", torch.tensor(offsets, dtype=torch.long), persistent=False)
        # host memory, outside the module's parameters (model.to(device) leaves it there): see the module docstring
        self.table = torch.zeros(self.table_rows, self.cols[1], dtype=dtype, device="cpu")
        self._view: Optional[torch.Tensor] = None  # a GPU's CUDA view of it (readable_table)
        local = heads * self.cols[1]
        self.key_proj = (nn.Linear(embed, width, bias=False, dtype=dtype) if tp is None else
                         _RankSum(local, width, dtype, tp))
        self.value_proj = (nn.Linear(embed, self.hidden, bias=False, dtype=dtype) if tp is None else
                           _RankSum(local, self.hidden, dtype, tp))
        eps = cfg.rms_norm_eps
        self.norm_key = ZeroCentredRMSNorm(width, eps, self.hidden)
        self.norm_query = ZeroCentredRMSNorm(width, eps, self.hidden)
        self.norm_conv = ZeroCentredRMSNorm(width, eps, self.hidden)
        self.kernel = cfg.ple_conv_kernel_size
        self.dilation = self.ngram_size
        self.conv_rows = (self.kernel - 1) * self.dilation
        self.conv_weight = nn.Parameter(torch.zeros(width, self.kernel, dtype=dtype), requires_grad=False)

    # -- the n-gram embedding ---------------------------------------------------------------------
    def ngram_ids(self, windows: torch.Tensor) -> torch.Tensor:
        """windows [ngram_size, T] -> row ids [T, heads] into the table (transformers' hashing, bit for bit)."""
        blocks = []
        for n in range(2, self.ngram_size + 1):
            mixed = windows[0] * self.multipliers[0]
            for s in range(1, n):
                mixed = torch.bitwise_xor(mixed, windows[s] * self.multipliers[s])
            h0 = (n - 2) * self.heads_per_ngram
            sizes = self.vocab_sizes[h0:h0 + self.heads_per_ngram]
            blocks.append(torch.remainder(mixed.unsqueeze(-1), sizes) + self.offsets[h0:h0 + self.heads_per_ngram])
        return torch.cat(blocks, dim=-1)

    def embed(self, windows: torch.Tensor) -> torch.Tensor:
        """[T, ple_embed_dim]: each token's rows of the table, gathered on windows' device (module docstring)."""
        ids = self.ngram_ids(windows)
        return self.readable_table(windows.device).index_select(0, ids.reshape(-1)).view(ids.shape[0], -1)

    def readable_table(self, device: torch.device) -> torch.Tensor:
        """The table as `device`'s kernels read it: off the GPU the table itself; on a GPU a CUDA view of it, the
        table page-locked in place on the first call (which must come before any CUDA-graph capture: the model's
        place_tables) and unlocked when this layer is collected. The view stays valid through load_table_shard's
        in-place copies (a sleep-mode reload)."""
        if device.type != "cuda":
            return self.table
        if device.index is None:  # "cuda" names the current device; the view's device always has its index
            device = torch.device("cuda", torch.cuda.current_device())
        if self._view is None:
            from voltllm.host_memory import device_view, page_lock_for

            try:
                page_lock_for(self, self.table)
            except RuntimeError as e:
                gib = self.table.numel() * self.table.element_size() / 2**30
                raise RuntimeError(f"Qwen4-Exp PLE: page-locking the {gib:.2f} GiB n-gram table in host memory, "
                                   f"which the GPU reads in place, failed ({e})") from None
            self._view = device_view(self.table, device).view(self.table.dtype).view(self.table.shape)
        elif self._view.device != device:
            raise RuntimeError(f"Qwen4-Exp PLE: the n-gram table is read by {self._view.device}, not {device}")
        return self._view

    def load_table_shard(self, index: Optional[int], tensor: torch.Tensor, name: str) -> None:
        """Shard `index` of the table (torch.chunk of the rows into split_ngram_parts), or the whole (None)."""
        if index is None:
            start, rows = 0, self.table_rows
        else:
            per = -(-self.table_rows // self.split_parts)
            start = index * per
            rows = min(per, self.table_rows - start)
        if tuple(tensor.shape) != (rows, self.head_dim):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {(rows, self.head_dim)} (an n-gram table "
                             f"of {self.table_rows} rows in {self.split_parts} shards)")
        first, n = self.cols
        self.table[start:start + rows].copy_(tensor[:, first:first + n])

    def local_proj_cols(self, weight: torch.Tensor) -> torch.Tensor:
        """key_proj's / value_proj's input columns of this rank's table columns (every head's [first, first + n))."""
        first, n = self.cols
        if n == self.head_dim:
            return weight
        return weight.unflatten(1, (self.heads, self.head_dim))[:, :, first:first + n].flatten(1)

    # -- forward -------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, windows: torch.Tensor, conv_state: torch.Tensor, batch: Any,
                checkpoints: Any = None) -> torch.Tensor:
        """x [T, hc * H] (the residual); conv_state: this layer's rows of the "ple_conv" extra [rows, K', hc * H]
        (updated in place); checkpoints: in a speculative verification step, (gdn_verify.WindowCheckpoints, this
        layer's whole "ple_conv" row space), whose checkpoint rows get the state after each draft's position.
        Returns what to add to x."""
        t = x.shape[0]
        e = self.embed(windows).to(x.dtype)
        key = self.norm_key(self.key_proj(e)).view(t, self.hc, self.hidden)
        value = self.value_proj(e)
        query = self.norm_query(x).view(t, self.hc, self.hidden)
        gate = (key * query).sum(-1, keepdim=True) / math.sqrt(self.hidden)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)  # [T, hc * H]
        normed = self.norm_conv(gated)
        if checkpoints is not None:  # (before the conv moves the slots on)
            plan, rows = checkpoints
            plan.save(normed, conv_state, rows)
        return gated + F.silu(self._dilated_conv(normed, conv_state, batch))

    def _dilated_conv(self, x: torch.Tensor, conv_state: torch.Tensor, batch: Any) -> torch.Tensor:
        """Causal depthwise conv (dilation ngram_size) per request over [its state rows, its step rows]; the
        state then keeps the last conv_rows inputs (zeros before a request's first token)."""
        qsl, k, d, r = batch.query_start_loc, self.kernel, self.dilation, self.conv_rows
        n = len(qsl) - 1
        prev = conv_state.index_select(0, batch.slots)  # [n, r, C]
        prev = torch.where(batch.has_initial_state[:, None, None], prev, torch.zeros_like(prev))
        w = self.conv_weight.to(x.dtype)
        if x.shape[0] == n:  # one row per request (decode, CUDA graphs): all requests at once, the same products
            seq = torch.cat([prev, x[:, None]], dim=1)  # [n, r + 1, C]
            acc = torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device)
            for j in range(k):
                acc += seq[:, r - (k - 1 - j) * d].float() * w[:, j].float()
            conv_state.index_copy_(0, batch.slots, seq[:, 1:].to(conv_state.dtype))
            return acc.to(x.dtype)
        outs, tails = [], []
        for i in range(n):
            seq = torch.cat([prev[i], x[qsl[i]:qsl[i + 1]]])  # [r + len, C]
            ln = qsl[i + 1] - qsl[i]
            # out[p] = sum_j w[:, j] * seq[r + p - (k - 1 - j) * d]
            acc = torch.zeros(ln, x.shape[1], dtype=torch.float32, device=x.device)
            for j in range(k):
                start = r - (k - 1 - j) * d
                acc += seq[start:start + ln].float() * w[:, j].float()
            outs.append(acc.to(x.dtype))
            tails.append(seq[-r:])
        conv_state.index_copy_(0, batch.slots, torch.stack(tails).to(conv_state.dtype))
        return torch.cat(outs)
