"""Triton attention kernels and the TRITON_ATTN backend on CUDA at real shapes, against torch_ref.

fp16 and bf16, head dims 64/128/256, GQA and MHA, odd lengths and block boundaries, long contexts
(32K) with split-KV, chunked prefill over a prefix, mixed prefill/decode batches, CUDA-graph padding
(seq_len-0 sequences, slot -1 rows), CUDA-graph capture/replay of decode. Fresh random inputs each run
(the seed is printed); outputs and split-KV scratch are poisoned with NaN before each call; unused cache
slots hold NaN. Ends with timing prints (not assertions): decode bandwidth vs bytes read, prefill TFLOP/s.
"""
from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest
import torch

from gpu_timing import graph_time_us

pytestmark = pytest.mark.gpu

_spec = importlib.util.spec_from_file_location(
    "_attention_interp_check", Path(__file__).resolve().parents[1] / "unit" / "_attention_interp_check.py")
H = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = H  # dataclasses need the module registered
_spec.loader.exec_module(H)

DEV = "cuda"
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float16, torch.bfloat16]
DIMS = [64, 128, 256]


def _seed(tag: str) -> int:
    s = random.SystemRandom().randrange(1 << 30)
    print(f"[{tag}] seed={s}")
    return s


def _backend(**kw):
    from voltllm.attention.triton_backend import TritonAttentionBackend
    return TritonAttentionBackend(**kw)


def _poison_allocator(case: H.Case) -> None:
    """Leave a NaN-filled block of the output's size in the caching allocator, so the backend's
    torch.empty output most likely starts as NaN."""
    x = torch.full_like(case.q, float("nan"))
    del x


def _poison_scratch(backend) -> None:
    for o, l in backend._scratch.values():
        o.fill_(float("nan"))
        l.fill_(float("nan"))


def _check(case, backend, dtype, tag):
    _poison_allocator(case)
    _poison_scratch(backend)
    err, problems = H.run_backend_case(case, backend)
    print(f"[{tag}] relerr={err:.2e}")
    assert not problems, f"{tag}: {problems}"
    assert err < TOL[dtype], f"{tag}: relerr {err:.3e}"


def _heads(d):
    return (16, 4) if d < 256 else (8, 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", DIMS)
def test_decode(dtype, d):
    hq, hkv = _heads(d)
    seqs = [(1, 1), (17, 1), (255, 1), (256, 1), (1000, 1), (4097, 1), (12345, 1), (0, 1)]
    case = H.make_case(seqs, hq, hkv, d, 16, dtype, device=DEV, pad_rows=3, seed=_seed(f"decode {dtype} d{d}"))
    _check(case, _backend(), dtype, "auto")                            # tensor cores, split-KV by heuristic
    _check(case, _backend(use_tensor_cores=False, fma_lanes=True), dtype, "fma-lanes")  # sm70 route
    _check(case, _backend(use_tensor_cores=False, fma_lanes=False), dtype, "fma-rows")
    _check(case, _backend(num_sms=1), dtype, "one-split")             # no split
    # the per-lane route also with its next-tile prefetch, at the default tile and the half tile the rule pairs it with
    for splits, use_dot, lanes, kw in ((7, True, False, {}), (7, False, False, {}), (3, False, True, {}),
                                       (3, False, True, dict(next_tile=True)),
                                       (1, False, True, dict(next_tile=True, block_n=8))):
        err, problems = H.run_kernel_case(case, "decode", num_splits=splits, use_dot=use_dot, fma_lanes=lanes, **kw)
        assert not problems and err < TOL[dtype], (splits, use_dot, lanes, kw, err, problems)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
def test_decode_fused_rope(dtype, d):
    """QK-norm + RoPE + KV store inside the decode kernel (unrotated q / k in) against the unfused reference, on
    every decode route and split count, with graph padding (a seq_len-0 sequence)."""
    hq, hkv = (32, 8) if d == 128 else (9, 3)
    seqs = [(1, 1), (17, 1), (190, 1), (256, 1), (4097, 1), (0, 1)] + [(128 + i, 1) for i in range(58)]
    case = H.make_case(seqs, hq, hkv, d, 16, dtype, device=DEV, seed=_seed(f"rope decode {dtype} d{d}"))
    for norm in (False, True):
        for splits, use_dot, lanes in ((1, True, False), (6, True, False), (1, False, False), (3, False, True)):
            err, problems = H.run_rope_decode_case(case, norm, 7, num_splits=splits, use_dot=use_dot,
                                                   fma_lanes=lanes)
            assert not problems and err < TOL[dtype], (norm, splits, use_dot, lanes, err, problems)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", DIMS)
def test_prefill_mixed(dtype, d):
    hq, hkv = _heads(d)
    # full prompts, a chunk over a prefix, a short chunk over a long prefix, decode rows, block-exact
    seqs = [(1000, 1000), (777, 300), (4129, 57), (300, 1), (64, 64), (2049, 2049), (33, 1)]
    case = H.make_case(seqs, hq, hkv, d, 16, dtype, device=DEV, pad_rows=5, seed=_seed(f"prefill {dtype} d{d}"))
    _check(case, _backend(), dtype, "prefill")
    # the decode rows through split-KV paged decode, the prefill kernel skipping them (min_query_len)
    _check(case, _backend(decode_rows_split_context=256), dtype, "prefill + split decode rows")
    _check(case, _backend(decode_rows_split_context=256, use_tensor_cores=False), dtype, "compat decode rows")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("window", [1, 100, 4096])
def test_sliding_window(dtype, window):
    """Sliding-window layers at real shapes: a mixed batch (prompts, chunks over prefixes, long-context decode rows
    through split-KV) on the native and compat routes; decode rows whose positions lie before their context's end (the
    DFlash drafter's block rows) on every decode route."""
    seqs = [(1000, 1000), (777, 300), (4129, 57), (300, 1), (9000, 1), (64, 64), (33, 1)]
    case = H.make_case(seqs, 32, 8, 128, 16, dtype, device=DEV, pad_rows=5,
                       seed=_seed(f"window {window} {dtype}"))
    for tag, backend in (("native", _backend(decode_rows_split_context=256)),
                         ("compat", _backend(use_tensor_cores=False))):
        _poison_allocator(case)
        err, problems = H.run_backend_case(case, backend, window=window)
        assert not problems and err < TOL[dtype], (tag, window, err, problems)
    case = H.make_case([(1, 1), (17, 1), (300, 1), (4097, 1), (12345, 1), (0, 1)], 32, 8, 128, 16, dtype,
                       device=DEV, seed=_seed(f"window positions {window} {dtype}"))
    pos = H.positions_before_end(case, [0, 3, 15, 7])
    for splits, use_dot, lanes in ((1, True, False), (9, True, False), (4, False, False), (4, False, True)):
        err, problems = H.run_kernel_case(case, "decode", num_splits=splits, use_dot=use_dot, fma_lanes=lanes,
                                          window=window, query_positions=pos)
        assert not problems and err < TOL[dtype], (window, splits, use_dot, lanes, err, problems)


def test_prefill_mha_and_small_query_tiles():
    dtype = torch.float16
    case = H.make_case([(513, 200), (70, 70), (19, 3)], 8, 8, 128, 16, dtype, device=DEV,
                       seed=_seed("prefill mha"))
    _check(case, _backend(), dtype, "mha")
    case = H.make_case([(600, 3), (91, 2), (1200, 4)], 32, 8, 128, 16, dtype, device=DEV,
                       seed=_seed("prefill spec-verify"))
    _check(case, _backend(), dtype, "short-queries")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_long_context(dtype):
    seqs = [(32768, 1), (32768 - 5, 1), (20001, 1)]
    case = H.make_case(seqs, 32, 8, 128, 16, dtype, device=DEV, seed=_seed(f"long decode {dtype}"))
    _check(case, _backend(), dtype, "long decode auto")
    _check(case, _backend(use_tensor_cores=False, fma_lanes=True), dtype, "long decode fma-lanes")
    _check(case, _backend(use_tensor_cores=False, fma_lanes=False), dtype, "long decode fma-rows")
    _check(case, _backend(num_sms=1), dtype, "long decode one split")
    case = H.make_case([(32768, 512), (9000, 1)], 32, 8, 128, 16, dtype, device=DEV,
                       seed=_seed(f"long chunk {dtype}"))
    _check(case, _backend(), dtype, "chunk over 32K prefix")


def test_cuda_graph_decode_matches_eager():
    dtype = torch.float16
    case = H.make_case([(100, 1), (3000, 1), (17, 1), (1, 1)], 32, 8, 128, 16, dtype, device=DEV,
                       seed=_seed("graph"))
    case.meta.max_seq_len = 32768  # the runner fixes the bound at capture time
    be = _backend()
    be.reserve(4, 32, 8, 128, 32768, torch.device(DEV))
    assert be.num_splits_for(4, 8, 32768, torch.device(DEV)) > 1
    cache = case.kv_cache.clone()
    eager = be.forward(case.q, case.k, case.v, cache, case.meta, case.scale).clone()
    ref, _ = H.reference(case)
    assert H.rel_err(eager.cpu(), ref) < TOL[dtype]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        be.forward(case.q, case.k, case.v, cache, case.meta, case.scale)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = be.forward(case.q, case.k, case.v, cache, case.meta, case.scale)
    static_out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager)
    # new contents in the same static tensors (longer contexts, new q) -> replay still right
    case.q.copy_(torch.randn_like(case.q))
    g.replay()
    ref2, _ = H.reference(case)
    assert H.rel_err(static_out.cpu(), ref2) < TOL[dtype]


@pytest.mark.parametrize("prefetch", [64, 256])
def test_pdl_kv_prefetch_after_rope_in_graph(prefetch):
    """Paged decode with PDL and the KV prefetch before its wait (sm_90+), right after the RoPE launch that writes
    q and the newest K/V into the cache, replayed from a CUDA graph: equal, bit for bit, to the same chain with
    PDL off (launched eagerly), which matches the torch reference. Contexts shorter and longer than the prefetch,
    page boundaries, split-KV; output poisoned before each run."""
    from voltllm.attention.backend import CacheWrite
    from voltllm.kernels import pdl
    from voltllm.kernels.attention.paged_decode import decode_scratch_numel, paged_decode
    from voltllm.kernels.fused import rope_inplace

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs sm_90+")
    hq, hkv, d = 32, 8, 128
    case = H.make_case([(1, 1), (16, 1), (17, 1), (190, 1), (257, 1), (1500, 1)], hq, hkv, d, 16, torch.float16,
                       device=DEV, seed=_seed(f"pdl prefetch {prefetch}"))
    m = case.meta
    n = m.num_tokens
    pos = (m.seq_lens.long() - 1)[:n]
    ang = torch.arange(4096, device=DEV)[:, None] * (1e-4 ** (torch.arange(d // 2, device=DEV) / (d // 2)))[None]
    cos, sin = ang.cos(), ang.sin()
    cache0 = case.kv_cache.clone()
    q, k, cache = case.q.clone(), case.k.clone(), case.kv_cache.clone()
    out = torch.empty_like(q)
    splits = 3
    no, nl = decode_scratch_numel(n, hq, splits, d)
    po, pl = torch.empty(no, device=DEV), torch.empty(nl, device=DEV)

    def step(pf):
        q.copy_(case.q)
        k.copy_(case.k)
        cache.copy_(cache0)
        rope_inplace(q[:n], k[:n], pos, cos, sin, d, cache_write=CacheWrite(case.v[:n], cache, m.slot_mapping))
        for sp, heads, kv_heads in ((1, slice(0, hq // 2), slice(0, hkv // 2)),  # no split: kv heads 0-3
                                    (splits, slice(hq // 2, hq), slice(hkv // 2, hkv))):  # split-KV: 4-7
            paged_decode(q[:, heads], cache[..., kv_heads, :], m.block_tables, m.seq_lens, m.query_start_loc,
                         case.scale, out[:, heads], num_splits=sp, part_o=po, part_lse=pl, prefetch_tokens=pf)

    out.fill_(float("nan"))
    step(0)  # PDL off: plain launches
    plain = out.clone()
    qr, kr = case.q.clone(), case.k.clone()
    from voltllm.kernels.fused import rope_inplace_ref
    rope_inplace_ref(qr[:n], kr[:n], pos, cos, sin, d)
    ref_case = H.Case(qr, kr, case.v, cache0.clone(), m, case.scale)
    ref, _ = H.reference(ref_case)
    assert H.rel_err(plain[:n].cpu(), ref) < TOL[torch.float16]
    try:
        pdl.configure(True)
        step(prefetch)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step(prefetch)
        for _ in range(3):
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, plain)
    finally:
        pdl.configure(False)


# --- timing prints -----------------------------------------------------------------------------

def _copy_bandwidth() -> tuple[float, float]:
    """(device copy rate counting read + write, eager events; read rate of a sum), bytes/s."""
    x = torch.randn(1 << 28, device=DEV)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        y.copy_(x)
    b.record()
    torch.cuda.synchronize()
    copy = 10 * 2 * x.numel() * 4 / (a.elapsed_time(b) * 1e-3)
    r = torch.empty((), device=DEV)
    us = graph_time_us(lambda: torch.sum(x, dim=0, out=r), reps=5)
    return copy, x.numel() * 4 / (us * 1e-6)


def test_decode_bandwidth_print():
    from voltllm.kernels.attention import choose_num_splits, decode_scratch_numel, paged_decode
    copy_bw, read_bw = _copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"\nBENCH device={torch.cuda.get_device_name()} sms={sms} copy={copy_bw / 1e12:.2f} TB/s (read+write) "
          f"sum-read={read_bw / 1e12:.2f} TB/s; % below = decode KV bytes / time vs the sum-read rate")
    hq, hkv, d, dtype = 32, 8, 128, torch.float16
    for batch, ctx in ((1, 32768), (64, 1024), (8, 8192)):
        case = H.make_case([(ctx, 1)] * batch, hq, hkv, d, 16, dtype, device=DEV, extra_blocks=0, seed=1)
        m = case.meta
        kv_bytes = sum(m.seq_lens_cpu) * hkv * d * 2 * case.kv_cache.element_size()
        out = torch.empty_like(case.q)
        heur = choose_num_splits(batch, hkv, ctx, sms)
        # (splits, use_dot, fma_lanes, block_n, warps)
        variants = [(heur, True, False, None, 4), (heur, True, False, 128, 4), (heur * 2, True, False, None, 4),
                    (heur, False, False, None, 4), (heur, False, False, None, 8), (heur, False, True, None, 4),
                    (heur, False, True, 8, 4), (heur, False, True, 16, 8), (heur * 2, False, True, None, 4)]
        for splits, use_dot, lanes, block_n, warps in variants:
            no, nl = decode_scratch_numel(batch, hq, splits, d)
            po = torch.empty(max(no, 1), dtype=torch.float32, device=DEV)
            pl = torch.empty(max(nl, 1), dtype=torch.float32, device=DEV)
            fn = lambda: paged_decode(case.q, case.kv_cache, m.block_tables, m.seq_lens, m.query_start_loc,
                                      case.scale, out, num_splits=splits, part_o=po, part_lse=pl,
                                      use_dot=use_dot, fma_lanes=lanes, block_n=block_n, num_warps=warps)
            us = graph_time_us(fn)
            bw = kv_bytes / (us * 1e-6)
            print(f"BENCH decode b={batch} ctx={ctx} hq={hq} hkv={hkv} d={d} fp16 splits={splits}"
                  f"{'(heur)' if splits == heur else ''} {'dot' if use_dot else 'fma-lanes' if lanes else 'fma-rows'}"
                  f" block_n={block_n} warps={warps}: {us:8.1f} us  {kv_bytes / 1e6:7.1f} MB  "
                  f"{bw / 1e12:5.2f} TB/s  {100 * bw / read_bw:5.1f}%")


def test_prefill_throughput_print():
    for d, cfgs in ((128, [(128, 64, 8, 3), (128, 128, 8, 2)]), (64, [(128, 128, 8, 3), (128, 64, 8, 3)]),
                    (256, [(64, 64, 8, 2), (128, 32, 8, 2)])):
        _prefill_bench(d, cfgs)


def _prefill_bench(d, cfgs):
    from voltllm.kernels.attention import kv_write, paged_prefill, prefill_config
    hq, hkv, dtype, L = 32, 8, torch.float16, 4096
    case = H.make_case([(L, L)], hq, hkv, d, 16, dtype, device=DEV, extra_blocks=0, seed=2)
    kv_write(case.k, case.v, case.kv_cache, case.meta.slot_mapping)
    m = case.meta
    out = torch.empty_like(case.q)
    flops = 4 * hq * d * L * (L + 1) / 2
    default = prefill_config(d, hq // hkv, L, torch.cuda.get_device_capability())
    for cfg in [default] + [c for c in cfgs if c != default]:
        fn = lambda: paged_prefill(case.q, case.kv_cache, m.block_tables, m.seq_lens, m.query_start_loc,
                                   case.scale, out, max_query_len=L, config=cfg)
        try:
            us = graph_time_us(fn, reps=5)
        except Exception as e:  # a config that does not fit is a finding, not a failure
            print(f"BENCH prefill cfg={cfg}: failed {type(e).__name__}: {str(e)[:120]}")
            continue
        print(f"BENCH prefill L={L} hq={hq} hkv={hkv} d={d} fp16 causal cfg={cfg}"
              f"{'(default)' if cfg == default else ''}: {us:8.1f} us  {flops / us / 1e6:6.1f} TFLOP/s")
