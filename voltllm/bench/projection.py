"""V100-SXM2 projection: a roofline model fed with the bytes and FLOPs our kernels move and do per step.

    python -m voltllm.bench.projection [--json] [--results benchmarks/results]

PROJECTIONS, not measurements: no V100 was used. What is counted and what is assumed:

Counted (from voltllm's own model built on the meta device, and from our kernels' launch rules):
- weight bytes per decode step: every Linear weight and the lm_head once (the embedding table is not
  read, only one row per token); norms and other small parameters once;
- KV bytes per token: 2 (K, V) x attention layers x kv heads x head_dim x element size (2 fp16, 1 fp8);
- recurrent state per request (hybrid GDN layers): fp32 SSM state + conv state, read AND written by the
  decode kernels (voltllm.kernels.gdn_decode updates them in place);
- the FMA decode-attention kernel (compat route, voltllm.kernels.attention.paged_decode, USE_DOT=False) as it runs
  by default (per-lane, FMA_LANES_DEFAULT), per K/V element and per query head of the padded group (BLOCK_G =
  next_pow2(q heads per kv head)): K: one fp32 FMA of the dot product plus its cross-lane reduction (the D axis
  of a row lies over `lanes` threads in 16-byte vectors, so each (head, position) dot product ends with
  log2(lanes) shuffle + add rounds); V: one FMA into the [BLOCK_G, BLOCK_N, D] accumulator and its rescale
  multiply; per (head, position), on each lane holding it, the online softmax (6 fp32 ops, 2 exp2). Per element:
  one fp16->fp32 conversion (HADD2.F32 in the sm_70 SASS: FMA pipe), ~2 address / load / loop instructions, and
  for fp8 KV the software decode (e4m3: 10 integer ops + a packed fp16 multiply, half an HMUL2 per code,
  voltllm.kernels.fp8_codec.e4m3_to_fp16; e5m2: 2; the scales are folded outside the loop). These counts equal
  the loop of the kernel cross-compiled for sm_70 (8B d128 / 27B d256 tiles, fp16 and e4m3). The per-row
  variant (lanes=False) keeps the earlier count, BLOCK_G FMAs + the rescale BLOCK_G / (2 BLOCK_N): a lower
  bound, without its cross-warp reductions (its sm_70 loop issues ~48 instructions per fp16 element at d128,
  the per-lane loop 13). BLOCK_N: the kernel's default tile for few programs (batch 1). Split-KV partials from
  the kernel's own split heuristic (choose_num_splits);
- prefill FLOPs: 2 x matmul params x L + causal attention 4 x layers x q heads x head_dim x L^2 / 2
  (the bench's definition, voltllm.bench.limits).

Hardware (V100-SXM2, nominal): 900 GB/s HBM2, 125 TFLOP/s fp16 tensor cores, 15.7 TFLOP/s fp32 FMA,
80 SMs at 1.53 GHz; per SM and clock 64 fp32 FMA, 64 int32 ops, 32 warp-shuffle results, 16 exp2 (MUFU),
128 issued thread instructions (4 schedulers) — CUDA C++ Programming Guide, arithmetic throughput table, cc 7.x
(the shuffle row: 32 in every column of the copies we could check, the cc 7.x one assumed the same).

Calibrated from our H200 results of one commit (CALIBRATION_COMMIT, benchmarks/results/*.json, `limit`), so that
later result files do not move the projection: achievable bandwidth = V100
nominal x (H200 measured copy / H200 nominal 4.8 TB/s); achievable tensor-core rate = V100 nominal x
(H200 measured fp16 matmul / H200 dense nominal 989.4 TFLOP/s). The FMA rate is used at nominal (no
calibration source). Engine efficiency = our measured H200 tok/s / this model's H200 roofline at the same
shape, context and batch (decode and prefill separately), applied to the V100 roofline for the
"projected engine" figures. "Current kernels" divides the GEMV and state part by the decode efficiency and
runs the FMA decode kernel at its H200-measured rate, scaled by SMs x clock (same 64K registers per SM, so the
same resident programs), never above its roofline: the per-lane kernel reads 1.73-2.15 TB/s of KV on the H200
(benchmarks/results/attn-decode-fma-ef2875c.txt, 8B heads: d128, group 4), 40-50% of the read rate, where
this model puts its H200 arithmetic and issue limits above the bandwidth, so it is latency bound there; the
batch-1 figure (the lowest) scales to 0.81 TB/s of fp16 KV on the V100. fp8 e4m3 KV (software decode) at its
own measured rate: 0.68 TB/s of codes at batch 1 (attn-decode-fma-fp8-6bd4389.txt), 0.32 TB/s on the V100 (e5m2
assumed the same). The 27B's d256 group-8 tile is unmeasured: the 8B's rate, or its roofline where that is slower.

Not modelled: tensor-parallel all-reduces (2 per layer; each 10 us adds 10 us x 2 x layers per step),
activations (a few MB per step), the host side, the drafting side of speculative decoding (n-gram, draft-model,
DFlash and MTP speculation are built; only the verify forward is modelled, decode_step's rows > 1).
4-bit weights (NVFP4, AWQ and GPTQ checkpoints are built and can stay quantized: docs/models.md): the "4-bit" rows
take the layers' Linear weights at 4 bits each (fp16 bytes / 4), the lm_head and the small parameters at fp16, and
no scales (voltllm's NVFP4 planes take 4.625 bits per weight, int4 at group 128 4.19); their "current kernels"
figure divides that GEMV time by the fp16 decode efficiency of the calibration runs, so no measured 4-bit kernel
rate enters the projection.
"""
from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import statistics
from dataclasses import asdict, dataclass, field
from typing import Optional

# -- hardware ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPU:
    name: str
    hbm_GBps: float  # nominal
    fp16_tc_TFLOPs: float  # nominal dense fp16 tensor-core rate
    fp32_TFLOPs: float  # nominal fp32 FMA rate (2 FLOPs per FMA)
    sms: int
    clock_GHz: float
    fma_per_clk: int = 64  # per SM: fp32 FMA / add / multiply (and fp16 instructions, counted here)
    int_per_clk: int = 64  # int32 add / logic / shift / compare
    shfl_per_clk: int = 32  # warp shuffle results
    mufu_per_clk: int = 16  # exp2 and the other special functions
    issue_per_clk: int = 128  # thread instructions issued (4 schedulers x 32 lanes)

    def rate(self, per_clk: int) -> float:
        return self.sms * per_clk * self.clock_GHz * 1e9


V100 = GPU("V100-SXM2-32GB", hbm_GBps=900.0, fp16_tc_TFLOPs=125.0, fp32_TFLOPs=15.7, sms=80, clock_GHz=1.53)
H200 = GPU("H200-SXM-141GB", hbm_GBps=4800.0, fp16_tc_TFLOPs=989.4, fp32_TFLOPs=66.9, sms=132, clock_GHz=1.98,
           fma_per_clk=128)

# H200 measurement of the FMA decode route as it runs by default (per-lane, the default tile): 8B heads (32 q / 8 kv,
# d128), batch 1 x 32K (33 splits, BLOCK_N 16) 75.7 us / 64 x ~1K (BLOCK_N 8) 121.5 us / 8 x 8K (5 splits, BLOCK_N
# 16) 130.2 us; benchmarks/results/attn-decode-fma-ef2875c.txt (the per-row route: 0.59 / 0.49 / 0.52 there)
H200_FMA_DECODE_TBps = (1.73, 2.15, 2.05)
# the same shapes and route with an fp8 e4m3 cache (uint8 codes, the software decode), TB/s of codes: 97.0 / 183.6 /
# 259.7 us; benchmarks/results/attn-decode-fma-fp8-6bd4389.txt (per-row: 0.25 / 0.23 / 0.23)
H200_FMA_DECODE_FP8_TBps = (0.68, 0.71, 0.51)

# the seed system (BENCHMARKS.md): 4x V100-SXM2-32GB, TP4, 27B NVFP4 + DFlash2 drafter, E4M3 KV
SEED = {"decode_tok_s": {4096: 229.34, 32768: 201.18, 131072: 171.43},
        "spec_round_ms": {4096: 19.855, 32768: 21.125, 131072: 25.212},
        "prefill_100k_tok_s": 3336.0}


# -- model accounting -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    vocab: int
    linear_params: int  # Linear weights in the layers (what a 4-bit format would quantize)
    lm_head_params: int
    embed_params: int
    other_params: int  # norms, conv weights, gates: read once per step
    attn_layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    gdn_layers: int = 0
    ssm_elems: int = 0  # per GDN layer per request (fp32)
    conv_elems: int = 0  # per GDN layer per request (model dtype)


@functools.lru_cache(maxsize=None)
def count_shape(name: str) -> ModelShape:
    """Count a named shape (voltllm.bench.shapes) from voltllm's model built on the meta device."""
    import math

    import torch

    from voltllm.bench.shapes import make_config
    from voltllm.model.layers.linear import Linear
    from voltllm.model.models.registry import build_model

    cfg = make_config(name)
    with torch.device("meta"):
        model = build_model(cfg, torch.float16, 1)
    head = getattr(model, "lm_head", None)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, Linear) and m is not head)
    embed = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    head_n = head.weight.numel() if head is not None else 0
    total = sum(p.numel() for p in model.parameters())
    kv_heads, head_dim = model.kv_heads_and_dim
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    gdn = ssm = conv = 0
    if getattr(model, "is_hybrid", False):
        spec = model.state_spec
        gdn, ssm, conv = spec["num_layers"], math.prod(spec["ssm_shape"]), math.prod(spec["conv_shape"])
    return ModelShape(name=name, hidden=int(text.hidden_size), vocab=int(text.vocab_size), linear_params=linear,
                      lm_head_params=head_n, embed_params=embed,
                      other_params=total - linear - embed - head_n, attn_layers=int(model.num_attention_layers),
                      q_heads=int(text.num_attention_heads), kv_heads=int(kv_heads), head_dim=int(head_dim),
                      gdn_layers=gdn, ssm_elems=ssm, conv_elems=conv)


# -- calibration ------------------------------------------------------------------------------------
@dataclass
class Calibration:
    copy_ratio: float  # H200 measured copy / nominal
    matmul_ratio: float  # H200 measured fp16 matmul / nominal
    decode_eff: float = 1.0  # measured decode tok/s / modelled H200 roofline
    prefill_eff: float = 1.0
    # the batch-1 shape's rates (fp16 KV: also the lowest): the projected rows are batch 1
    fma_decode_TBps_h200: float = H200_FMA_DECODE_TBps[0]
    fma_decode_fp8_TBps_h200: float = H200_FMA_DECODE_FP8_TBps[0]
    sources: dict = field(default_factory=dict)


# The H200 runs the projection is calibrated on (native route). Later commits decode faster on the H200 (207.2 vs
# 176.3 tok/s at 8B batch 1 by session 5), partly through programmatic dependent launch, which a V100 lacks; the
# projection keeps these runs and docs/sm70.md says what that leaves out.
CALIBRATION_COMMIT = "ca00add"


def _results(results_dir: str, commit: str = CALIBRATION_COMMIT) -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        with open(path) as f:
            d = json.load(f)
        if "H200" in str(d.get("gpu", "")) and isinstance(d.get("limit"), dict) \
                and str(d.get("commit", "")).startswith(commit):
            d["_path"] = os.path.relpath(path)
            out.append(d)
    return out


def calibrate(results_dir: str = "benchmarks/results") -> Calibration:
    """Ratios from our H200 result files (see the module doc); raises if none is found."""
    res = _results(results_dir)
    if not res:
        raise FileNotFoundError(f"no H200 result JSON of commit {CALIBRATION_COMMIT} under {results_dir}")
    copy = statistics.median(r["limit"]["copy_GBps"] for r in res)
    mm = statistics.median(r["limit"]["matmul_TFLOPs"] for r in res)
    cal = Calibration(copy_ratio=copy / H200.hbm_GBps, matmul_ratio=mm / H200.fp16_tc_TFLOPs,
                      sources={"files": [r["_path"] for r in res], "h200_copy_GBps": copy, "h200_matmul_TFLOPs": mm})
    h200_bw = copy * 1e9
    shape = count_shape("qwen3-8b-shape")
    for r in res:  # engine efficiency: the native-route qwen3-8b-shape runs
        if "qwen3-8b-shape" not in r.get("name", "") or (r.get("config") or {}).get("compat", "none") != "none":
            continue
        m = r["metrics"]
        if m.get("pure_decode_tok_s") and "decode-b1" in r["name"]:
            ctx = r["limit"]["decode_context_len"]
            step = decode_step(shape, ctx, gpu=H200, bw=h200_bw, tc=mm * 1e12, route="native")
            cal.decode_eff = m["pure_decode_tok_s"] * step["roofline_s"]
            cal.sources["decode"] = {"file": r["_path"], "measured_tok_s": m["pure_decode_tok_s"],
                                     "modelled_limit_tok_s": 1 / step["roofline_s"], "context": ctx}
        if m.get("prefill_tok_s") and "prefill" in r["name"]:
            L = int(r["metrics"]["table"][0]["input_len"])
            p = prefill(shape, L, gpu=H200, bw=h200_bw, tc=mm * 1e12, attention="triton_tc")
            cal.prefill_eff = m["prefill_tok_s"] / p["roofline_tok_s"]
            cal.sources["prefill"] = {"file": r["_path"], "measured_tok_s": m["prefill_tok_s"],
                                      "modelled_limit_tok_s": p["roofline_tok_s"], "prompt": L}
    return cal


# -- kernels ----------------------------------------------------------------------------------------
def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


FP8_DECODE_INT_OPS = {"e4m3": 10, "e5m2": 2}  # integer ops per code (fp8_codec.e4m3_to_fp16 / e5m2_to_fp16)
FP8_DECODE_FP16_MULS = {"e4m3": 0.5, "e5m2": 0.0}  # e4m3's rebias multiply by 2**8: an HMUL2 per two codes
VECTOR_BYTES = 16  # the K / V loads: 16-byte vectors along D
FMA_NUM_WARPS = 4  # paged_decode's warps on the FMA route
LANES_SOFTMAX_OPS = 6  # per (head, position) and lane holding it: 2 selects, max, 2 subtracts, the l3 FMA
LANES_SOFTMAX_EXP2 = 2  # alpha and p
LANES_LOOP_OPS = 2.0  # per element: addresses, loads, moves, loop (sm_70 SASS: 2.25 at d128; 1.6-2.4 at d256)


def lanes_layout(block_d: int, block_n: int, elem_bytes: int) -> tuple[int, int]:
    """(elements per vector, threads per row) of the per-lane route's [1, BLOCK_N, D] K / V loads: Triton's
    coalesced layout takes 16-byte vectors (fewer elements when the tile has fewer per thread) and spreads a row's
    vectors over up to 32 lanes."""
    vec = max(1, min(VECTOR_BYTES // elem_bytes, block_n * block_d // (32 * FMA_NUM_WARPS)))
    return vec, max(1, min(32, block_d // vec))


def fma_attention_time(kv_elems: float, group: int, head_dim: int, kv: str, gpu: GPU, bw: float,
                       rows: int = 1, lanes: bool = True) -> dict:
    """Roofline of the FMA decode kernel over kv_elems K/V elements (each read once per kv-head group).

    lanes (the default route, FMA_LANES_DEFAULT): per element and per query head of BLOCK_G, averaged over K and
    V: 1 FMA (QK for K, PV for V) + 1/2 rescale multiply (V) + red/2 shuffles and as many adds (K: the
    cross-lane reduction of the dot product, red = lanes x log2(lanes) / D per K element) + the online softmax of
    each (head, position) on each of its `lanes` threads (LANES_SOFTMAX_OPS fp32 ops and LANES_SOFTMAX_EXP2 exp2
    per D K elements). lanes=False: the per-row route's count, BLOCK_G FMAs + the rescale BLOCK_G / (2 BLOCK_N).
    Both: one fp16->fp32 conversion per element (FMA pipe), fp8 adds the software decode. rows > 1: a
    speculative-verify step whose query rows each need the per-head work (the kernel would stream the KV once
    for all rows); BLOCK_N stays the one-row tile. BLOCK_N is the kernel's default for few programs."""
    import math

    from voltllm.kernels.attention.paged_decode import _default_block_n

    block_g = _pow2(group)
    block_d = _pow2(head_dim)
    block_n = _default_block_n(block_d, block_g, False, lanes)
    fp8 = kv.startswith("fp8")
    fmt = kv.replace("fp8_", "")
    elem_bytes = 1 if fp8 else 2
    ints = FP8_DECODE_INT_OPS.get(fmt, 0) if fp8 else 0
    per_elem = 1 + (FP8_DECODE_FP16_MULS.get(fmt, 0.0) if fp8 else 0.0)  # conversion (+ the fp8 rebias)
    out = {"block_g": block_g, "block_n": block_n}
    if lanes:
        vec, row_lanes = lanes_layout(block_d, block_n, elem_bytes)
        red = row_lanes * math.log2(row_lanes) / block_d
        rep = row_lanes / block_d
        per_head = 1 + 0.5 + red / 2 + LANES_SOFTMAX_OPS * rep / 2
        fma = rows * block_g * per_head + per_elem
        shfl = rows * block_g * red / 2
        mufu = rows * block_g * LANES_SOFTMAX_EXP2 * rep / 2
        other = LANES_LOOP_OPS
        out.update(vector=vec, row_lanes=row_lanes)
    else:
        fma = rows * (block_g + block_g / (2 * block_n)) + per_elem
        shfl = mufu = other = 0.0
    pipes = {"memory": kv_elems * elem_bytes / bw,
             "fma": kv_elems * fma / gpu.rate(gpu.fma_per_clk),
             "int": kv_elems * ints / gpu.rate(gpu.int_per_clk),
             "shfl": kv_elems * shfl / gpu.rate(gpu.shfl_per_clk),
             "mufu": kv_elems * mufu / gpu.rate(gpu.mufu_per_clk),
             "issue": kv_elems * (fma + ints + shfl + mufu + other) / gpu.rate(gpu.issue_per_clk)}
    bound = max(pipes, key=pipes.get)
    out.update(time_s=pipes[bound], bound=bound, pipes_s=pipes, fma_per_elem=fma, shfl_per_elem=shfl,
               mufu_per_elem=mufu, issue_per_elem=fma + ints + shfl + mufu + other)
    return out


def decode_step(shape: ModelShape, context: float, gpu: GPU = V100, bw: Optional[float] = None,
                tc: Optional[float] = None, tp: int = 1, batch: int = 1, weight_bits: int = 16, kv: str = "fp16",
                route: str = "compat", cal: Optional[Calibration] = None, rows: int = 1) -> dict:
    """Per-GPU time of one decode step (roofline: each kernel class at its own bound, run back to back).

    rows > 1 models a speculative-verify forward (rows query rows per request): weights are still read
    once; attention either streams the KV once through the FMA kernel (rows x the FMAs) or bridges it into
    an fp16 workspace for SDPA on tensor cores (KV read + workspace write + read); the cheaper is taken."""
    from voltllm.kernels.attention.paged_decode import choose_num_splits

    bw = bw or gpu.hbm_GBps * 1e9 * (cal.copy_ratio if cal else 1.0)
    tc = tc or gpu.fp16_tc_TFLOPs * 1e12 * (cal.matmul_ratio if cal else 1.0)
    kv_heads = max(1, shape.kv_heads // tp)
    group = shape.q_heads // shape.kv_heads
    w_bytes = (shape.linear_params / tp * weight_bits / 8 + shape.lm_head_params / tp * 2 + shape.other_params * 2
               + batch * rows * shape.hidden * 2)
    gemv_flops = 2 * batch * rows * (shape.linear_params + shape.lm_head_params) / tp
    gemv = max(w_bytes / bw, gemv_flops / tc)
    kv_elems = batch * context * shape.attn_layers * kv_heads * shape.head_dim * 2
    kv_bytes = kv_elems * (1 if kv.startswith("fp8") else 2)
    if route == "compat":
        att = fma_attention_time(kv_elems, group, shape.head_dim, kv, gpu, bw, rows)
        if rows > 1:
            flops = 4 * batch * rows * shape.attn_layers * shape.q_heads / tp * shape.head_dim * context
            sdpa = kv_bytes / bw + 2 * kv_elems * 2 / bw + flops / tc
            if sdpa < att["time_s"]:
                att = {"time_s": sdpa, "bound": "bridge+SDPA", "block_g": 0}
    else:  # tensor-core decode: bytes-bound
        att = {"time_s": kv_bytes / bw, "bound": "memory", "block_g": 16}
    splits = choose_num_splits(batch, kv_heads, int(context), gpu.sms)
    partial_bytes = (batch * shape.q_heads / tp * shape.attn_layers * splits * (shape.head_dim + 1) * 4 * 2
                     if splits > 1 else 0)
    att_time = att["time_s"] + partial_bytes / bw
    state_bytes = batch * shape.gdn_layers / tp * (shape.ssm_elems * 4 + shape.conv_elems * 2) * 2  # read + write
    gdn = max(state_bytes / bw, batch * rows * shape.gdn_layers / tp * shape.ssm_elems * 4 / gpu.rate(gpu.fma_per_clk))
    roofline = gemv + att_time + gdn
    out = {"roofline_s": roofline, "gemv_s": gemv, "attention_s": att_time, "attention_bound": att["bound"],
           "gdn_state_s": gdn, "weight_bytes": w_bytes, "kv_bytes": kv_bytes,
           "state_bytes": state_bytes, "splits": splits, "roofline_tok_s": batch / roofline}
    if cal is not None and route == "compat":
        # current kernels: H200-measured engine efficiency on the GEMV/state part; the FMA decode kernel (per-lane) at
        # its H200-measured element rate scaled by SMs x clock (latency bound there), never faster than its roofline
        h200_rate = cal.fma_decode_fp8_TBps_h200 * 1e12 if kv.startswith("fp8") else cal.fma_decode_TBps_h200 * 1e12 / 2
        elem_rate = h200_rate * (gpu.sms * gpu.clock_GHz) / (H200.sms * H200.clock_GHz)
        att_now = max(att_time, rows * kv_elems / elem_rate + partial_bytes / bw)
        if att["bound"] == "bridge+SDPA":
            att_now = att_time / cal.decode_eff
        current = (gemv + gdn) / cal.decode_eff + att_now
        out.update(current_s=current, current_tok_s=batch / current, current_attention_s=att_now)
    return out


def prefill(shape: ModelShape, L: int, gpu: GPU = V100, bw: Optional[float] = None, tc: Optional[float] = None,
            tp: int = 1, attention: str = "sdpa", cal: Optional[Calibration] = None) -> dict:
    """One L-token prompt. attention: sdpa (bridge + SDPA on tensor cores), triton_fma (tl.dot = FMA on sm_70),
    triton_tc (Triton tl.dot on tensor cores: sm_80+)."""
    bw = bw or gpu.hbm_GBps * 1e9 * (cal.copy_ratio if cal else 1.0)
    tc = tc or gpu.fp16_tc_TFLOPs * 1e12 * (cal.matmul_ratio if cal else 1.0)
    mm = 2 * shape.linear_params / tp * L + 2 * shape.lm_head_params / tp
    att = 4 * shape.attn_layers * shape.q_heads / tp * shape.head_dim * L ** 2 / 2
    t_mm = mm / tc
    kv_bytes = L * shape.attn_layers * max(1, shape.kv_heads // tp) * shape.head_dim * 2 * 2
    if attention == "triton_fma":
        t_att = att / (gpu.fp32_TFLOPs * 1e12)
    else:
        t_att = att / tc
    bridge = 2 * kv_bytes / bw if attention == "sdpa" else 0.0  # pages -> fp16 workspace (read + write)
    total = t_mm + t_att + bridge + kv_bytes / bw
    out = {"roofline_tok_s": L / total, "matmul_s": t_mm, "attention_s": t_att, "bridge_s": bridge,
           "flops": mm + att, "roofline_s": total}
    if cal is not None:
        out["projected_tok_s"] = L / total * cal.prefill_eff
    return out


# -- the projection tables --------------------------------------------------------------------------
def project(cal: Calibration) -> dict:
    big = count_shape("qwen3.5-27b-shape")
    small = count_shape("qwen3-8b-shape")
    rows_27b = []
    for ctx in (4096, 32768, 131072):
        for bits in (16, 4):
            for kv in ("fp16", "fp8_e4m3"):
                s = decode_step(big, ctx, tp=4, weight_bits=bits, kv=kv, cal=cal)
                rows_27b.append({"context": ctx, "weights": "fp16" if bits == 16 else "4-bit (bytes/4)", "kv": kv,
                                 "roofline_tok_s": s["roofline_tok_s"], "current_tok_s": s["current_tok_s"],
                                 "step_ms": s["roofline_s"] * 1e3, "current_step_ms": s["current_s"] * 1e3,
                                 "gemv_ms": s["gemv_s"] * 1e3, "attention_ms": s["attention_s"] * 1e3,
                                 "current_attention_ms": s["current_attention_s"] * 1e3,
                                 "gdn_state_ms": s["gdn_state_s"] * 1e3, "attention_bound": s["attention_bound"],
                                 "weight_GB_per_gpu": s["weight_bytes"] / 1e9, "kv_GB_per_gpu": s["kv_bytes"] / 1e9,
                                 "seed_tok_s": SEED["decode_tok_s"][ctx],
                                 "seed_round_ms": SEED["spec_round_ms"][ctx]})
    verify = []
    for ctx in (4096, 32768, 131072):
        s = decode_step(big, ctx, tp=4, weight_bits=4, kv="fp8_e4m3", cal=cal, rows=8)
        per_round = SEED["decode_tok_s"][ctx] * SEED["spec_round_ms"][ctx] / 1e3
        verify.append({"context": ctx, "rows": 8, "roofline_ms": s["roofline_s"] * 1e3,
                       "current_ms": s["current_s"] * 1e3, "attention_bound": s["attention_bound"],
                       "attention_ms": s["attention_s"] * 1e3, "seed_round_ms": SEED["spec_round_ms"][ctx],
                       "seed_tokens_per_round": per_round})
    rows_8b = []
    for ctx in (640, 4096, 32768):
        for kv in ("fp16", "fp8_e4m3"):
            s = decode_step(small, ctx, kv=kv, cal=cal)
            rows_8b.append({"context": ctx, "kv": kv, "roofline_tok_s": s["roofline_tok_s"],
                            "current_tok_s": s["current_tok_s"], "step_ms": s["roofline_s"] * 1e3,
                            "attention_bound": s["attention_bound"]})
    pre = {}
    for att in ("sdpa", "triton_fma"):
        p = prefill(small, 8192, attention=att, cal=cal)
        pre[att] = {"roofline_tok_s": p["roofline_tok_s"], "projected_tok_s": p["projected_tok_s"],
                    "ttft_s": 8192 / p["projected_tok_s"], "matmul_s": p["matmul_s"], "attention_s": p["attention_s"]}
    # the seed's kernel figure: attention of 8192 query rows over a 262144-token KV, one V100, TP4 layout
    # (27B: 6 q heads / 1 kv head of d256 per GPU), one layer; FLOPs = 4 x heads x d x Lq x Lk
    flops = 4 * big.q_heads / 4 * big.head_dim * 8192 * 262144
    kv_b = 262144 * max(1, big.kv_heads // 4) * big.head_dim * 2
    bw = V100.hbm_GBps * 1e9 * cal.copy_ratio
    seed_attn = {"flops": flops, "seed_ms": 182.6, "seed_TFLOPs": flops / 0.1826 / 1e12,
                 "sdpa_tc_ms": (flops / (V100.fp16_tc_TFLOPs * 1e12 * cal.matmul_ratio) + kv_b * (1 + 4) / bw) * 1e3,
                 "triton_fma_ms": flops / (V100.fp32_TFLOPs * 1e12) * 1e3}
    return {"calibration": asdict(cal),
            "v100": {"achievable_GBps": V100.hbm_GBps * cal.copy_ratio,
                     "achievable_tc_TFLOPs": V100.fp16_tc_TFLOPs * cal.matmul_ratio,
                     "fma_TFLOPs": V100.fp32_TFLOPs},
            "shapes": {"qwen3.5-27b-shape": asdict(big), "qwen3-8b-shape": asdict(small)},
            "decode_27b_tp4": rows_27b, "verify_27b_tp4": verify, "decode_8b": rows_8b, "prefill_8b_8k": pre,
            "attention_q8192_kv262144": seed_attn}


def format_projection(p: dict) -> str:
    c, v = p["calibration"], p["v100"]
    lines = ["PROJECTION (roofline model, no V100 measured) — voltllm.bench.projection",
             f"calibration: H200 copy {c['sources']['h200_copy_GBps']:.0f} GB/s = {c['copy_ratio']:.3f} of 4800; "
             f"matmul {c['sources']['h200_matmul_TFLOPs']:.0f} TFLOP/s = {c['matmul_ratio']:.3f} of 989.4; "
             f"engine efficiency decode {c['decode_eff']:.3f}, prefill {c['prefill_eff']:.3f}",
             f"V100 achievable: {v['achievable_GBps']:.0f} GB/s, {v['achievable_tc_TFLOPs']:.1f} TFLOP/s fp16 TC, "
             f"{v['fma_TFLOPs']} TFLOP/s fp32 FMA (nominal)", "",
             "qwen3.5-27b-shape, batch 1, TP4 over 4 V100 (per-GPU step; all-reduces not counted):",
             "ctx     weights          KV        roofline tok/s  current-kernels tok/s  step ms (gemv/attn/gdn)  "
             "seed tok/s (spec. dec.)"]
    for r in p["decode_27b_tp4"]:
        lines.append(f"{r['context']:<7} {r['weights']:<16} {r['kv']:<9} {r['roofline_tok_s']:>14.1f}  "
                     f"{r['current_tok_s']:>21.1f}  {r['step_ms']:5.2f} ({r['gemv_ms']:.2f}/{r['attention_ms']:.2f}/"
                     f"{r['gdn_state_ms']:.2f})      {r['seed_tok_s']}")
    lines += ["", "27B speculative-verify forward (1 + 7 drafts = 8 query rows), 4-bit weights, fp8 KV, TP4 "
              "(drafting not included):", "ctx     roofline ms  current ms  attention  seed full round ms "
              "(accepted tokens/round)"]
    for r in p["verify_27b_tp4"]:
        lines.append(f"{r['context']:<7} {r['roofline_ms']:11.2f}  {r['current_ms']:10.2f}  {r['attention_bound']:<9}  "
                     f"{r['seed_round_ms']} ({r['seed_tokens_per_round']:.2f})")
    lines += ["", "qwen3-8b-shape fp16, one V100, batch 1 decode:", "ctx     KV        roofline tok/s  current tok/s"]
    for r in p["decode_8b"]:
        lines.append(f"{r['context']:<7} {r['kv']:<9} {r['roofline_tok_s']:>14.1f}  {r['current_tok_s']:>13.1f}")
    lines += ["", "qwen3-8b-shape fp16, one V100, one 8192-token prompt:"]
    for k, r in p["prefill_8b_8k"].items():
        lines.append(f"  attention {k:<11} roofline {r['roofline_tok_s']:8.0f} tok/s, projected "
                     f"{r['projected_tok_s']:8.0f} tok/s (TTFT {r['ttft_s']:.2f} s)")
    a = p["attention_q8192_kv262144"]
    lines += ["", f"attention Q8192 x KV262144 (27B TP4 layout, one layer, one V100): seed {a['seed_ms']} ms "
              f"({a['seed_TFLOPs']:.0f} TFLOP/s); ours: bridge + SDPA at the calibrated tensor-core rate "
              f"{a['sdpa_tc_ms']:.0f} ms (roofline), Triton on FMA {a['triton_fma_ms']:.0f} ms"]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m voltllm.bench.projection", description=__doc__.split("\n")[0])
    ap.add_argument("--results", default="benchmarks/results", help="directory of H200 result JSONs (calibration)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    p = project(calibrate(args.results))
    print(json.dumps(p, indent=2) if args.json else format_projection(p))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
