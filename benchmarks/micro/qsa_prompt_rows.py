"""Qwen4-Exp QSA: one layer's selection + attention for a prompt chunk past the indexer's budget (GPU).

    PYTHONPATH=$PWD:$PWD/tests python3 benchmarks/micro/qsa_prompt_rows.py [--contexts 8192 32768] [--rows 1024]

The chunk is the last `rows` tokens of one request of `context` tokens, whose K / V, raw and pooled index keys are
already in a paged cache. Times (wall clock around a synchronized call, after a warm-up) the route the model takes
now (qwen4_exp_qsa_decode.prompt_selection: the chunk-scores kernel, top-k, virtual block tables into the paged
decode kernel, chunks sized by prompt_rows_per_chunk) against the torch form it replaced (QSAIndexer.selection +
sparse_attention per 256 rows: a token mask and masked fp32 attention over the whole context), with the peak memory
each allocates. The two outputs are compared: the largest difference, and the rows off by more than 1% of the
largest value (in fp16 a row whose top blocks score within rounding of each other can pick another block on either
route). Shapes: 32 q / 4 kv heads of 256 (Qwen3.5-style gated attention), 16 index heads of 128, ratio 4, budget
2,048 (guesses: no released config was read).
"""
import argparse
import time

import torch

from voltllm.attention.torch_ref import gather_kv
from voltllm.attention.triton_backend import TritonAttentionBackend
from voltllm.model.layers.rotary import RotaryEmbedding
from voltllm.model.models import qwen4_exp_qsa_decode as qsa
from voltllm.model.models.qwen4_exp_qsa import QSAIndexer, sparse_attention

HEADS, KV_HEADS, HEAD_DIM, N_IDX, D_IDX, RATIO, BUDGET, PAGE = 32, 4, 256, 16, 128, 4, 2048, 16


def setup(context: int, dtype: torch.dtype):
    from types import SimpleNamespace

    cfg = SimpleNamespace(hidden_size=16, indexer_n_heads=N_IDX, indexer_head_dim=D_IDX, indexer_compress_ratio=RATIO,
                          indexer_budget=BUDGET, rms_norm_eps=1e-6,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    indexer = QSAIndexer(cfg, dtype).cuda()
    rotary = RotaryEmbedding(cfg, D_IDX, context + 64, 64).cuda()  # (an nn.Module: cos / sin are buffers)
    blocks = context // PAGE
    table = torch.randperm(blocks, device="cuda").to(torch.int32)
    kv = torch.randn(2, blocks, PAGE, KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    raw = torch.randn(blocks * PAGE, D_IDX, device="cuda", dtype=dtype)
    pooled = torch.zeros_like(raw)
    slots = (table.long()[:, None] * PAGE + torch.arange(PAGE, device="cuda")).reshape(-1)
    pos = torch.arange(context, device="cuda")
    with torch.no_grad():
        qsa.store_pooled_keys(indexer, rotary, raw, pooled, pos, slots, table[None],
                              torch.zeros(context, dtype=torch.long, device="cuda"), PAGE)
    return indexer, rotary, table, kv, raw, pooled, slots


def new_route(indexer, rotary, table, kv, pooled, slots, q_idx, q, first, context, backend):
    out = torch.empty_like(q)
    step = qsa.prompt_rows_per_chunk(indexer, context - 1, qsa.fused_chunk_scores(q_idx))
    for a in range(0, q.shape[0], step):
        b = min(a + step, q.shape[0])
        tok = torch.arange(first + a, first + b, device="cuda")
        vmeta, page = qsa.prompt_selection(indexer, rotary, q_idx[a:b], tok, tok, first + b - 1, pooled, table, PAGE,
                                           slots[first + a:first + b])
        out[a:b] = backend.forward(q[a:b], q[a:b, :KV_HEADS], q[a:b, :KV_HEADS], qsa.paged_view(kv, page), vmeta,
                                   HEAD_DIM ** -0.5, kv_written=True)
    return out


def old_route(indexer, rotary, table, kv, raw, slots, q_idx, q, first, context):
    out = torch.empty_like(q)
    k_all, v_all = gather_kv(kv, table, context)
    keys = raw[slots[:context]]
    for a in range(0, q.shape[0], 256):
        b = min(a + 256, q.shape[0])
        tok = torch.arange(first + a, first + b, device="cuda")
        mask = indexer.selection(q_idx[a:b], tok, keys, rotary)
        out[a:b] = sparse_attention(q[a:b], k_all, v_all, mask, HEAD_DIM ** -0.5)
    return out


def timed(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - t) * 1e3, (torch.cuda.max_memory_allocated() - base) / 2**30


@torch.no_grad()
def one_context(context: int, rows: int, with_old: bool, backend, dtype) -> str:
    torch.manual_seed(0)
    indexer, rotary, table, kv, raw, pooled, slots = setup(context, dtype)
    first = context - rows
    q_idx = torch.randn(rows, N_IDX, D_IDX, device="cuda", dtype=dtype)
    q = torch.randn(rows, HEADS, HEAD_DIM, device="cuda", dtype=dtype)

    def run_new():
        return new_route(indexer, rotary, table, kv, pooled, slots, q_idx, q, first, context, backend)

    run_new()  # (compiles)
    new, t_new, m_new = timed(run_new)
    line = f"context {context:>7} rows {rows}: new {t_new:8.1f} ms, {m_new:6.2f} GiB peak"
    if with_old:
        def run_old():
            return old_route(indexer, rotary, table, kv, raw, slots, q_idx, q, first, context)

        run_old()  # (warms torch's kernels too)
        old, t_old, m_old = timed(run_old)
        diff = (new.float() - old.float()).abs()
        err = (diff.max() / old.float().abs().max()).item()
        rows_off = int((diff.flatten(1).max(1).values > 1e-2 * old.float().abs().max()).sum())
        line += (f" | torch form {t_old:8.1f} ms, {m_old:6.2f} GiB peak | rel diff {err:.1e}, rows off by > 1%: "
                 f"{rows_off}")
    return line


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--skip-old-above", type=int, default=65536)
    ap.add_argument("--dtype", choices=["float16", "float32"], default="float16")
    args = ap.parse_args()
    backend = TritonAttentionBackend()
    for context in args.contexts:
        print(one_context(context, args.rows, context <= args.skip_old_above, backend, getattr(torch, args.dtype)),
              flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
