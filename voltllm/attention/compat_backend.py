"""Compat-route (SM70/SM75) prefill: bridge each request's KV pages into an fp16 workspace, then torch SDPA.

On V100/T4 Triton's tl.dot is FMA (no tensor cores), so compute-bound prefill attention goes to a
vendor kernel instead: torch's scaled_dot_product_attention with the memory-efficient (cutlass) kernel,
which runs on SM70 tensor cores. That kernel needs contiguous K/V, so for every request with more than
one query row this step:

1. bridge: one Triton launch (voltllm.kernels.kv_fp8.gather_kv_pages_*) copies the request's first
   seq_len tokens from its pages into a contiguous workspace [ctx, Hkv, D] in the query dtype; an fp8
   cache is decoded there in software (decode(code) * scale), a float cache is copied;
2. SDPA: causal attention of the request's Lq query rows as the *last* Lq positions of the context
   (bottom-right aligned causal mask: torch.nn.attention.bias.causal_lower_right; plain is_causal when
   Lq == ctx). GQA without copies: the GROUP query heads of a kv head become the batch dimension,
   q [Lq, Hkv*G, D] -> view [G, Hkv, Lq, D], and K/V are the workspace viewed [1, Hkv, ctx, D] expanded
   (stride 0) to batch G.

Requests are joined, because one at a time each costs ~200 us of host time per layer on the GPU machine
(a bridge launch, an SDPA call, a copy; 13-17 ms per layer at 64 prompts), which left the compat route's
prompt step host-bound:
- on CUDA, unless the step is one run of equal requests (below; fewer bytes moved), every multi-row request
  of the step in one launch of the efficient-attention kernel's varlen form
  (torch's `_efficient_attention_forward` with sequence offsets, the kernel SDPA's efficient backend runs):
  each (request, query head of its GQA group) is one sequence whose keys are its request's workspace rows
  (start + length per sequence, so the G heads share them without copies), bottom-right causal; one varlen
  bridge launch fills the workspace, one strided copy packs the queries group-head major and one unpacks the
  output (a one-row sequence between requests starts a new launch, so each launch's rows are one range);
- for one such run, or without that op (or on the CPU), runs of consecutive requests with the same query
  length and context: one bridge launch fills [B, ctx, Hkv, D] and SDPA takes the B requests as its batch,
  once per query head of a GQA group (K / V cannot be expanded over both B and GROUP without a copy); other
  requests one by one.

Decode rows of a mixed batch (Lq == 1) are not worth a bridge: the caller runs the FMA paged-decode
kernel for them.

The workspace is allocated once at the largest context the engine can hold (max_context; the runner
passes --max-model-len, so the memory profiler's forward allocates it at full size and the KV budget
charges it once, as memory the engine holds: worker/memory.py) and reused by every layer and step; it
only grows if a longer context than announced arrives; joined requests are split into pieces whose
contexts fit it. The host knows every length: no device syncs.
On CUDA the SDPA calls are pinned to the efficient-attention kernel (the one V100 has), so
`--compat sm70` on a newer GPU tests the same kernel.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from voltllm.attention.backend import AttentionMetadata


def _sdpa_context(device: torch.device):
    if device.type != "cuda":
        import contextlib

        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION])


def sliding_window_mask(lq: int, lk: int, window: int, device: torch.device) -> torch.Tensor:
    """bool [Lq, Lk]: query j, at position Lk - Lq + j, sees keys Lk - Lq + j - window + 1 .. Lk - Lq + j."""
    q_pos = torch.arange(lk - lq, lk, device=device)[:, None]
    keys = torch.arange(lk, device=device)[None, :]
    return (keys <= q_pos) & (keys > q_pos - window)


def window_keys(lq: int, lk: int, window: int) -> int:
    """The first key any of Lq last-position queries over Lk keys sees in a window: keys before it are left out of the
    attention (and of its mask, [Lq, Lk - first] instead of [Lq, Lk])."""
    return max(0, lk - lq - window + 1)


def sdpa_causal_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    window: int = 0) -> torch.Tensor:
    """Causal attention of q [Lq, Hq, D] as the last Lq positions of k/v [L, Hkv, D] (L >= Lq); window > 0: a
    sliding-window layer's (an explicit mask).

    Returns [G, Hkv, Lq, D] (G = Hq // Hkv): head h*G + g of query row j is [g, h, j]."""
    lq, hq, d = q.shape
    lk, hkv, _ = k.shape
    g = hq // hkv
    qg = q.view(lq, hkv, g, d).permute(2, 1, 0, 3)  # [G, Hkv, Lq, D], no copy
    kg = k.permute(1, 0, 2).unsqueeze(0).expand(g, hkv, lk, d)  # batch stride 0
    vg = v.permute(1, 0, 2).unsqueeze(0).expand(g, hkv, lk, d)
    if window > 0:
        lo = window_keys(lq, lk, window)
        return F.scaled_dot_product_attention(qg, kg[:, :, lo:], vg[:, :, lo:],
                                              attn_mask=sliding_window_mask(lq, lk - lo, window, q.device), scale=scale)
    if lq == lk:
        return F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale)
    if lq == 1:  # the last position sees the whole context
        return F.scaled_dot_product_attention(qg, kg, vg, scale=scale)
    from torch.nn.attention.bias import causal_lower_right

    return F.scaled_dot_product_attention(qg, kg, vg, attn_mask=causal_lower_right(lq, lk), scale=scale)


# Experiment knob for A / B runs (benchmarks/set_and_run.py): how the compat prefill joins requests on CUDA.
# 0: every request on its own (as before session 42); 1: runs of consecutive equal requests (GROUP SDPA launches
# per run); 2: 1 when the step is one such run, else every multi-row request of the step in one varlen launch
# per workspace piece (when torch has the op; else 1).
JOIN_REQUESTS = 2


@functools.lru_cache(maxsize=1)
def _varlen_op():
    """torch's memory-efficient attention with sequence offsets (the kernel SDPA's efficient backend runs), or
    None when this torch lacks it. Private ATen op: its schema is checked so a change falls back, not breaks."""
    op = getattr(torch.ops.aten, "_efficient_attention_forward", None)
    try:
        schema = str(op.default._schema) if op is not None else ""
    except Exception:  # noqa: BLE001 -- any failure to introspect means "not available"
        return None
    need = ("cu_seqlens_q", "cu_seqlens_k", "custom_mask_type", "seqlen_k", "scale")
    return op.default if all(n in schema for n in need) else None


_BOTTOM_RIGHT_CAUSAL = 2  # the op's custom_mask_type: query i of a sequence sees keys <= i + (keys - queries)


@dataclass
class VarlenPiece:
    """One varlen launch over the query rows [row0, row1) of consecutive multi-row requests. Packed queries are
    group-head major: (head g, request i) is sequence g * B + i, its rows at g * (row1 - row0) + (s_i - row0)."""
    seqs: list[int]  # sequence indices (host)
    row0: int
    row1: int
    bridge: torch.Tensor  # int32 [3, B] (device): block-table row, context, first workspace row
    cu_q: torch.Tensor  # int32 [G * B + 1] (device): packed query offsets of the sequences
    k_start: torch.Tensor  # int32 [G * B + 1] (device): first workspace row of each sequence's keys (its request's)
    k_len: torch.Tensor  # int32 [G * B] (device): its key count
    max_q: int
    max_ctx: int


def varlen_pieces(query_start_loc: list[int], seq_lens: list[int], group: int, ws_rows: int,
                  device: torch.device) -> list[VarlenPiece]:
    """The step's multi-row requests packed into launches: consecutive requests (a one-row or empty sequence
    between them starts a new piece, so a piece's query rows are one range) whose contexts fit a workspace of
    ws_rows rows. Each (query head of a GQA group, request) is one sequence of the varlen op, its keys its
    request's workspace rows, so K / V stay per kv head."""
    pieces, cur, used = [], [], 0
    for i, ctx in enumerate(seq_lens):
        if query_start_loc[i + 1] - query_start_loc[i] <= 1 or ctx == 0:
            if cur:
                pieces.append(cur)
            cur, used = [], 0
            continue
        if cur and used + ctx > ws_rows:
            pieces.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += ctx
    if cur:
        pieces.append(cur)
    out = []
    for seqs in pieces:
        row0, row1 = query_start_loc[seqs[0]], query_start_loc[seqs[-1] + 1]
        ctxs = [seq_lens[i] for i in seqs]
        starts = [sum(ctxs[:j]) for j in range(len(seqs))]
        cu_q, k_start, k_len = [], [], []
        for g in range(group):
            for j, i in enumerate(seqs):
                cu_q.append(g * (row1 - row0) + query_start_loc[i] - row0)
                k_start.append(starts[j])
                k_len.append(ctxs[j])
        cu_q.append(group * (row1 - row0))
        k_start.append(sum(ctxs))
        b, n = len(seqs), len(k_len)
        flat = torch.tensor(seqs + ctxs + starts + cu_q + k_start + k_len, dtype=torch.int32)
        flat = flat.to(device, non_blocking=True)  # one copy per piece and step; the layers share it
        out.append(VarlenPiece(seqs=seqs, row0=row0, row1=row1, bridge=flat[:3 * b].view(3, b),
                               cu_q=flat[3 * b:3 * b + n + 1], k_start=flat[3 * b + n + 1:3 * b + 2 * n + 2],
                               k_len=flat[3 * b + 2 * n + 2:],
                               max_q=max(query_start_loc[i + 1] - query_start_loc[i] for i in seqs),
                               max_ctx=max(ctxs)))
    return out


def equal_runs(query_start_loc: list[int], seq_lens: list[int],
               join: bool = True) -> list[tuple[int, int, int, int]]:
    """Maximal runs of consecutive sequences with more than one query row and equal (query length, context):
    (first sequence, count, query length, context). Sequences with one query row or no context are skipped;
    join=False gives every sequence its own run."""
    runs: list[tuple[int, int, int, int]] = []
    for i, ctx in enumerate(seq_lens):
        lq = query_start_loc[i + 1] - query_start_loc[i]
        if lq <= 1 or ctx == 0:
            continue
        if join and runs and runs[-1][0] + runs[-1][1] == i and runs[-1][2:] == (lq, ctx):
            first, n, _, _ = runs[-1]
            runs[-1] = (first, n + 1, lq, ctx)
        else:
            runs.append((i, 1, lq, ctx))
    return runs


def sdpa_causal_gqa_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          out: torch.Tensor, window: int = 0) -> int:
    """sdpa_causal_gqa for B requests of equal shape: q / out [B, Lq, Hq, D], k / v [B, L, Hkv, D].
    Writes out; returns the number of SDPA launches (one per query head of a GQA group)."""
    b, lq, hq, d = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    kb, vb = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)  # [B, Hkv, L, D]
    mask = None
    if window > 0:
        lo = window_keys(lq, lk, window)
        kb, vb = kb[:, :, lo:], vb[:, :, lo:]
        mask = sliding_window_mask(lq, lk - lo, window, q.device)
    elif lq != lk and lq != 1:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(lq, lk)
    q5, out5 = q.view(b, lq, hkv, g, d), out.view(b, lq, hkv, g, d)
    for j in range(g):
        qj = q5[:, :, :, j].permute(0, 2, 1, 3)  # [B, Hkv, Lq, D], strided (last dim contiguous)
        o = F.scaled_dot_product_attention(qj, kb, vb, attn_mask=mask, is_causal=lq == lk and mask is None,
                                           scale=scale)
        out5[:, :, :, j].copy_(o.permute(0, 2, 1, 3))
    return g


class SDPAPrefill:
    """Prefill attention of the compat route; holds the reusable K/V workspace."""

    def __init__(self, max_context: Optional[int] = None, varlen_op=None) -> None:
        """varlen_op: the varlen attention callable, with the signature and semantics of torch's
        `_efficient_attention_forward` (None: that op, on CUDA, when this torch has it; tests pass a reference)."""
        self.max_context = max_context
        self.varlen_op = varlen_op
        self._ws: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self.calls = 0  # sequences attended (for the acceleration report / tests)
        self.launches = 0  # attention launches (joined requests share them)
        self._runs_key: Optional[tuple] = None  # the current step's lengths and its runs of equal requests
        self._runs: list[tuple[int, int, int, int]] = []
        self._plan_key: Optional[tuple] = None  # the varlen plan of the current step's lengths
        self._plan: list[VarlenPiece] = []

    def workspace(self, ctx: int, heads: int, dim: int, dtype: torch.dtype,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) workspaces [>= ctx, heads, dim]; allocated once at max(max_context, ctx) tokens."""
        key = (str(device), dtype)
        buf = self._ws.get(key)
        per_tok = heads * dim
        if buf is None or buf.numel() < 2 * ctx * per_tok:
            rows = max(ctx, self.max_context or 0)
            if self.max_context is None:  # no bound given (tests): grow geometrically
                rows = max(rows, 2 * (buf.numel() // (2 * per_tok)) if buf is not None else 0, 256)
            buf = torch.empty(2 * rows * per_tok, dtype=dtype, device=device)
            self._ws[key] = buf
        rows = buf.numel() // (2 * per_tok)
        ws = buf[: 2 * rows * per_tok].view(2, rows, heads, dim)
        return ws[0], ws[1]

    def limit_context(self, max_context: int) -> None:
        """A lower longest context from now on: the workspaces, sized for the old one, are dropped (the next step
        allocates them at the new size)."""
        self.max_context = max_context
        self._ws.clear()

    def workspace_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._ws.values())

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                out: torch.Tensor, k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
                kv_fmt: int, window: int = 0) -> None:
        """Writes out[rows] for every sequence with more than one query row (others are untouched). window > 0: a
        sliding-window layer's (the runs form, with an explicit mask)."""
        from voltllm.kernels.kv_fp8 import gather_kv_pages_batch

        qsl = meta.query_start_loc_cpu
        join = int(JOIN_REQUESTS)
        lengths = (tuple(qsl), tuple(meta.seq_lens_cpu), join)  # the step's; every layer calls with the same
        if self._runs_key != lengths:
            self._runs, self._runs_key = equal_runs(qsl, meta.seq_lens_cpu, join >= 1), lengths
        runs = self._runs
        if not runs:
            return
        heads, dim = kv_cache.shape[3], kv_cache.shape[4]
        k_ws, v_ws = self.workspace(max(r[3] for r in runs), heads, dim, q.dtype, q.device)
        g = q.shape[1] // heads
        # one run of equal requests keeps the runs form: at 64 x 128-token prompts it measured 513 against 766 us
        # of GPU time per layer for the 8B's heads (the varlen form adds the query pack / unpack copies); any
        # other mix goes varlen (64 mixed prompts: 1.4 ms against 16.8 ms per layer; benchmarks/README.md)
        op = None
        if join >= 2 and len(runs) > 1 and window <= 0:
            op = self.varlen_op if self.varlen_op is not None else (_varlen_op() if q.is_cuda else None)
        if op is not None:
            self._varlen(op, q, kv_cache, meta, scale, out, k_scale, v_scale, kv_fmt, k_ws, v_ws, g, lengths)
            return
        with _sdpa_context(q.device):
            for first, count, lq, ctx in runs:
                per_piece = max(1, k_ws.shape[0] // ctx)  # requests whose contexts fit the workspace at once
                for p in range(first, first + count, per_piece):
                    n = min(per_piece, first + count - p)
                    s, e = qsl[p], qsl[p + n]
                    kc, vc = gather_kv_pages_batch(kv_cache, meta.block_tables[p:p + n], ctx, (k_ws, v_ws),
                                                   k_scale, v_scale, kv_fmt)
                    if n == 1:
                        o = sdpa_causal_gqa(q[s:e], kc[0], vc[0], scale, window)  # [G, Hkv, Lq, D]
                        out[s:e].view(e - s, heads, g, dim).permute(2, 1, 0, 3).copy_(o)
                        self.launches += 1
                    else:
                        self.launches += sdpa_causal_gqa_batch(q[s:e].view(n, lq, -1, dim), kc, vc, scale,
                                                               out[s:e].view(n, lq, -1, dim), window)
                    self.calls += n

    def _varlen(self, op, q, kv_cache, meta, scale, out, k_scale, v_scale, kv_fmt, k_ws, v_ws, g, lengths) -> None:
        """Every multi-row request in one bridge + one varlen attention launch per workspace piece. The plan is
        built once per step (the layers share the metadata) and kept until the lengths change."""
        from voltllm.kernels.kv_fp8 import gather_kv_pages_varlen

        heads, dim = kv_cache.shape[3], kv_cache.shape[4]
        key = (lengths, g, k_ws.shape[0], str(q.device))
        if self._plan_key != key:
            self._plan = varlen_pieces(meta.query_start_loc_cpu, meta.seq_lens_cpu, g, k_ws.shape[0], q.device)
            self._plan_key = key
        for piece in self._plan:
            gather_kv_pages_varlen(kv_cache, meta.block_tables, piece.bridge, piece.max_ctx, (k_ws, v_ws),
                                   k_scale, v_scale, kv_fmt)
            r0, r1 = piece.row0, piece.row1
            # [R, Hkv, G, D] -> group-head major [G * R, Hkv, D]: one strided copy
            qp = q[r0:r1].view(r1 - r0, heads, g, dim).permute(2, 0, 1, 3).reshape(1, g * (r1 - r0), heads, dim)
            o = op(qp, k_ws.unsqueeze(0), v_ws.unsqueeze(0), None, piece.cu_q, piece.k_start, piece.max_q,
                   piece.max_ctx, 0.0, _BOTTOM_RIGHT_CAUSAL, False, scale=scale, seqlen_k=piece.k_len)[0]
            out[r0:r1].view(r1 - r0, heads, g, dim).copy_(o.view(g, r1 - r0, heads, dim).permute(1, 2, 0, 3))
            self.launches += 1
            self.calls += len(piece.seqs)
