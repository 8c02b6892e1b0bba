"""Qwen4-Exp QSA decode rows (voltllm/model/models/qwen4_exp_qsa_decode.py) against the torch reference
(QSAIndexer.selection + sparse_attention), on random data.

The case builder (make_case, run_case) is shared: tests/unit/test_qwen4_exp_qsa_decode.py runs it on the CPU with the
torch attention backend; run as a script under TRITON_INTERPRET=1 (tests/unit/test_qwen4_exp_qsa_decode.py runs it in
a subprocess) it checks the Triton paged decode kernel over the virtual block tables, printing
    CHECK <name> <ok|FAIL> <detail>
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from voltllm.attention.backend import AttentionMetadata
from voltllm.attention.torch_ref import gather_kv
from voltllm.model.layers.rotary import RotaryEmbedding
from voltllm.model.models import qwen4_exp_qsa_decode as qsa
from voltllm.model.models.qwen4_exp_qsa import QSAIndexer, sparse_attention

HEADS, KV_HEADS, HEAD_DIM, N_IDX, D_IDX, ROT = 8, 2, 64, 4, 32, 16


@dataclass
class Case:
    indexer: QSAIndexer
    rotary: RotaryEmbedding
    lens: list[int]  # contexts after the decode step (row i at position lens[i] - 1)
    kv: torch.Tensor  # [2, blocks, page, KV_HEADS, HEAD_DIM]; unused slots NaN
    index: torch.Tensor  # [2, blocks, page, 1, D_IDX]: plane 0 raw keys, plane 1 pooled keys
    tables: torch.Tensor  # [R, width] int32 (pad rows: zeros)
    q_idx: torch.Tensor  # [R, N_IDX, D_IDX] the decode rows' indexer queries (unnormed)
    q: torch.Tensor  # [R, HEADS, HEAD_DIM] the decode rows' attention queries (rotated)
    meta: AttentionMetadata  # the decode step's (pad rows: slot -1, seq_len 1)
    page: int

    @property
    def raw(self) -> torch.Tensor:
        return self.index.view(2, -1, D_IDX)[0]

    @property
    def pooled(self) -> torch.Tensor:
        return self.index.view(2, -1, D_IDX)[1]


def make_case(lens: list[int], ratio: int, page: int, budget: int, seed: int, pad_rows: int = 0,
              dtype: torch.dtype = torch.float32, extra_width: int = 2) -> Case:
    """Random keys and weights; the prompt (every position but the last) stored and its pooled keys computed by
    one multi-row step, as a prompt chunk does; the decode rows' raw keys stored by the caller (run_selection)."""
    g = torch.Generator().manual_seed(seed)
    cfg = SimpleNamespace(hidden_size=16, indexer_n_heads=N_IDX, indexer_head_dim=D_IDX, indexer_compress_ratio=ratio,
                          indexer_budget=budget, rms_norm_eps=1e-6,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    indexer = QSAIndexer(cfg, dtype)
    with torch.no_grad():
        indexer.q_layernorm.weight.copy_(torch.randn(D_IDX, generator=g) * 0.3)
        indexer.k_layernorm.weight.copy_(torch.randn(D_IDX, generator=g) * 0.3)
    rotary = RotaryEmbedding(cfg, D_IDX, max(lens) + 64, ROT)
    nblocks = [math.ceil(n / page) for n in lens]
    width = max(nblocks) + extra_width
    total = sum(nblocks) + 3
    perm = torch.randperm(total, generator=g).tolist()
    rows = len(lens) + pad_rows
    tables = torch.zeros(rows, width, dtype=torch.int32)
    kv = torch.full((2, total, page, KV_HEADS, HEAD_DIM), float("nan"), dtype=dtype)
    index = torch.zeros(2, total, page, 1, D_IDX, dtype=dtype)
    flat_kv = kv.view(2, -1, KV_HEADS, HEAD_DIM)
    used, prompt_slots, prompt_pos, prompt_qsl = 0, [], [], [0]
    for i, n in enumerate(lens):
        blocks = perm[used:used + nblocks[i]]
        used += nblocks[i]
        tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots = torch.tensor([blocks[p // page] * page + p % page for p in range(n)])
        flat_kv[:, slots] = torch.randn(2, n, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
        index.view(2, -1, D_IDX)[0, slots] = torch.randn(n, D_IDX, generator=g).to(dtype)
        prompt_slots += slots[:-1].tolist()
        prompt_pos += list(range(n - 1))
        prompt_qsl.append(len(prompt_pos))
    raw_view = index.view(2, -1, D_IDX)[0]
    pooled_view = index.view(2, -1, D_IDX)[1]
    prompt = AttentionMetadata(
        num_tokens=len(prompt_pos), query_start_loc=torch.tensor(prompt_qsl, dtype=torch.int32),
        seq_lens=torch.tensor([n - 1 for n in lens], dtype=torch.int32), block_tables=tables[:len(lens)],
        slot_mapping=torch.tensor(prompt_slots), max_query_len=max(lens) - 1, max_seq_len=max(lens) - 1,
        query_start_loc_cpu=prompt_qsl, seq_lens_cpu=[n - 1 for n in lens])
    positions = torch.tensor(prompt_pos)
    with torch.no_grad():
        qsa.store_pooled_keys(indexer, rotary, raw_view, pooled_view, positions, prompt.slot_mapping, tables,
                              qsa.row_sequences(prompt, len(prompt_pos), positions.device), page)
    last = [int(tables[i, (n - 1) // page]) * page + (n - 1) % page for i, n in enumerate(lens)]
    meta = AttentionMetadata(
        num_tokens=rows, query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens + [1] * pad_rows, dtype=torch.int32), block_tables=tables,
        slot_mapping=torch.tensor(last + [-1] * pad_rows), max_query_len=1, max_seq_len=max(lens),
        query_start_loc_cpu=list(range(rows + 1)), seq_lens_cpu=lens + [1] * pad_rows)
    q_idx = torch.randn(rows, N_IDX, D_IDX, generator=g).to(dtype)
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=g).to(dtype)
    return Case(indexer, rotary, lens, kv, index, tables, q_idx, q, meta, page)


def positions(case: Case) -> torch.Tensor:
    return torch.tensor([n - 1 for n in case.lens] + [0] * (case.meta.num_tokens - len(case.lens)))


@torch.no_grad()
def run_selection(case: Case) -> tuple[AttentionMetadata, int]:
    """The decode step: its rows' pooled keys stored (completing rows), then the selection's metadata."""
    pos = positions(case)
    meta = case.meta
    qsa.store_pooled_keys(case.indexer, case.rotary, case.raw, case.pooled, pos, meta.slot_mapping,
                          meta.block_tables, qsa.row_sequences(meta, pos.shape[0], pos.device), case.page)
    return qsa.decode_selection(case.indexer, case.rotary, case.q_idx, pos, case.pooled, meta, case.page)


@torch.no_grad()
def reference(case: Case) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(attention [n, HEADS, HEAD_DIM], each row's selected flat slots, sorted) from the torch reference."""
    outs, chosen = [], []
    scale = HEAD_DIM ** -0.5
    for i, n in enumerate(case.lens):
        table = case.tables[i]
        slots = torch.tensor([int(table[p // case.page]) * case.page + p % case.page for p in range(n)])
        mask = case.indexer.selection(case.q_idx[i:i + 1], torch.tensor([n - 1]), case.raw[slots], case.rotary)
        k, v = gather_kv(case.kv, table, n)
        outs.append(sparse_attention(case.q[i:i + 1], k, v, mask, scale))
        chosen.append(slots[mask[0]].sort().values)
    return torch.cat(outs), chosen


def selected_slots(vmeta: AttentionMetadata, page: int, rows: int) -> list[torch.Tensor]:
    """Each row's flat slots in its virtual table (the first seq_len positions), sorted."""
    out = []
    for i in range(rows):
        n = int(vmeta.seq_lens[i])
        p = torch.arange(n)
        out.append((vmeta.block_tables[i].long()[p // page] * page + p % page).sort().values)
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def run_case(case: Case, backend) -> tuple[float, str]:
    """(relative error of the decode rows' attention, problems) for a backend attending over the selection."""
    vmeta, page = run_selection(case)
    n = len(case.lens)
    ref, want = reference(case)
    got = selected_slots(vmeta, page, n)
    problems = [f"row {i}: selection differs" for i in range(n) if not torch.equal(got[i], want[i])]
    view = qsa.paged_view(case.kv, page)
    k = torch.zeros(case.q.shape[0], KV_HEADS, HEAD_DIM, dtype=case.q.dtype)
    out = backend.forward(case.q.clone(), k, k.clone(), view, vmeta, HEAD_DIM ** -0.5, kv_written=True)
    if not torch.isfinite(out[:n]).all():
        problems.append("non-finite output (read outside the selection)")
    return rel_err(out[:n], ref), " ".join(problems)


@torch.no_grad()
def run_prompt_rows(case: Case, backend, rows: int, chunk: int) -> tuple[float, str]:
    """The last `rows` token rows of the case's one request as a multi-row chunk (prompt_selection, `chunk` rows at
    a time, as IndexedAttention._sparse_rows cuts them) against the reference row by row: (relative error, problems).
    Rows whose complete blocks fit the budget are left out, as the model leaves them (plain causal rows)."""
    (n,) = case.lens
    run_selection(case)  # the last row's raw and pooled keys stored, as a prompt chunk's store does
    table = case.tables[0]
    slots = torch.tensor([int(table[p // case.page]) * case.page + p % case.page for p in range(n)])
    first = max(n - rows, qsa.first_sparse_token(case.indexer))
    g = torch.Generator().manual_seed(n)
    q_idx = torch.randn(n, N_IDX, D_IDX, generator=g).to(case.q.dtype)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=g).to(case.q.dtype)
    k_all, v_all = gather_kv(case.kv, table, n)
    scale = HEAD_DIM ** -0.5
    problems, worst = [], 0.0
    view = None
    for a in range(first, n, chunk):
        b = min(a + chunk, n)
        tok = torch.arange(a, b)
        vmeta, page = qsa.prompt_selection(case.indexer, case.rotary, q_idx[a:b], tok, tok, b - 1, case.pooled, table,
                                           case.page, slots[a:b])
        view = qsa.paged_view(case.kv, page)
        kz = torch.zeros(b - a, KV_HEADS, HEAD_DIM, dtype=q.dtype)
        out = backend.forward(q[a:b].clone(), kz, kz.clone(), view, vmeta, scale, kv_written=True)
        got = selected_slots(vmeta, page, b - a)
        mask = case.indexer.selection(q_idx[a:b], tok, case.raw[slots], case.rotary)
        for j in range(b - a):
            if not torch.equal(got[j], slots[mask[j]].sort().values):
                problems.append(f"token {a + j}: selection differs")
        if not bool(mask.sum(-1).lt(tok + 1).any()):
            problems.append(f"rows {a}..{b - 1}: nothing dropped (the case does not exercise the selection)")
        ref = sparse_attention(q[a:b], k_all, v_all, mask, scale)
        if not torch.isfinite(out).all():
            problems.append("non-finite output (read outside the selection)")
        worst = max(worst, rel_err(out, ref))
    return worst, " ".join(problems)


@torch.no_grad()
def run_scores_kernel(case: Case) -> tuple[float, str]:
    """kernels/qsa_scores against block_scores_reference on the case's decode rows (pad rows included), the output
    poisoned first; two blocks' keys zeroed so their scores tie at exactly 0 (break_ties). -> (max abs error over
    the finite scores, problems)."""
    from voltllm.kernels.qsa_scores import qsa_block_scores

    pos = positions(case)
    meta = case.meta
    qsa.store_pooled_keys(case.indexer, case.rotary, case.raw, case.pooled, pos, meta.slot_mapping,
                          meta.block_tables, qsa.row_sequences(meta, pos.shape[0], pos.device), case.page)
    r = case.indexer.ratio
    for i in (0, -1):  # blocks 0 and 1 of the longest row: zero keys, zero products, a tie at 0
        n = max(case.lens)
        row = case.lens.index(n)
        for j in (0, 1):
            end = (j + 1) * r - 1
            case.pooled[int(case.tables[row, end // case.page]) * case.page + end % case.page] = 0
    q_rot = qsa.rope_rows(case.indexer.q_layernorm(case.q_idx), pos, case.rotary)
    want = qsa.block_scores_reference(case.indexer, q_rot, case.pooled, pos, case.tables, case.page)
    out = torch.full_like(want, float("nan"))
    got = qsa_block_scores(q_rot, case.pooled, pos, case.tables, r, case.page, out=out)
    problems = []
    if not torch.equal(torch.isinf(got), torch.isinf(want)) or not torch.equal(got.isneginf(), want.isneginf()):
        problems.append("-inf pattern differs")
    if torch.isnan(got).any():
        problems.append("unwritten (NaN) entries")
    if not torch.equal(got.topk(3, dim=-1).indices, want.topk(3, dim=-1).indices):
        problems.append("top blocks differ")
    fin = torch.isfinite(want)
    err = (got[fin] - want[fin]).abs().max().item() / max(want[fin].abs().max().item(), 1e-30)
    return err, " ".join(problems)


@torch.no_grad()
def run_chunk_scores(case: Case, rows: int) -> tuple[float, str]:
    """kernels/qsa_scores.qsa_chunk_scores against the torch form on the last `rows` token rows of the case's one
    request (its pooled keys gathered as prompt_selection gathers them), poisoned output, two blocks tied at 0."""
    from voltllm.kernels.qsa_scores import qsa_chunk_scores

    (n,) = case.lens
    run_selection(case)
    r, table = case.indexer.ratio, case.tables[0]
    nb = n // r
    ends = torch.arange(nb) * r + r - 1
    keys = case.pooled[qsa.token_slots(table[None], torch.zeros(1, dtype=torch.long), ends[None], case.page).view(-1)]
    keys[:2] = 0
    g = torch.Generator().manual_seed(rows)
    tok = torch.arange(n - rows, n)
    q_rot = torch.randn(rows, N_IDX, D_IDX, generator=g).to(case.q.dtype)
    want = qsa.break_ties(torch.relu(torch.einsum("nhd,cd->nhc", q_rot.float(), keys.float())).sum(1)
                          / math.sqrt(D_IDX))
    want = want.masked_fill(torch.arange(nb)[None, :] >= ((tok + 1) // r)[:, None], float("-inf"))
    got = qsa_chunk_scores(q_rot, keys.contiguous(), tok, r, out=torch.full_like(want, float("nan")))
    problems = []
    if torch.isnan(got).any():
        problems.append("unwritten (NaN) entries")
    if not torch.equal(got.isneginf(), want.isneginf()):
        problems.append("-inf pattern differs")
    if not torch.equal(got.topk(4, dim=-1).indices, want.topk(4, dim=-1).indices):
        problems.append("top blocks differ")
    fin = torch.isfinite(want)
    return (got[fin] - want[fin]).abs().max().item() / want[fin].abs().max().item(), " ".join(problems)


TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _checks():
    from voltllm.attention.triton_backend import TritonAttentionBackend

    f32 = torch.float32
    # (lens, ratio, page, budget): rows below and above budget + ratio, odd lengths, rows completing a block now
    mixed = [7, 16, 23, 40, 41, 64, 99, 100]
    yield "ratio_lt_page_nosplit", lambda: run_case(make_case(mixed, 4, 16, 16, seed=1, pad_rows=2),
                                                    TritonAttentionBackend(num_sms=1)), f32
    yield "ratio_eq_page_split", lambda: run_case(make_case(mixed, 4, 4, 16, seed=2),
                                                  TritonAttentionBackend(num_sms=64, max_splits=3)), f32
    yield "ratio_two_pages_fma", lambda: run_case(make_case(mixed, 8, 4, 16, seed=3, pad_rows=1),
                                                  TritonAttentionBackend(use_tensor_cores=False, num_sms=64)), f32
    yield "ratio_lt_page_f16_lanes", lambda: run_case(
        make_case([5, 50, 131], 4, 8, 24, seed=4, dtype=torch.float16),
        TritonAttentionBackend(use_tensor_cores=False, num_sms=64, fma_lanes=True)), torch.float16
    yield "scores_kernel_f32", lambda: run_scores_kernel(make_case(mixed, 4, 8, 16, seed=6, pad_rows=2)), f32
    yield "scores_kernel_f16_r8", lambda: run_scores_kernel(
        make_case([3, 30, 64, 131], 8, 4, 16, seed=7, dtype=torch.float16, extra_width=5)), torch.float16
    yield "chunk_scores_f32", lambda: run_chunk_scores(make_case([203], 4, 8, 16, seed=8), 45), f32
    # (125 blocks, two block tiles; the first row tile's rows have completed < 64 blocks: its second tile exits early)
    yield "chunk_scores_f32_tiles", lambda: run_chunk_scores(make_case([250], 2, 16, 6, seed=10), 200), f32
    yield "chunk_scores_f16_r8", lambda: run_chunk_scores(
        make_case([203], 8, 16, 16, seed=9, dtype=torch.float16), 70), torch.float16
    yield "prompt_rows_split", lambda: run_prompt_rows(make_case([131], 4, 8, 16, seed=5),
                                                       TritonAttentionBackend(num_sms=64, max_splits=3), 40, 16), f32


def main() -> int:
    from interp_util import error_checks_main

    return error_checks_main((name, fn, TOL[dtype]) for name, fn, dtype in _checks())


if __name__ == "__main__":
    sys.exit(main())
