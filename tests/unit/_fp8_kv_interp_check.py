"""Checks of the FP8 KV cache paths of the Triton attention kernels and backend against the torch reference
(dequantize, then attend in fp32), and of the compat route (bridge + SDPA prefill) for fp8 and fp16 caches.

Run as a script under TRITON_INTERPRET=1 by tests/unit/test_fp8_kv_cache.py; prints one line per check:
    CHECK <name> <ok|FAIL> <detail>
`make_fp8_case` / `run_fp8_case` / `teacher_forced_logits` are also used by tests/unit/test_fp8_kv_cache.py
and tests/gpu/test_fp8_kv_gpu.py.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import torch

from _attention_interp_check import Case, make_case, real_rows, rel_err
from voltllm.attention.backend import AttentionMetadata, make_kv_cache
from voltllm.attention.torch_ref import TorchReferenceBackend
from voltllm.kernels.fp8_codec import scaled_encode_ref

TOL = 2e-3  # relative error ||out - ref|| / ||ref|| (the bound for the fp8 paths)


@dataclass
class Fp8Case:
    base: Case  # q, k, v, meta, scale; base.kv_cache is the uint8 cache (unused slots hold the NaN code)
    fmt: str  # "e4m3" | "e5m2"
    k_scale: torch.Tensor
    v_scale: torch.Tensor


def make_fp8_case(seqs, num_heads, num_kv_heads, head_dim, page, dtype, fmt="e4m3", k_scale=0.37, v_scale=1.9,
                  device="cpu", pad_rows=0, seed=0) -> Fp8Case:
    """make_case, with the cache encoded to fp8 codes (stored = encode(x / scale)). Unused slots are NaN
    in the float case, so they become the NaN code (0x7F / 0xFF) here: a kernel that reads outside a
    context still poisons its output. K/V values are scaled so that x / scale spans the format's range."""
    c = make_case(seqs, num_heads, num_kv_heads, head_dim, page, torch.float32, device="cpu", pad_rows=pad_rows,
                  seed=seed)
    ks = torch.tensor(k_scale, dtype=torch.float32)
    vs = torch.tensor(v_scale, dtype=torch.float32)
    k_cache = c.kv_cache[0] * k_scale
    v_cache = c.kv_cache[1] * v_scale
    cache = torch.stack([scaled_encode_ref(k_cache, ks, fmt), scaled_encode_ref(v_cache, vs, fmt)])
    base = Case(q=c.q.to(dtype).to(device), k=(c.k * k_scale).to(dtype).to(device),
                v=(c.v * v_scale).to(dtype).to(device), kv_cache=cache.to(device), meta=c.meta, scale=c.scale)
    if device != "cpu":
        m = c.meta
        m.query_start_loc, m.seq_lens = m.query_start_loc.to(device), m.seq_lens.to(device)
        m.block_tables, m.slot_mapping = m.block_tables.to(device), m.slot_mapping.to(device)
    return Fp8Case(base, fmt, ks.to(device), vs.to(device))


def fp8_reference(case: Fp8Case, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference output rows [num_tokens], cache after the write), fp32, on the CPU; window: a sliding-window
    layer's."""
    b = case.base
    cache = b.kv_cache.clone()
    ref = TorchReferenceBackend(kv_cache_dtype=f"fp8_{case.fmt}")
    out = ref.forward(b.q.float(), b.k, b.v, cache, b.meta, b.scale, case.k_scale, case.v_scale, window=window)
    return out[:b.meta.num_tokens].cpu(), cache.cpu()


def _codes_off_by_one(got: torch.Tensor, want: torch.Tensor, max_frac: float) -> bool:
    """Only a few codes differ, each from the reference by one step of the same sign (a value at a rounding
    midpoint of the fp8 grid, whose fp32 input differs from the reference's by an ulp)."""
    diff = got != want
    steps = (got[diff].to(torch.int16) - want[diff].to(torch.int16)).abs()
    same_sign = (got[diff] & 0x80) == (want[diff] & 0x80)
    return bool((steps == 1).all() and same_sign.all()) and int(diff.sum()) <= max_frac * got.numel()


def _compare(case: Fp8Case, out: torch.Tensor, cache: Optional[torch.Tensor],
             code_slack: float = 0.0, window: int = 0) -> tuple[float, str]:
    """code_slack > 0: the kernel encodes rows it computed itself (fused RoPE), which may differ from the
    reference rows by an fp32 ulp; up to that fraction of codes may then be one step off (_codes_off_by_one)."""
    ref_out, ref_cache = fp8_reference(case, window)
    m = case.base.meta
    problems = []
    if cache is not None and not torch.equal(cache.cpu(), ref_cache) and not (
            code_slack > 0 and _codes_off_by_one(cache.cpu(), ref_cache, code_slack)):
        problems.append("cache differs from reference write")
    keep = real_rows(case.base)
    err = rel_err(out.cpu()[keep], ref_out[keep[:m.num_tokens]])
    pad = out.cpu()[m.num_tokens:]
    if pad.numel() and not bool((pad == 0).all()):
        problems.append("padding rows not zero")
    return err, "; ".join(problems)


def run_fp8_case(case: Fp8Case, backend=None, kind: str = "backend", **kw) -> tuple[float, str]:
    """kind 'backend': backend.forward (write + attention); 'decode' / 'prefill': the reference write, then
    the kernel alone on a NaN-filled output (kw: kernel options; `window`: a sliding-window layer's, for the
    reference too)."""
    from voltllm.kernels.attention import decode_scratch_numel, paged_decode, paged_prefill
    from voltllm.kernels.fp8_codec import fp8_format
    from voltllm.kernels.kv_fp8 import write_kv_fp8_ref

    b = case.base
    m = b.meta
    cache = b.kv_cache.clone()
    window = kw.get("window", 0)
    if kind == "backend":
        out = backend.forward(b.q, b.k, b.v, cache, m, b.scale, k_scale=case.k_scale, v_scale=case.v_scale, **kw)
        return _compare(case, out, cache, window=window)
    cache_cpu = cache.cpu()
    write_kv_fp8_ref(b.k.cpu(), b.v.cpu(), cache_cpu, m.slot_mapping.cpu(), case.k_scale.cpu(), case.v_scale.cpu(),
                     case.fmt)
    cache = cache_cpu.to(b.q.device)
    out = torch.full_like(b.q, float("nan"))
    fmt = fp8_format(case.fmt)
    if kind == "decode":
        splits = kw.pop("num_splits", 1)
        no, nl = decode_scratch_numel(m.seq_lens.shape[0], b.q.shape[1], splits, b.q.shape[2])
        part_o = torch.full((no,), float("nan"), dtype=torch.float32, device=b.q.device)
        part_l = torch.full((nl,), float("nan"), dtype=torch.float32, device=b.q.device)
        paged_decode(b.q, cache, m.block_tables, m.seq_lens, m.query_start_loc, b.scale, out, num_splits=splits,
                     part_o=part_o, part_lse=part_l, kv_fmt=fmt, k_scale=case.k_scale, v_scale=case.v_scale, **kw)
    else:
        paged_prefill(b.q, cache, m.block_tables, m.seq_lens, m.query_start_loc, b.scale, out,
                      max_query_len=m.max_query_len, kv_fmt=fmt, k_scale=case.k_scale, v_scale=case.v_scale, **kw)
    keep = real_rows(b)[:m.num_tokens]
    ref_out, _ = fp8_reference(case, window)
    return rel_err(out.cpu()[:m.num_tokens][keep], ref_out[keep]), ""


def run_fp8_rope_decode(case: Fp8Case, norm: bool, seed: int, **kw) -> tuple[float, str]:
    """paged_decode with the fused QK-norm + RoPE + fp8 KV store against the reference: the rotated rows
    (kernels.fused references) written by the reference codec, then attended. Codes must match exactly."""
    from _attention_interp_check import decode_poisoned, rope_inputs
    from voltllm.kernels.fp8_codec import fp8_format

    b = case.base
    m = b.meta
    rope, q_rot, k_rot = rope_inputs(b, norm, seed)
    rotated = Fp8Case(Case(q_rot, k_rot, b.v, b.kv_cache, m, b.scale), case.fmt, case.k_scale, case.v_scale)
    cache = b.kv_cache.clone()
    out = decode_poisoned(b.q, cache, m, b.scale, kv_fmt=fp8_format(case.fmt), k_scale=case.k_scale,
                          v_scale=case.v_scale, rope=rope, slot_mapping=m.slot_mapping, **kw)
    return _compare(rotated, out[:m.num_tokens], cache, code_slack=1e-4)


@torch.inference_mode()
def teacher_forced_logits(runner, tokens: list[int], prompt_len: int, backend=None) -> torch.Tensor:
    """Logits predicting tokens[prompt_len:] (and one more) through an engine's model and attention backend:
    the prompt as one prefill step, then one decode step per token (so decode kernels are exercised), on
    fresh caches of the runner's KV dtype. Returns [len(tokens) - prompt_len + 1, vocab] fp32.
    Attention-only models (llama/qwen2/qwen3); eager (no CUDA graphs)."""
    from voltllm.model.forward_context import ForwardContext
    model, dev, bs = runner.model, runner.device, runner.block_size
    backend = backend or runner.backend
    n = len(tokens)
    nblocks = -(-n // bs)
    heads, dim = model.kv_heads_and_dim
    caches = make_kv_cache(model.num_attention_layers, nblocks, bs, heads, dim, runner.kv_dtype, dev)
    table = torch.arange(nblocks, dtype=torch.int32, device=dev)[None]
    ids = torch.tensor(tokens, device=dev)

    def step(s: int, e: int) -> torch.Tensor:
        q = e - s
        meta = AttentionMetadata(
            num_tokens=q, query_start_loc=torch.tensor([0, q], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([e], dtype=torch.int32, device=dev), block_tables=table,
            slot_mapping=torch.arange(s, e, device=dev), max_query_len=q, max_seq_len=e,
            query_start_loc_cpu=[0, q], seq_lens_cpu=[e])
        hidden = model(ids[s:e], torch.arange(s, e, device=dev), ForwardContext(meta, caches, backend))
        return model.compute_logits(hidden[-1:])[0].float()

    return torch.stack([step(0, prompt_len)] + [step(t, t + 1) for t in range(prompt_len, n)])


def check_write_kernel(fmt: str, dtype: torch.dtype) -> tuple[float, str]:
    """Triton fp8 write (strided K/V views, slot -1 rows) equals the reference write bit for bit."""
    from voltllm.kernels.kv_fp8 import write_kv_fp8, write_kv_fp8_ref
    case = make_fp8_case([(40, 19), (5, 5)], 4, 2, 64, 16, dtype, fmt=fmt, pad_rows=2, seed=21)
    b = case.base
    t, h, d = b.k.shape
    fused = torch.randn(t, 4 + 2 * h, d).to(dtype)
    fused[:, 4:4 + h] = b.k
    fused[:, 4 + h:] = b.v
    got, want = b.kv_cache.clone(), b.kv_cache.clone()
    write_kv_fp8(fused[:, 4:4 + h], fused[:, 4 + h:], got, b.meta.slot_mapping, case.k_scale, case.v_scale, fmt,
                 use_triton=True)
    write_kv_fp8_ref(b.k, b.v, want, b.meta.slot_mapping, case.k_scale, case.v_scale, fmt)
    return 0.0, "" if torch.equal(got, want) else "cache differs from reference write"


def check_bridge(fmt: int, dtype: torch.dtype) -> tuple[float, str]:
    """gather_kv_pages into a bigger reused workspace equals the reference gather (fp8: decode * scale)."""
    from voltllm.attention.torch_ref import gather_kv
    from voltllm.kernels.fp8_codec import scaled_decode_ref
    from voltllm.kernels.kv_fp8 import gather_kv_pages
    if fmt >= 0:
        case = make_fp8_case([(70, 70)], 4, 2, 64, 16, dtype, fmt="e4m3" if fmt == 0 else "e5m2", seed=23)
        cache, ks, vs = case.base.kv_cache, case.k_scale, case.v_scale
        bt = case.base.meta.block_tables[0]
        # the prompt rows are not in the cache yet: write them first
        from voltllm.kernels.kv_fp8 import write_kv_fp8_ref
        write_kv_fp8_ref(case.base.k, case.base.v, cache, case.base.meta.slot_mapping, ks, vs, case.fmt)
        kc, vc = gather_kv(cache, bt, 70)
        want_k, want_v = scaled_decode_ref(kc, ks, fmt, dtype), scaled_decode_ref(vc, vs, fmt, dtype)
    else:
        c = make_case([(70, 30)], 4, 2, 64, 16, dtype, seed=24)
        cache, ks, vs, bt = c.kv_cache, None, None, c.meta.block_tables[0]
        from voltllm.attention.torch_ref import write_kv
        write_kv(c.k, c.v, cache, c.meta.slot_mapping)
        want_k, want_v = gather_kv(cache, bt, 70)
    ws = torch.full((2, 200, 2, 64), float("nan"), dtype=dtype)
    k, v = gather_kv_pages(cache, bt, 70, (ws[0], ws[1]), ks, vs, fmt)
    same = torch.equal(k, want_k) and torch.equal(v, want_v) and k.data_ptr() == ws[0].data_ptr()
    untouched = bool(ws[:, 70:].isnan().all())
    return 0.0, "; ".join(p for p, bad in (("bridge differs", not same), ("wrote past ctx", not untouched)) if bad)


def _written_cache_case(seqs, fmt: int, seed: int):
    """(case, k_scale, v_scale) with every prompt row already in the cache (fmt >= 0: fp8 codes, else fp16)."""
    from voltllm.attention.torch_ref import write_kv
    from voltllm.kernels.kv_fp8 import write_kv_fp8_ref
    if fmt >= 0:
        case = make_fp8_case(seqs, 4, 2, 64, 16, torch.float16, seed=seed)
        c, ks, vs = case.base, case.k_scale, case.v_scale
        write_kv_fp8_ref(c.k, c.v, c.kv_cache, c.meta.slot_mapping, ks, vs, case.fmt)
        return c, ks, vs
    c = make_case(seqs, 4, 2, 64, 16, torch.float16, seed=seed)
    write_kv(c.k, c.v, c.kv_cache, c.meta.slot_mapping)
    return c, None, None


def _reference_gather(c, row: int, ctx: int, ks, vs, fmt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request `row`'s first ctx K / V rows as the bridge must write them (fp8: decode * scale, in fp16)."""
    from voltllm.attention.torch_ref import gather_kv
    from voltllm.kernels.fp8_codec import scaled_decode_ref
    k, v = gather_kv(c.kv_cache, c.meta.block_tables[row], ctx)
    if fmt >= 0:
        return scaled_decode_ref(k, ks, fmt, torch.float16), scaled_decode_ref(v, vs, fmt, torch.float16)
    return k, v


def check_gather_fp8_launcher() -> tuple[float, str]:
    """gather_kv_fp8's Triton path (float scales, its own output or a bigger workspace) equals its reference."""
    from voltllm.kernels.kv_fp8 import gather_kv_fp8
    c, _, _ = _written_cache_case([(70, 70)], 1, seed=31)
    bt, problems = c.meta.block_tables[0], []
    for ctx in (1, 33, 70):
        want = gather_kv_fp8(c.kv_cache, bt, ctx, 0.37, 1.9, "e5m2", use_triton=False)
        ws = torch.full((2, 90, 2, 64), float("nan"), dtype=torch.float16)
        for out in (None, (ws[0], ws[1])):
            got = gather_kv_fp8(c.kv_cache, bt, ctx, 0.37, 1.9, "e5m2", out=out, use_triton=True)
            if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
                problems.append(f"ctx {ctx} {'workspace' if out else 'own output'} differs")
        if not bool(ws[:, ctx:].isnan().all()):
            problems.append(f"ctx {ctx}: wrote past ctx")
    return 0.0, "; ".join(problems)


def check_bridge_batch(fmt: int) -> tuple[float, str]:
    """gather_kv_pages_batch of three requests' pages in one launch equals the per-request reference gathers,
    each at rows b * ctx of the workspace, and writes nothing past B * ctx."""
    from voltllm.kernels.kv_fp8 import gather_kv_pages_batch
    c, ks, vs = _written_cache_case([(40, 40), (40, 40), (40, 40)], fmt, seed=25 + (fmt < 0))
    ws = torch.full((2, 200, 2, 64), float("nan"), dtype=torch.float16)
    k, v = gather_kv_pages_batch(c.kv_cache, c.meta.block_tables[:3], 40, (ws[0], ws[1]), ks, vs, fmt)
    problems = []
    for b in range(3):
        want_k, want_v = _reference_gather(c, b, 40, ks, vs, fmt)
        if not (torch.equal(k[b], want_k) and torch.equal(v[b], want_v)):
            problems.append(f"request {b} differs")
    if not torch.equal(k.reshape(120, 2, 64), ws[0, :120]):
        problems.append("not a view of the workspace rows")
    if not bool(ws[:, 120:].isnan().all()):
        problems.append("wrote past B * ctx")
    return 0.0, "; ".join(problems)


def check_compat_equal_runs() -> tuple[float, str]:
    """Runs of consecutive equal requests share a bridge launch and their SDPA launches (one per query head of a
    GQA group), split into pieces that fit the workspace; results equal the reference, decode rows between runs
    and a prefix-chunk run included."""
    from voltllm.attention.triton_backend import TritonAttentionBackend
    seqs = [(24, 24)] * 5 + [(9, 1), (50, 20), (50, 20), (24, 24), (33, 33)]
    be = TritonAttentionBackend(use_tensor_cores=False, kv_cache_dtype="fp8_e4m3", max_context=64)
    err, problems = run_fp8_case(make_fp8_case(seqs, 8, 2, 64, 16, torch.float16, seed=27, pad_rows=2), be)
    # workspace rows 64: the five 24-token prompts go 2 + 2 + 1, the two prefix chunks of context 50 one by one,
    # then two single requests; GROUP = 4 launches per multi-request piece, 1 per single request
    want_launches = 4 + 4 + 1 + 1 + 1 + 1 + 1
    sp = be.sdpa_prefill
    if sp.calls != 9 or sp.launches != want_launches:
        problems = (problems + "; " if problems else "") + f"calls {sp.calls} launches {sp.launches}"
    return err, problems


def check_bridge_varlen(fmt: int) -> tuple[float, str]:
    """gather_kv_pages_varlen: requests of different lengths, block-table rows out of order, at given workspace
    rows, in one launch, equal the reference gathers; rows outside the given ranges stay untouched."""
    from voltllm.kernels.kv_fp8 import gather_kv_pages_varlen
    c, ks, vs = _written_cache_case([(40, 40), (9, 9), (70, 70)], fmt, seed=28 + (fmt < 0))
    plan = torch.tensor([[2, 0, 1], [70, 40, 9], [5, 80, 130]], dtype=torch.int32)  # row, ctx, first row
    ws = torch.full((2, 200, 2, 64), float("nan"), dtype=torch.float16)
    gather_kv_pages_varlen(c.kv_cache, c.meta.block_tables, plan, 70, (ws[0], ws[1]), ks, vs, fmt)
    problems = []
    for row, ctx, start in plan.t().tolist():
        want_k, want_v = _reference_gather(c, row, ctx, ks, vs, fmt)
        if not (torch.equal(ws[0, start:start + ctx], want_k) and torch.equal(ws[1, start:start + ctx], want_v)):
            problems.append(f"request {row} differs")
    untouched = torch.ones(200, dtype=torch.bool)
    for _, ctx, start in plan.t().tolist():
        untouched[start:start + ctx] = False
    if not bool(ws[:, untouched].isnan().all()):
        problems.append("wrote outside the requests' rows")
    return 0.0, "; ".join(problems)


def reference_varlen_attention(q, k, v, bias, cu_q, k_start, max_q, max_k, dropout_p, mask_type, lse, *, scale,
                               seqlen_k):
    """The semantics the compat prefill relies on from torch's `_efficient_attention_forward` with sequence
    offsets (checked against the real op on the GPU): sequence i is query rows cu_q[i]..cu_q[i+1] against keys
    k_start[i]..k_start[i] + seqlen_k[i], bottom-right causal (mask_type 2), in fp32 here."""
    assert bias is None and dropout_p == 0.0 and mask_type == 2 and q.shape[0] == 1
    out = torch.full_like(q, float("nan"))
    for i in range(cu_q.numel() - 1):
        a, b = int(cu_q[i]), int(cu_q[i + 1])
        s0, n = int(k_start[i]), int(seqlen_k[i])
        qs, ks_, vs_ = q[0, a:b].float(), k[0, s0:s0 + n].float(), v[0, s0:s0 + n].float()  # [L, H, D]
        logits = torch.einsum("qhd,khd->hqk", qs, ks_) * scale
        lq = b - a
        allowed = torch.arange(n)[None, :] <= torch.arange(lq)[:, None] + (n - lq)
        logits = logits.masked_fill(~allowed, float("-inf"))
        out[0, a:b] = torch.einsum("hqk,khd->qhd", logits.softmax(-1), vs_).to(q.dtype)
    return (out,)


def check_compat_varlen() -> tuple[float, str]:
    """The varlen form (one bridge + one attention launch per workspace piece, every multi-row request of the
    step joined whatever its lengths) with a reference op in place of torch's CUDA kernel: same output as the
    reference attention; decode rows, prefix chunks, equal runs, one piece split by the workspace."""
    from voltllm.attention.triton_backend import TritonAttentionBackend
    seqs = [(24, 24), (24, 24), (9, 1), (50, 20), (31, 31), (60, 2), (17, 17), (5, 1)]
    be = TritonAttentionBackend(use_tensor_cores=False, kv_cache_dtype="fp8_e4m3", max_context=100)
    be.sdpa_prefill.varlen_op = reference_varlen_attention
    err, problems = run_fp8_case(make_fp8_case(seqs, 8, 2, 64, 16, torch.float16, seed=30, pad_rows=2), be)
    # workspace rows 100; one-row sequences split pieces: 24 + 24 | 50 + 31 | 60 + 17
    sp = be.sdpa_prefill
    if sp.calls != 6 or sp.launches != 3:
        problems = (problems + "; " if problems else "") + f"calls {sp.calls} launches {sp.launches}"
    return err, problems


def check_compat_warm_up() -> tuple[float, str]:
    """The start-up warm-up step (worker/warm_up.py) on the compat backend: its two prompts of unequal lengths take
    the varlen form (one launch), its decode row the decode kernel, and nothing is stored in the cache."""
    import voltllm.attention.triton_backend as tb
    from voltllm.worker.warm_up import mixed_step_metadata

    be = tb.TritonAttentionBackend(use_tensor_cores=False, kv_cache_dtype="fp8_e4m3", max_context=64)
    be.sdpa_prefill.varlen_op = reference_varlen_attention
    cache = make_kv_cache(1, 3, 16, 2, 64, torch.uint8, torch.device("cpu"))[0]
    cache.copy_(torch.randint(0, 0x70, cache.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(5)))
    before = cache.clone()
    meta = mixed_step_metadata(torch.device("cpu"))
    q = torch.randn(meta.num_tokens, 8, 64, generator=torch.Generator().manual_seed(6)).half()
    decode_calls = []
    real = tb.paged_decode
    tb.paged_decode = lambda *a, **k: decode_calls.append(a[4].tolist()) or real(*a, **k)
    try:
        be.forward(q, q[:, :2], q[:, :2], cache, meta, 0.125, kv_written=True)
    finally:
        tb.paged_decode = real
    sp, problems = be.sdpa_prefill, []
    if (sp.calls, sp.launches) != (2, 1):
        problems.append(f"calls {sp.calls} launches {sp.launches}")
    if decode_calls != [meta.query_start_loc_cpu]:
        problems.append(f"decode kernel calls {decode_calls}")
    if not torch.equal(cache, before):
        problems.append("the cache changed")
    return 0.0, "; ".join(problems)


def check_compat_workspace_reused() -> tuple[float, str]:
    """The compat SDPA prefill allocates its workspace once (at max_context) and reuses it."""
    from voltllm.attention.triton_backend import TritonAttentionBackend
    be = TritonAttentionBackend(use_tensor_cores=False, kv_cache_dtype="fp8_e4m3", max_context=512)
    ptrs = []
    for seed, seqs in ((31, [(40, 40), (9, 1)]), (32, [(100, 50), (64, 64)])):
        case = make_fp8_case(seqs, 8, 2, 64, 16, torch.float32, seed=seed)
        err, problems = run_fp8_case(case, be)
        if problems or err > TOL:
            return err, problems or "error too large"
        ptrs.append([t.data_ptr() for t in be.sdpa_prefill._ws.values()])
    nbytes = be.sdpa_prefill.workspace_bytes()
    ok = ptrs[0] == ptrs[1] and len(ptrs[0]) == 1 and nbytes == 2 * 512 * 2 * 64 * 4 and be.sdpa_prefill.calls == 3
    return 0.0, "" if ok else f"workspace not reused: {ptrs} {nbytes} bytes, {be.sdpa_prefill.calls} calls"


def _checks():
    from voltllm.attention.triton_backend import TritonAttentionBackend as TB
    f32, f16 = torch.float32, torch.float16
    decode = [(1, 1), (15, 1), (16, 1), (17, 1), (100, 1), (257, 1)]
    mixed = [(37, 37), (16, 16), (70, 23), (33, 1), (1, 1), (48, 17)]
    # kernels alone (reference write first)
    yield "decode_e4m3_f32_dot_split5", lambda: run_fp8_case(
        make_fp8_case(decode, 8, 2, 64, 16, f32, seed=1), kind="decode", num_splits=5, use_dot=True, block_n=16)
    yield "decode_e4m3_f16_dot_split4_d128", lambda: run_fp8_case(
        make_fp8_case([(200, 1), (47, 1)], 8, 2, 128, 16, f16, seed=2), kind="decode", num_splits=4,
        use_dot=True, block_n=32)
    yield "decode_e4m3_f16_fma_nosplit", lambda: run_fp8_case(
        make_fp8_case(decode, 8, 2, 64, 16, f16, seed=3), kind="decode", num_splits=1, use_dot=False, block_n=16)
    yield "decode_e5m2_f32_fma_split3", lambda: run_fp8_case(
        make_fp8_case([(95, 1), (32, 1), (33, 1)], 4, 1, 64, 32, f32, fmt="e5m2", seed=4), kind="decode",
        num_splits=3, use_dot=False, block_n=16)
    yield "decode_e5m2_f16_lanes_split16", lambda: run_fp8_case(
        make_fp8_case([(200, 1), (33, 1), (1, 1)], 2, 2, 128, 16, f16, fmt="e5m2", seed=5), kind="decode",
        num_splits=16, use_dot=False, fma_lanes=True)
    yield "decode_e4m3_f16_lanes_next_tile_split2", lambda: run_fp8_case(
        make_fp8_case([(200, 1), (33, 1), (1, 1)], 8, 2, 128, 16, f16, seed=7), kind="decode", num_splits=2,
        use_dot=False, fma_lanes=True, next_tile=True)
    yield "decode_e4m3_f32_d80_gqa3_fma", lambda: run_fp8_case(
        make_fp8_case([(50, 1), (19, 1)], 6, 2, 80, 8, f32, seed=6), kind="decode", num_splits=2, use_dot=False,
        block_n=16)
    # QK-norm + RoPE + the fp8 KV store inside the decode kernel
    yield "decode_rope_norm_e4m3_f32_dot_split3", lambda: run_fp8_rope_decode(
        make_fp8_case(decode + [(0, 1)], 8, 2, 64, 16, f32, seed=15), True, 15, num_splits=3, use_dot=True,
        block_n=16)
    yield "decode_rope_e5m2_f32_d128_fma", lambda: run_fp8_rope_decode(
        make_fp8_case([(200, 1), (47, 1)], 8, 2, 128, 16, f32, fmt="e5m2", seed=16), False, 16, num_splits=1,
        use_dot=False, block_n=32)
    yield "prefill_e4m3_f32_mixed", lambda: run_fp8_case(
        make_fp8_case(mixed, 8, 2, 64, 16, f32, seed=7), kind="prefill", config=(16, 16, 4, 1))
    yield "prefill_e5m2_f16_mha_prefix", lambda: run_fp8_case(
        make_fp8_case([(80, 32), (32, 32), (49, 2)], 2, 2, 128, 16, f16, fmt="e5m2", seed=8), kind="prefill",
        config=(16, 32, 4, 1))
    # the backend: write (Triton encode) + attention, native route (tl.dot decode, Triton prefill)
    yield "backend_native_decode_e4m3_padded", lambda: run_fp8_case(
        make_fp8_case(decode + [(0, 1)], 8, 2, 64, 16, f32, seed=9, pad_rows=2),
        TB(use_tensor_cores=True, num_sms=64, kv_cache_dtype="fp8_e4m3"))
    yield "backend_native_prefill_e4m3_f16", lambda: run_fp8_case(
        make_fp8_case([(40, 9), (21, 1), (16, 16)], 8, 2, 64, 16, f16, seed=10, pad_rows=3),
        TB(use_tensor_cores=True, kv_cache_dtype="fp8"))
    # compat route: FMA decode; prefill = bridge + SDPA (decode rows of mixed batches via the FMA kernel)
    yield "backend_compat_decode_e5m2_split", lambda: run_fp8_case(
        make_fp8_case(decode + [(0, 1)], 8, 2, 64, 16, f32, fmt="e5m2", seed=11, pad_rows=1),
        TB(use_tensor_cores=False, num_sms=64, kv_cache_dtype="fp8_e5m2"))
    yield "backend_compat_prefill_e4m3_mixed_f16", lambda: run_fp8_case(
        make_fp8_case(mixed, 8, 2, 64, 16, f16, seed=12, pad_rows=2),
        TB(use_tensor_cores=False, kv_cache_dtype="fp8_e4m3"))
    yield "backend_compat_prefill_e5m2_mha_f32", lambda: run_fp8_case(
        make_fp8_case([(80, 32), (32, 32), (49, 2)], 2, 2, 128, 16, f32, fmt="e5m2", seed=13),
        TB(use_tensor_cores=False, kv_cache_dtype="fp8_e5m2"))
    yield "backend_compat_prefill_fp16_cache", lambda: _compat_fp16_cache()
    # sliding-window layers over fp8 pages: a mixed step on each route, and the kernels alone
    wmixed = [(40, 9), (600, 1), (21, 1), (16, 16), (90, 30)]
    yield "backend_native_mixed_e4m3_window", lambda: run_fp8_case(
        make_fp8_case(wmixed, 8, 2, 64, 16, f32, seed=30, pad_rows=2),
        TB(use_tensor_cores=True, num_sms=64, kv_cache_dtype="fp8_e4m3", decode_rows_split_context=256), window=25)
    yield "backend_compat_mixed_e5m2_window", lambda: run_fp8_case(
        make_fp8_case(wmixed, 8, 2, 64, 16, f32, fmt="e5m2", seed=31, pad_rows=2),
        TB(use_tensor_cores=False, num_sms=64, kv_cache_dtype="fp8_e5m2"), window=25)
    yield "prefill_e4m3_f16_window", lambda: run_fp8_case(
        make_fp8_case(wmixed, 8, 2, 64, 16, f16, seed=32), kind="prefill", config=(16, 16, 4, 1), window=13)
    yield "decode_e4m3_f32_lanes_split3_window", lambda: run_fp8_case(
        make_fp8_case(decode + [(600, 1)], 8, 2, 64, 16, f32, seed=33), kind="decode", num_splits=3,
        use_dot=False, fma_lanes=True, window=40)
    yield "write_e4m3_f16_strided", lambda: check_write_kernel("e4m3", f16)
    yield "write_e5m2_f32_strided", lambda: check_write_kernel("e5m2", f32)
    yield "bridge_e4m3_f16", lambda: check_bridge(0, f16)
    yield "bridge_e5m2_f32", lambda: check_bridge(1, f32)
    yield "bridge_fp16_cache", lambda: check_bridge(-1, f16)
    yield "compat_workspace_reused", check_compat_workspace_reused
    yield "bridge_batch_e4m3", lambda: check_bridge_batch(0)
    yield "bridge_batch_fp16_cache", lambda: check_bridge_batch(-1)
    yield "compat_equal_runs_e4m3", check_compat_equal_runs
    yield "bridge_varlen_e4m3", lambda: check_bridge_varlen(0)
    yield "gather_fp8_launcher_e5m2", check_gather_fp8_launcher
    yield "bridge_varlen_fp16_cache", lambda: check_bridge_varlen(-1)
    yield "compat_varlen_e4m3", check_compat_varlen
    yield "compat_warm_up_mixed_step", check_compat_warm_up


def _compat_fp16_cache() -> tuple[float, str]:
    """The compat route's SDPA prefill on a plain fp16 cache (same path, no codec) vs the reference."""
    from _attention_interp_check import run_backend_case
    from voltllm.attention.triton_backend import TritonAttentionBackend
    case = make_case([(37, 37), (70, 23), (33, 1), (48, 17)], 8, 2, 64, 16, torch.float16, seed=14, pad_rows=2)
    return run_backend_case(case, TritonAttentionBackend(use_tensor_cores=False))


def main() -> int:
    from interp_util import error_checks_main

    return error_checks_main((name, fn, TOL) for name, fn in _checks())


if __name__ == "__main__":
    sys.exit(main())
