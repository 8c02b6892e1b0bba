"""Qwen4-Exp QSA for decode rows (one query row per sequence) without host decisions: CUDA-graph capturable, every
shape static (the block tables' width bounds the blocks), the attention itself the ordinary paged decode kernel.

Pooled block keys. Block j's key (the mean of its r raw keys, k_layernorm, RoPE at position j r; qwen4_exp_qsa) is
fixed once the block is complete, so it is computed once, by the step whose row completes the block (position
(j + 1) r - 1; a prompt chunk computes every block it completes), and stored in the paged KV cache: a second
IndexKeyStore entry per indexed layer ("pooled plane", d_idx channels per token row), at the row of the block's last
token. That row's page is the sequence's own when it is written (a page shared through the prefix cache holds a
prefix ending at or past that token, so its pooled keys are those every sharer computes), and prefix caching,
preemption and offloading carry it with K / V. Rows of other positions in the plane hold unused values.

Scores + top-k (block_scores, virtual_tables): for each decode row at position p, every block j < NB (NB: the block
tables' width in blocks; a graph's tables are --max-model-len wide) gets a score, from its stored key for j < n_c =
(p + 1) // r and -inf past it (on a GPU kernels/qsa_scores reads only those n_c keys), top min(budget // r, NB)
taken, the -inf picks dropped, the rest sorted.

Attention over the selection: the selected blocks, then the tail block n_c (positions n_c r .. p), as a VIRTUAL
block table over the KV cache viewed with pages of P = gcd(r, block_size) tokens (each block is r / P such pages,
each inside one real page), and a virtual seq_len (selected r each + the tail's p + 1 - n_c r). K / V are stored
RoPE'd at their true positions, so attending to a subset is the paged decode kernel over another key set. A row whose
context is under budget + r selects every complete block: its virtual table is its whole context in order, the
same attention as the plain path. The reference stays qwen4_exp_qsa.QSAIndexer.selection + sparse_attention.

Rows of a multi-row chunk (prompt chunks, verification rows, a mixed step's decode rows) past the budget take the same
route (prompt_selection), in an eager step: each query row becomes one decode row of the paged decode kernel over its
own virtual block table, its request's pooled keys gathered once per chunk of rows and scored against all its rows (on
a GPU kernels/qsa_scores.qsa_chunk_scores: tiles of rows x blocks on the tensor cores, relu and head sum in registers;
else one torch product), the chunk sized so its scores (and the torch form's [rows, heads, blocks] products) stay
under SCORE_BYTES. Rows whose complete blocks all fit the budget keep the plain causal output (the same token set).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from voltllm.attention.backend import AttentionMetadata
from voltllm.model.layers.rotary import RotaryEmbedding
from voltllm.model.models.qwen4_exp_qsa import QSAIndexer, break_ties, rope_rows


def row_token_index(meta: AttentionMetadata, num_rows: int, device: torch.device) -> torch.Tensor:
    """Each token row's token index in its sequence [num_rows] (a graph's padding rows: clamped to 0). Decode rows:
    seq_len - 1 on the device (CUDA-graph safe); otherwise from the host's query starts and lengths."""
    if meta.is_pure_decode:
        return (meta.seq_lens[:num_rows].long() - 1).clamp_min(0)
    qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    idx = [n - (qsl[i + 1] - qsl[i]) + j for i, n in enumerate(lens) for j in range(qsl[i + 1] - qsl[i])]
    idx += [0] * (num_rows - len(idx))
    return torch.tensor(idx[:num_rows], dtype=torch.long).to(device)


def row_sequences(meta: AttentionMetadata, num_rows: int, device: torch.device) -> torch.Tensor:
    """Each token row's sequence (batch index) [num_rows]: rows are sequences in a pure-decode step (a graph's padding
    rows included); otherwise from the host's query starts (an eager step)."""
    if meta.is_pure_decode:
        return torch.arange(num_rows, device=device).clamp_max(meta.block_tables.shape[0] - 1)
    qsl = meta.query_start_loc_cpu
    lens = torch.tensor([qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)])
    seqs = torch.repeat_interleave(torch.arange(len(lens)), lens)
    pad = num_rows - seqs.shape[0]  # (rows past the sequences' tokens: attributed to the last, written nowhere)
    if pad > 0:
        seqs = torch.cat((seqs, seqs.new_full((pad,), max(len(lens) - 1, 0))))
    return seqs[:num_rows].to(device)


def token_slots(block_tables: torch.Tensor, seqs: torch.Tensor, positions: torch.Tensor,
                block_size: int) -> torch.Tensor:
    """Cache rows (flat slots) of positions [n, ...] of sequences seqs [n] (columns clamped to the table)."""
    pos = positions.long()
    col = (pos // block_size).clamp(0, block_tables.shape[1] - 1)
    pages = block_tables[seqs.long()].long().gather(1, col.reshape(col.shape[0], -1)).view_as(col)
    return pages * block_size + pos % block_size


def store_pooled_keys(indexer: QSAIndexer, rotary: RotaryEmbedding, raw_keys: torch.Tensor,
                      pooled_keys: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                      block_tables: torch.Tensor, seqs: torch.Tensor, block_size: int,
                      token_pos: Optional[torch.Tensor] = None, start_rotary: Optional[dict] = None) -> None:
    """For every row t: the pooled key of the block of r tokens ending at the row's token into pooled_keys at the
    row's own slot (only rows completing a block give a key anything reads; slot -1 writes nowhere). Raw keys of
    this step must be stored already. token_pos: each row's token index (None: the positions are token indices, as
    in a text-only request); the key rotates at the block's first token's rotary position, positions - (r - 1) (a
    block of text tokens has consecutive M-RoPE positions), or, for the rows start_rotary names ({row range (a, b):
    a rotary table by token index}: a request with images, whose block may hold image tokens), that token's own."""
    from voltllm.model.models.qwen4_exp import _store_rows

    t, r = slot_mapping.shape[0], indexer.ratio
    tok = (positions[:t] if token_pos is None else token_pos[:t]).long()
    window = (tok[:, None] - (r - 1) + torch.arange(r, device=tok.device)).clamp_min(0)  # [t, r]
    raw = raw_keys[token_slots(block_tables, seqs[:t], window, block_size).view(-1)].view(t, r, indexer.dim)
    normed = indexer.k_layernorm(raw.float().mean(1).to(raw_keys.dtype))
    keys = rope_rows(normed, (positions[:t].long() + 1 - r).clamp_min(0), rotary)
    for (a, b), table in (start_rotary or {}).items():
        keys[a:b] = rope_rows(normed[a:b], (tok[a:b] + 1 - r).clamp_min(0), table)
    _store_rows(pooled_keys, keys, slot_mapping)


def block_scores(indexer: QSAIndexer, q_rot: torch.Tensor, pooled_keys: torch.Tensor, positions: torch.Tensor,
                 block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """q_rot [R, n_idx, d] (normed, RoPE'd) of decode rows at positions [R] (row i: sequence i) -> fp32 scores
    [R, NB] of every block the tables can hold, -inf for blocks not complete at the row's position. On a GPU the
    Triton kernel (kernels/qsa_scores: reads only each row's complete blocks), else the torch reference."""
    dim = q_rot.shape[-1]
    if q_rot.is_cuda and dim & (dim - 1) == 0:
        from voltllm.kernels.qsa_scores import qsa_block_scores

        return qsa_block_scores(q_rot.contiguous(), pooled_keys, positions, block_tables, indexer.ratio, block_size)
    return block_scores_reference(indexer, q_rot, pooled_keys, positions, block_tables, block_size)


def block_scores_reference(indexer: QSAIndexer, q_rot: torch.Tensor, pooled_keys: torch.Tensor,
                           positions: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """block_scores in torch: every block of the tables' width gathered for every row."""
    rows, r = q_rot.shape[0], indexer.ratio
    nb = block_tables.shape[1] * block_size // r
    j = torch.arange(nb, device=q_rot.device)
    ends = ((j + 1) * r - 1).expand(rows, nb)
    seqs = torch.arange(rows, device=q_rot.device)
    keys = pooled_keys[token_slots(block_tables, seqs, ends, block_size).view(-1)].view(rows, nb, indexer.dim)
    scores = break_ties(torch.relu(torch.einsum("nhd,ncd->nhc", q_rot.float(), keys.float())).sum(1)
                        / math.sqrt(indexer.dim))
    complete = (positions[:rows].long() + 1) // r
    return scores.masked_fill(j[None, :] >= complete[:, None], float("-inf"))


def virtual_tables(scores: torch.Tensor, top_blocks: int, positions: torch.Tensor, block_tables: torch.Tensor,
                   ratio: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """-> (virtual block tables [R, (k + 1) r / P] int32 over pages of P = gcd(ratio, block_size) tokens, virtual
    seq_lens [R] int32, P): row i's top-k complete blocks (by scores [R, NB]) in order, then its tail block."""
    rows, nb = scores.shape
    dev = scores.device
    k = min(top_blocks, nb)
    page = math.gcd(ratio, block_size)
    vals, idx = scores.topk(k, dim=-1)
    valid = vals > float("-inf")  # (-inf picks: blocks not complete)
    chosen = torch.where(valid, idx, nb).sort(dim=-1).values  # ascending, dropped picks last
    nsel = valid.sum(-1)
    pos = positions[:rows].long()
    complete = (pos + 1) // ratio
    slots = torch.arange(k + 1, device=dev)[None, :]
    blocks = torch.cat((chosen, chosen.new_zeros(rows, 1)), dim=1)
    blocks = torch.where(slots == nsel[:, None], complete[:, None], blocks)  # the tail block right after them
    blocks = torch.where(slots > nsel[:, None], 0, blocks)  # padding: never read (past the virtual seq_len)
    per_block = ratio // page
    first = blocks[:, :, None] * ratio + torch.arange(per_block, device=dev) * page  # [R, k + 1, r / P]
    seqs = torch.arange(rows, device=dev)
    pages = token_slots(block_tables, seqs, first, block_size) // page  # page index in the P-token view
    lens = nsel * ratio + (pos + 1 - complete * ratio)
    return pages.view(rows, -1).to(torch.int32), lens.to(torch.int32), page


SCORE_BYTES = 256 << 20  # bound on one chunk's fp32 scores / torch products (prompt_selection, prompt_rows_per_chunk)


def first_sparse_token(indexer: QSAIndexer) -> int:
    """The first token index whose selection can leave tokens out: it completes top_blocks + 1 blocks."""
    return (indexer.top_blocks + 1) * indexer.ratio - 1


def fused_chunk_scores(q: torch.Tensor) -> bool:
    """Whether a chunk's scores come from kernels/qsa_scores.qsa_chunk_scores (a GPU, a power-of-two head dim)."""
    dim = q.shape[-1]
    return q.is_cuda and dim >= 16 and dim & (dim - 1) == 0


def prompt_rows_per_chunk(indexer: QSAIndexer, last_token: int, fused: bool = False) -> int:
    """Query rows scored at once against a request whose last row sits at token index last_token: the fused kernel
    writes [rows, blocks] fp32 scores, the torch form also holds [rows, heads, blocks] products (twice)."""
    blocks = max(1, (last_token + 1) // indexer.ratio)
    per_row = 4 * blocks * (1 if fused else 2 * indexer.n_heads)
    return max(1, min(1024, SCORE_BYTES // per_row))


def prompt_selection(indexer: QSAIndexer, rotary, q_idx: torch.Tensor, positions: torch.Tensor,
                     token_index: torch.Tensor, last_token: int, pooled_keys: torch.Tensor, table_row: torch.Tensor,
                     block_size: int, slot_mapping: torch.Tensor) -> tuple[AttentionMetadata, int]:
    """n query rows of ONE request (not a CUDA graph: host values allowed) -> (pure-decode metadata attending each row
    to its selection, one row per sequence, over virtual tables; the view's page size). q_idx [n, n_idx, d]
    (unnormed), positions [n] rotate them (a rotary table by token index for a request with images), token_index [n]
    the rows' token indices (ascending; last_token the largest, from the host); table_row the request's block table."""
    n, r = q_idx.shape[0], indexer.ratio
    dev = q_idx.device
    nb = (last_token + 1) // r  # blocks complete at the last row: the widest selection any row can make
    q_rot = rope_rows(indexer.q_layernorm(q_idx), positions, rotary)
    j = torch.arange(nb, device=dev)
    ends = (j + 1) * r - 1
    keys = pooled_keys[token_slots(table_row[None], torch.zeros(1, dtype=torch.long, device=dev), ends[None],
                                   block_size).view(-1)]  # [nb, d], each block's key once for all the rows
    if fused_chunk_scores(q_rot):
        from voltllm.kernels.qsa_scores import qsa_chunk_scores

        scores = qsa_chunk_scores(q_rot.contiguous(), keys.contiguous(), token_index, r)
    else:
        scores = break_ties(torch.relu(torch.einsum("nhd,cd->nhc", q_rot.float(), keys.float())).sum(1)
                            / math.sqrt(indexer.dim))
        complete = (token_index.long() + 1) // r
        scores = scores.masked_fill(j[None, :] >= complete[:, None], float("-inf"))
    tables, lens, page = virtual_tables(scores, indexer.top_blocks, token_index, table_row[None].expand(n, -1),
                                        r, block_size)
    bound = min(indexer.top_blocks, nb) * r + r
    host = lens.tolist() if not lens.is_cuda else [bound] * n
    meta = AttentionMetadata(
        num_tokens=n, query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev), seq_lens=lens,
        block_tables=tables, slot_mapping=slot_mapping, max_query_len=1, max_seq_len=bound,
        query_start_loc_cpu=list(range(n + 1)), seq_lens_cpu=host)
    return meta, page


def selection_meta(meta: AttentionMetadata, tables: torch.Tensor, lens: torch.Tensor,
                   bound: int) -> AttentionMetadata:
    """The step's pure-decode metadata with the virtual tables and seq_lens. Host lengths: the real ones on the CPU
    (the torch backend reads them), the bound on CUDA (its decode kernel reads the device lengths; no sync)."""
    host = lens.tolist() if not lens.is_cuda else [min(bound, n) for n in meta.seq_lens_cpu]
    return AttentionMetadata(
        num_tokens=meta.num_tokens, query_start_loc=meta.query_start_loc, seq_lens=lens, block_tables=tables,
        slot_mapping=meta.slot_mapping, max_query_len=meta.max_query_len, max_seq_len=min(meta.max_seq_len, bound),
        query_start_loc_cpu=meta.query_start_loc_cpu, seq_lens_cpu=host)


def paged_view(kv_cache: torch.Tensor, page: int) -> torch.Tensor:
    """The KV cache [2, blocks, block_size, H, D] as pages of `page` tokens (the same memory, the same flat slots)."""
    two, nb, bs = kv_cache.shape[:3]
    if page == bs:
        return kv_cache
    return kv_cache.view(two, nb * bs // page, page, *kv_cache.shape[3:])


def decode_selection(indexer: QSAIndexer, rotary: RotaryEmbedding, q_idx: torch.Tensor, positions: torch.Tensor,
                     pooled_keys: torch.Tensor, meta: AttentionMetadata, block_size: int,
                     scores_fn: Optional[callable] = None,
                     token_pos: Optional[torch.Tensor] = None) -> tuple[AttentionMetadata, int]:
    """A pure-decode step's rows -> (the metadata attending to each row's selection, the view's page size).
    positions rotate the queries; token_pos (None: the positions) are the rows' token indices, which set the blocks
    (they differ under M-RoPE once a request has images)."""
    rows = meta.block_tables.shape[0]
    tok = positions if token_pos is None else token_pos
    q_rot = rope_rows(indexer.q_layernorm(q_idx[:rows]), positions[:rows], rotary)
    scores = (scores_fn or block_scores)(indexer, q_rot, pooled_keys, tok, meta.block_tables, block_size)
    tables, lens, page = virtual_tables(scores, indexer.top_blocks, tok, meta.block_tables, indexer.ratio,
                                        block_size)
    bound = min(indexer.top_blocks, scores.shape[1]) * indexer.ratio + indexer.ratio
    return selection_meta(meta, tables, lens, bound), page
