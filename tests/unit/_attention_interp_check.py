"""Checks of the Triton attention kernels against voltllm.attention.torch_ref.

Run as a script under TRITON_INTERPRET=1 (set before triton is imported) by
tests/unit/test_attention_kernels_interp.py; prints one line per check:
    CHECK <name> <ok|FAIL> <detail>
The case builder (`make_case`, `run_case`) is also used by tests/gpu/test_attention_kernels.py.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from voltllm.attention.backend import AttentionMetadata
from voltllm.attention.torch_ref import TorchReferenceBackend


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float


def make_case(seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, page: int,
              dtype: torch.dtype, device: str = "cpu", pad_rows: int = 0, seed: int = 0,
              extra_blocks: int = 3) -> Case:
    """seqs: (context length after this step, query length) per sequence. The prefix (context - query)
    is already in the cache; the query rows' K/V come with the step. Unused cache slots hold NaN, so a
    kernel that reads outside a context poisons its output. pad_rows: extra rows with slot -1 past
    num_tokens (CUDA-graph padding)."""
    g = torch.Generator().manual_seed(seed)
    nblocks_per = [math.ceil(ctx / page) for ctx, _ in seqs]
    num_blocks = sum(nblocks_per) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(max(nblocks_per), 1) + 1
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    kv_cache = torch.full((2, num_blocks, page, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    flat = kv_cache.view(2, num_blocks * page, num_kv_heads, head_dim)
    slots, qsl, used = [], [0], 0
    for i, (ctx, ql) in enumerate(seqs):
        assert 0 <= ql <= ctx or (ctx == 0 and ql <= 1)
        blocks = perm[used:used + nblocks_per[i]]
        used += nblocks_per[i]
        block_tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        tok_slots = [blocks[t // page] * page + t % page for t in range(ctx)]
        prefix = ctx - ql
        if prefix > 0:
            idx = torch.tensor(tok_slots[:prefix])
            flat[:, idx] = torch.randn(2, prefix, num_kv_heads, head_dim, generator=g).to(dtype)
        if ctx == 0:  # padding sequence of a graph batch: one row, nothing to write
            slots += [-1] * ql
        else:
            slots += tok_slots[prefix:]
        qsl.append(qsl[-1] + ql)
    num_tokens = qsl[-1]
    t = num_tokens + pad_rows
    q = torch.randn(t, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(t, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(t, num_kv_heads, head_dim, generator=g).to(dtype)
    slot_mapping = torch.tensor(slots + [-1] * pad_rows, dtype=torch.int64)
    meta = AttentionMetadata(
        num_tokens=num_tokens,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([c for c, _ in seqs], dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        slot_mapping=slot_mapping.to(device),
        max_query_len=max(ql for _, ql in seqs),
        max_seq_len=max(c for c, _ in seqs),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=[c for c, _ in seqs],
    )
    return Case(q.to(device), k.to(device), v.to(device), kv_cache.to(device), meta, 1.0 / math.sqrt(head_dim))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def reference(case: Case, **window) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference output (first num_tokens rows) and cache after the write: TorchReferenceBackend in fp32
    on the case's device, returned on the CPU. window: a sliding-window layer's `window` / `query_positions`."""
    cache = case.kv_cache.clone()
    out = TorchReferenceBackend().forward(case.q.float(), case.k, case.v, cache, case.meta, case.scale, **window)
    return out[:case.meta.num_tokens].cpu(), cache.cpu()


def real_rows(case: Case) -> torch.Tensor:
    """Rows that belong to a sequence with context (padding sequences with seq_len 0 excluded)."""
    m = case.meta
    keep = torch.zeros(case.q.shape[0], dtype=torch.bool)
    for i, ctx in enumerate(m.seq_lens_cpu):
        if ctx > 0:
            keep[m.query_start_loc_cpu[i]:m.query_start_loc_cpu[i + 1]] = True
    return keep


def run_backend_case(case: Case, backend, **window) -> tuple[float, str]:
    """Runs backend.forward on the case; returns (relative error on real rows, problem text or ''). window: a
    sliding-window layer's `window` / `query_positions`."""
    ref_out, ref_cache = reference(case, **window)
    cache = case.kv_cache.clone()
    out = backend.forward(case.q, case.k, case.v, cache, case.meta, case.scale, **window)
    problems = []
    if not torch.allclose(cache.cpu().float(), ref_cache.float(), equal_nan=True, rtol=0, atol=0):
        problems.append("cache differs from reference write")
    keep = real_rows(case)
    m = case.meta
    err = rel_err(out.cpu()[keep], ref_out[keep[:m.num_tokens]])
    pad = out.cpu()[m.num_tokens:]
    if pad.numel() and not bool((pad == 0).all()):
        problems.append("padding rows not zero")
    for i, ctx in enumerate(m.seq_lens_cpu):  # graph-padding sequences: finite, zero output
        if ctx == 0:
            rows = out.cpu()[m.query_start_loc_cpu[i]:m.query_start_loc_cpu[i + 1]]
            if not bool((rows == 0).all()):
                problems.append("empty sequence row not zero")
    return err, "; ".join(problems)


def run_kernel_case(case: Case, kind: str, **kw) -> tuple[float, str]:
    """Runs kv_write + one kernel directly (poisoned output); kind: 'decode' or 'prefill'. A `window` (and, for
    decode, `query_positions`) in kw goes to the reference too."""
    from voltllm.kernels.attention import decode_scratch_numel, kv_write, paged_decode, paged_prefill
    ref_out, ref_cache = reference(case, **{k: kw[k] for k in ("window", "query_positions") if k in kw})
    m = case.meta
    cache = case.kv_cache.clone()
    kv_write(case.k, case.v, cache, m.slot_mapping)
    out = torch.full_like(case.q, float("nan"))
    if kind == "decode":
        splits = kw.pop("num_splits", 1)
        no, nl = decode_scratch_numel(m.seq_lens.shape[0], case.q.shape[1], splits, case.q.shape[2])
        part_o = torch.full((no,), float("nan"), dtype=torch.float32, device=case.q.device)
        part_l = torch.full((nl,), float("nan"), dtype=torch.float32, device=case.q.device)
        paged_decode(case.q, cache, m.block_tables, m.seq_lens, m.query_start_loc, case.scale, out,
                     num_splits=splits, part_o=part_o, part_lse=part_l, **kw)
    else:
        paged_prefill(case.q, cache, m.block_tables, m.seq_lens, m.query_start_loc, case.scale, out,
                      max_query_len=m.max_query_len, **kw)
    problems = []
    if not torch.allclose(cache.cpu().float(), ref_cache.float(), equal_nan=True, rtol=0, atol=0):
        problems.append("cache differs from reference write")
    keep = real_rows(case)[:m.num_tokens]
    err = rel_err(out.cpu()[:m.num_tokens][keep], ref_out[keep])
    return err, "; ".join(problems)


def run_prefill_skip_case(case: Case, **kw) -> tuple[float, str]:
    """paged_prefill(min_query_len=2) on a poisoned output: the rows of multi-row sequences match the reference,
    the one-row sequences' rows are left untouched (still NaN: the decode kernel writes those)."""
    from voltllm.kernels.attention import kv_write, paged_prefill
    ref_out, _ = reference(case)
    m = case.meta
    cache = case.kv_cache.clone()
    kv_write(case.k, case.v, cache, m.slot_mapping)
    out = torch.full_like(case.q, float("nan"))
    paged_prefill(case.q, cache, m.block_tables, m.seq_lens, m.query_start_loc, case.scale, out,
                  max_query_len=m.max_query_len, min_query_len=2, **kw)
    qsl = m.query_start_loc_cpu
    multi = torch.zeros(m.num_tokens, dtype=torch.bool)
    for i in range(len(m.seq_lens_cpu)):
        if qsl[i + 1] - qsl[i] > 1:
            multi[qsl[i]:qsl[i + 1]] = True
    problems = []
    if not bool(out.cpu()[:m.num_tokens][~multi].isnan().all()):
        problems.append("a one-row sequence's row was written")
    keep = real_rows(case)[:m.num_tokens] & multi
    return rel_err(out.cpu()[:m.num_tokens][keep], ref_out[keep]), "; ".join(problems)


def rope_inputs(case: Case, norm: bool, seed: int):
    """For a decode case: (DecodeRope over the case's k / v as unrotated rows, q rotated, k rotated) where the
    rotated rows are what the unfused QK-norm + RoPE path writes (kernels.fused references). Positions are
    seq_len - 1 per sequence (0 for padding); the norm weights are random around 1."""
    from voltllm.attention.backend import DecodeRope
    from voltllm.kernels.fused import qk_norm_rope_inplace_ref, rope_inplace_ref
    g = torch.Generator().manual_seed(seed)
    m, dev = case.meta, case.q.device
    t, _, d = case.q.shape
    pos = torch.zeros(t, dtype=torch.int64)
    for i, ctx in enumerate(m.seq_lens_cpu):
        pos[m.query_start_loc_cpu[i]:m.query_start_loc_cpu[i + 1]] = max(ctx - 1, 0)
    freqs = torch.outer(torch.arange(max(m.seq_lens_cpu) + 8).float(),
                        1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))
    cos, sin = freqs.cos(), freqs.sin()
    qw = kw = None
    q_rot, k_rot = case.q.cpu().clone(), case.k.cpu().clone()
    if norm:
        qw = (1 + 0.2 * torch.randn(d, generator=g)).to(case.q.dtype)
        kw = (1 + 0.2 * torch.randn(d, generator=g)).to(case.q.dtype)
        qk_norm_rope_inplace_ref(q_rot, k_rot, qw, kw, 1e-6, pos, cos, sin, d)
        qw, kw = qw.to(dev), kw.to(dev)
    else:
        rope_inplace_ref(q_rot, k_rot, pos, cos, sin, d)
    rope = DecodeRope(case.k, case.v, pos.to(dev), cos.to(dev), sin.to(dev), qw, kw, 1e-6)
    return rope, q_rot.to(dev), k_rot.to(dev)


def run_rope_window_case(case: Case, seed: int, window: int, **kw) -> tuple[float, str]:
    """run_rope_decode_case for a sliding-window layer (the window placed by the context's last position)."""
    rope, q_rot, k_rot = rope_inputs(case, False, seed)
    m = case.meta
    ref_out, _ = reference(Case(q_rot, k_rot, case.v, case.kv_cache, m, case.scale), window=window)
    cache = case.kv_cache.clone()
    out = decode_poisoned(case.q, cache, m, case.scale, rope=rope, slot_mapping=m.slot_mapping, window=window, **kw)
    keep = real_rows(case)[:m.num_tokens]
    return rel_err(out.cpu()[:m.num_tokens][keep], ref_out[keep]), ""


def decode_poisoned(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    **kw) -> torch.Tensor:
    """paged_decode into a NaN-filled output with NaN-filled split-KV scratch (kw: its options, num_splits too)."""
    from voltllm.kernels.attention import decode_scratch_numel, paged_decode
    out = torch.full_like(q, float("nan"))
    splits = kw.pop("num_splits", 1)
    no, nl = decode_scratch_numel(meta.seq_lens.shape[0], q.shape[1], splits, q.shape[2])
    part_o = torch.full((no,), float("nan"), dtype=torch.float32, device=q.device)
    part_l = torch.full((nl,), float("nan"), dtype=torch.float32, device=q.device)
    paged_decode(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, out, num_splits=splits,
                 part_o=part_o, part_lse=part_l, **kw)
    return out


def run_rope_decode_case(case: Case, norm: bool, seed: int, **kw) -> tuple[float, str]:
    """paged_decode with the fused QK-norm + RoPE + KV store (unrotated q / k in) against the reference write
    and attention of the rotated rows; the cache must match the reference write to rounding."""
    rope, q_rot, k_rot = rope_inputs(case, norm, seed)
    m = case.meta
    ref_out, ref_cache = reference(Case(q_rot, k_rot, case.v, case.kv_cache, m, case.scale))
    cache = case.kv_cache.clone()
    out = decode_poisoned(case.q, cache, m, case.scale, rope=rope, slot_mapping=m.slot_mapping, **kw)
    problems = []
    rtol = 1e-5 if case.q.dtype == torch.float32 else 1e-2  # (the norm's sum of squares may round differently)
    if not torch.allclose(cache.cpu().float(), ref_cache.float(), equal_nan=True, rtol=rtol, atol=rtol):
        problems.append("cache differs from reference write")
    keep = real_rows(case)[:m.num_tokens]
    return rel_err(out.cpu()[:m.num_tokens][keep], ref_out[keep]), "; ".join(problems)


def positions_before_end(case: Case, behind: list[int]) -> torch.Tensor:
    """int64 positions of a decode case's rows: sequence i's row `behind[i]` positions before its context's last one
    (as the DFlash drafter's block rows, which see the rest of their block)."""
    m = case.meta
    pos = torch.zeros(case.q.shape[0], dtype=torch.int64)
    for i, ctx in enumerate(m.seq_lens_cpu):
        pos[m.query_start_loc_cpu[i]:m.query_start_loc_cpu[i + 1]] = max(ctx - 1 - behind[i % len(behind)], 0)
    return pos.to(case.q.device)


def check_kv_write_strided(seed: int) -> tuple[float, str]:
    """kv_write from K/V views of a fused qkv buffer (row stride != H*D), with -1 slots."""
    from voltllm.kernels.attention import kv_write
    case = make_case([(40, 19), (5, 5)], 4, 2, 64, 16, torch.float32, seed=seed, pad_rows=2)
    t, h, d = case.k.shape
    fused = torch.randn(t, 4 + 2 * h, d)
    fused[:, 4:4 + h] = case.k
    fused[:, 4 + h:] = case.v
    cache = case.kv_cache.clone()
    kv_write(fused[:, 4:4 + h], fused[:, 4 + h:], cache, case.meta.slot_mapping)
    _, ref_cache = reference(case)
    same = torch.allclose(cache, ref_cache, equal_nan=True, rtol=0, atol=0)
    return 0.0, "" if same else "cache differs from reference write"


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _checks():
    from voltllm.attention.triton_backend import TritonAttentionBackend
    f32, f16 = torch.float32, torch.float16
    mixed = [(37, 37), (16, 16), (70, 23), (33, 1), (1, 1), (48, 17)]
    decode = [(1, 1), (15, 1), (16, 1), (17, 1), (100, 1), (257, 1)]
    yield "prefill_f32_d64_gqa4_mixed", lambda: run_kernel_case(
        make_case(mixed, 8, 2, 64, 16, f32, seed=1), "prefill", config=(16, 16, 4, 1)), f32
    yield "prefill_f32_d64_gqa4_tile32", lambda: run_kernel_case(
        make_case([(64, 40), (31, 31)], 8, 2, 64, 16, f32, seed=2), "prefill", config=(32, 16, 4, 1)), f32
    yield "prefill_f16_d128_mha_prefix", lambda: run_kernel_case(
        make_case([(80, 32), (32, 32), (49, 2)], 2, 2, 128, 16, f16, seed=3), "prefill",
        config=(16, 32, 4, 1)), f16
    yield "prefill_f32_d64_query_len1", lambda: run_kernel_case(
        make_case(decode, 8, 2, 64, 16, f32, seed=4), "prefill", config=(16, 16, 4, 1)), f32
    yield "decode_f32_d64_gqa4_nosplit_dot", lambda: run_kernel_case(
        make_case(decode, 8, 2, 64, 16, f32, seed=5), "decode", num_splits=1, use_dot=True, block_n=16), f32
    yield "decode_f32_d64_gqa4_split5_fma", lambda: run_kernel_case(
        make_case(decode, 8, 2, 64, 16, f32, seed=6), "decode", num_splits=5, use_dot=False, block_n=16), f32
    yield "decode_f32_d64_gqa4_split16_dot_empty_parts", lambda: run_kernel_case(
        make_case(decode, 8, 2, 64, 16, f32, seed=7), "decode", num_splits=16, use_dot=True, block_n=16), f32
    yield "decode_f16_d128_mha_split3_fma", lambda: run_kernel_case(
        make_case([(200, 1), (33, 1), (64, 1)], 2, 2, 128, 16, f16, seed=8), "decode", num_splits=3,
        use_dot=False, block_n=32), f16
    yield "decode_f16_d128_gqa4_split4_dot", lambda: run_kernel_case(
        make_case([(200, 1), (47, 1)], 8, 2, 128, 16, f16, seed=9), "decode", num_splits=4,
        use_dot=True, block_n=32), f16
    yield "decode_f32_d80_gqa3_split2_fma", lambda: run_kernel_case(
        make_case([(50, 1), (19, 1)], 6, 2, 80, 8, f32, seed=10), "decode", num_splits=2, use_dot=False,
        block_n=16), f32
    yield "decode_f32_d64_page32_tile16_split3", lambda: run_kernel_case(
        make_case([(95, 1), (32, 1), (33, 1)], 4, 1, 64, 32, f32, seed=13), "decode", num_splits=3,
        use_dot=False, block_n=16), f32
    yield "decode_f32_d64_gqa4_split5_lanes", lambda: run_kernel_case(
        make_case(decode, 8, 2, 64, 16, f32, seed=15), "decode", num_splits=5, use_dot=False, fma_lanes=True,
        block_n=8), f32
    yield "decode_f16_d128_mha_split16_lanes_empty_parts", lambda: run_kernel_case(
        make_case([(200, 1), (33, 1), (1, 1)], 2, 2, 128, 16, f16, seed=16), "decode", num_splits=16,
        use_dot=False, fma_lanes=True), f16
    # the first tile loaded before the PDL wait (where it lies below the step's new row): slices of 0-4 tiles,
    # a sequence whose only tile holds the new row, block boundaries
    yield "decode_f32_d64_gqa4_split3_dot_early_tile", lambda: run_kernel_case(
        make_case(decode + [(33, 1), (48, 1)], 8, 2, 64, 16, f32, seed=22), "decode", num_splits=3, use_dot=True,
        block_n=16, early_tile=True), f32
    yield "decode_f16_d128_gqa4_nosplit_fma_early_tile", lambda: run_kernel_case(
        make_case([(200, 1), (32, 1), (33, 1), (1, 1)], 8, 2, 128, 16, f16, seed=23), "decode", num_splits=1,
        use_dot=False, block_n=32, early_tile=True), f16
    # the per-lane route's next-tile register prefetch: slices of 0-3 tiles, odd lengths, block boundaries
    yield "decode_f32_d64_gqa4_split3_lanes_next_tile", lambda: run_kernel_case(
        make_case([(95, 1), (32, 1), (33, 1), (1, 1), (17, 1)], 8, 2, 64, 16, f32, seed=20), "decode",
        num_splits=3, use_dot=False, fma_lanes=True, block_n=8, next_tile=True), f32
    yield "decode_f16_d128_gqa4_nosplit_lanes_next_tile", lambda: run_kernel_case(
        make_case([(200, 1), (47, 1), (16, 1)], 8, 2, 128, 16, f16, seed=21), "decode", num_splits=1,
        use_dot=False, fma_lanes=True, next_tile=True), f16
    # QK-norm + RoPE + KV store inside the decode kernel (graph padding: a seq_len-0 sequence, slot -1)
    yield "decode_rope_norm_f32_d64_gqa4_split5_dot", lambda: run_rope_decode_case(
        make_case(decode + [(0, 1)], 8, 2, 64, 16, f32, seed=18), True, 18, num_splits=5, use_dot=True,
        block_n=16), f32
    yield "decode_rope_f16_d128_gqa4_nosplit_fma", lambda: run_rope_decode_case(
        make_case([(200, 1), (47, 1), (1, 1)], 8, 2, 128, 16, f16, seed=19), False, 19, num_splits=1,
        use_dot=False, block_n=32), f16
    yield "decode_rope_norm_f16_d128_split3_lanes", lambda: run_rope_decode_case(
        make_case([(95, 1), (32, 1), (0, 1)], 4, 2, 128, 16, f16, seed=20), True, 20, num_splits=3,
        use_dot=False, fma_lanes=True, block_n=16), f16
    yield "kv_write_strided_inputs", lambda: check_kv_write_strided(seed=14), f32
    # the backend: pure decode with graph padding (a seq_len-0 sequence and rows past num_tokens),
    # split count from the heuristic with a fake large SM count; then a mixed batch through prefill
    yield "backend_decode_split_padded", lambda: run_backend_case(
        make_case(decode + [(0, 1)], 8, 2, 64, 16, f32, seed=11, pad_rows=2),
        TritonAttentionBackend(use_tensor_cores=False, num_sms=64, fma_lanes=True)), f32
    # one SM: 4 sequences x 2 kv heads count as many programs, so the per-lane route takes its half tile (BLOCK_N 8)
    yield "backend_decode_lanes_half_tile", lambda: run_backend_case(
        make_case([(95, 1), (33, 1), (16, 1), (0, 1)], 8, 2, 128, 16, f16, seed=21, pad_rows=1),
        TritonAttentionBackend(use_tensor_cores=False, num_sms=1, fma_lanes=True)), f16
    yield "backend_decode_fma_rows", lambda: run_backend_case(
        make_case(decode + [(0, 1)], 8, 2, 64, 16, f32, seed=17, pad_rows=1),
        TritonAttentionBackend(use_tensor_cores=False, num_sms=64, fma_lanes=False)), f32
    yield "prefill_f32_d64_skips_one_row_sequences", lambda: run_prefill_skip_case(
        make_case([(40, 9), (21, 1), (16, 16), (300, 1)], 8, 2, 64, 16, f32, seed=22), config=(16, 16, 4, 1)), f32
    # a mixed step whose decode rows have long contexts: those through the decode kernel with split-KV (3 parts at
    # 600 tokens), the prefill kernel skipping one-row sequences; a short-context decode row too
    yield "backend_mixed_long_decode_rows_split", lambda: run_backend_case(
        make_case([(40, 9), (600, 1), (300, 1), (16, 16), (33, 1)], 8, 2, 64, 16, f32, seed=23, pad_rows=2),
        TritonAttentionBackend(num_sms=64, decode_rows_split_context=256)), f32
    yield "backend_mixed_prefill_padded", lambda: run_backend_case(
        make_case([(40, 9), (21, 1), (16, 16)], 8, 2, 64, 16, f32, seed=12, pad_rows=3),
        TritonAttentionBackend()), f32
    # sliding-window layers: windows shorter than, equal to and longer than contexts, of one key; prompts whose
    # rows' windows start in different tiles; decode rows whose positions lie before their context's end (the DFlash
    # drafter's block rows), split-KV with empty parts, each decode route
    windowed = [(70, 23), (37, 37), (33, 1), (1, 1), (48, 17), (130, 64)]
    for w in (1, 20, 48, 200):
        yield f"prefill_f32_d64_gqa4_window{w}", (lambda w=w: run_kernel_case(
            make_case(windowed, 8, 2, 64, 16, f32, seed=30 + w), "prefill", config=(16, 16, 4, 1), window=w)), f32
    wdecode = decode + [(33, 1), (64, 1)]
    for route, opts in (("dot", {"use_dot": True, "block_n": 16}), ("fma", {"use_dot": False, "block_n": 16}),
                        ("lanes", {"use_dot": False, "fma_lanes": True, "block_n": 8}),
                        ("lanes_next_tile", {"use_dot": False, "fma_lanes": True, "block_n": 8, "next_tile": True})):
        for splits in (1, 5):
            yield f"decode_f32_d64_gqa4_split{splits}_{route}_window", (lambda route=route, opts=opts, splits=splits: (
                lambda case: run_kernel_case(case, "decode", num_splits=splits, window=37,
                                             query_positions=positions_before_end(case, [0, 3, 15, 1]), **opts))(
                make_case(wdecode, 8, 2, 64, 16, f32, seed=40 + splits))), f32
    yield "decode_f16_d128_gqa4_split3_dot_window_by_context", lambda: run_kernel_case(
        make_case([(200, 1), (47, 1), (16, 1), (0, 1)], 8, 2, 128, 16, f16, seed=45), "decode", num_splits=3,
        use_dot=True, block_n=32, window=40), f16
    yield "decode_rope_f16_d128_gqa4_split2_fma_window", lambda: run_rope_window_case(
        make_case([(200, 1), (47, 1), (1, 1)], 8, 2, 128, 16, f16, seed=46), 19, window=30, num_splits=2,
        use_dot=False, block_n=32), f16
    for name, backend in (("native", TritonAttentionBackend(num_sms=64, decode_rows_split_context=256)),
                          ("compat", TritonAttentionBackend(use_tensor_cores=False, num_sms=64))):
        yield f"backend_{name}_mixed_window", (lambda backend=backend: run_backend_case(
            make_case([(40, 9), (600, 1), (21, 1), (16, 16), (90, 30)], 8, 2, 64, 16, f32, seed=47, pad_rows=2),
            backend, window=25)), f32
        yield f"backend_{name}_equal_run_window", (lambda backend=backend: run_backend_case(
            make_case([(50, 20), (50, 20), (50, 20)], 8, 2, 64, 16, f32, seed=49), backend, window=12)), f32
        yield f"backend_{name}_decode_window_positions", (lambda backend=backend: (lambda case: run_backend_case(
            case, backend, window=25, query_positions=positions_before_end(case, [2, 0, 7])))(
            make_case(wdecode + [(0, 1)], 8, 2, 64, 16, f32, seed=48, pad_rows=2))), f32



def main() -> int:
    from interp_util import error_checks_main

    return error_checks_main((name, fn, TOL[dtype]) for name, fn, dtype in _checks())


if __name__ == "__main__":
    sys.exit(main())
