"""Triton kernels for the Gated DeltaNet decode step (one token per request), fp32 state, no tensor cores.

  causal_conv1d_decode     silu(depthwise conv over [state | x]) and the state shift, in place on the pool
  gated_delta_rule_decode  l2norm(q, k), q * scale, S = exp(g) S; u = beta (v - S^T k); S += k u^T;
                           o = S^T q — in place on the fp32 state pool
  gated_delta_rule_verify  the same step over each request's tokens in order (a speculative verification: the
                           known token, then the drafts), writing the state after every position but the last to
                           the request's checkpoint rows (voltllm.model.state_cache) and after the last to its slot
  causal_conv1d_verify     the conv step likewise (a hybrid's verification replayed as decode rows: CUDA graphs)

Both read and write the per-request slots of one layer's pool (voltllm.model.state_cache) and start from
zeros for a request whose has_initial_state is false. Same entry points and semantics as the
`decode_only` paths of voltllm.kernels.gdn_ref (the reference these are tested against).
Grid of the delta rule: (request, value head, block of value columns): the columns of S are independent
given k and q, so each program owns S[:, cols] in registers and does only FMAs and reductions (fine on
SM70, which has no tensor cores for fp32 anyway).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from voltllm.kernels import pdl
from voltllm.kernels.pdl import pdl_enter
from voltllm.kernels.registry import CompileSpec, register_kernel


@triton.jit
def _gdn_decode_kernel(
    Q, K, V, G, Beta, ALog, DtBias, State, Slots, HasInit, Out,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_gb, stride_betab,
    stride_ss, stride_sh, stride_sk, stride_ob, stride_oh,
    scale,
    HV_PER_K: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, L2NORM: tl.constexpr, RAW_GATES: tl.constexpr, PDL: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // HV_PER_K
    offk = tl.arange(0, BLOCK_K)
    offv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = offk < DK
    mv = offv < DV
    # The state, slots and flags are not written by the kernels just before this one (only by this kernel a
    # step earlier, the prefill kernels and the host's input copies, all complete once the predecessor has
    # passed its own wait), so under PDL they load while the predecessor (the conv step) still runs.
    slot = tl.load(Slots + b).to(tl.int64)
    init = tl.load(HasInit + b)
    ptr = State + slot * stride_ss + h * stride_sh + offk[:, None] * stride_sk + offv[None, :]
    m2 = mk[:, None] & mv[None, :]
    s = tl.load(ptr, mask=m2 & (init != 0), other=0.0).to(tl.float32)
    pdl_enter(PDL)
    q = tl.load(Q + b * stride_qb + hk * stride_qh + offk, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(K + b * stride_kb + hk * stride_kh + offk, mask=mk, other=0.0).to(tl.float32)
    if L2NORM:
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    q = q * scale
    v = tl.load(V + b * stride_vb + h * stride_vh + offv, mask=mv, other=0.0).to(tl.float32)
    g = tl.load(G + b * stride_gb + h).to(tl.float32)
    beta = tl.load(Beta + b * stride_betab + h).to(tl.float32)
    if RAW_GATES:  # G, Beta hold the projections a, b: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)
        x = g + tl.load(DtBias + h).to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # torch's threshold 20
        g = -tl.exp(tl.load(ALog + h).to(tl.float32)) * softplus
        beta = 1.0 / (1.0 + tl.exp(-beta))
    s = s * tl.exp(g)
    pred = tl.sum(s * k[:, None], axis=0)
    u = beta * (v - pred)
    s = s + k[:, None] * u[None, :]
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(ptr, s.to(State.dtype.element_ty), mask=m2)
    tl.store(Out + b * stride_ob + h * stride_oh + offv, o.to(Out.dtype.element_ty), mask=mv)


@triton.jit
def _gdn_verify_kernel(
    Q, K, V, G, Beta, State, Slots, HasInit, Starts, Ends, Out,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_betat,
    stride_ss, stride_sh, stride_sk, stride_ot, stride_oh,
    scale, checkpoint_base, num_checkpoints,
    HV_PER_K: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, L2NORM: tl.constexpr,
):
    # one program per (walk, value head, block of value columns), as the decode step; S stays in registers while
    # the program walks its rows start .. end-1, so positions cost one state write each, no re-read. An empty walk
    # (start == end: a CUDA-graph row that is not its request's first) does nothing
    b = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // HV_PER_K
    offk = tl.arange(0, BLOCK_K)
    offv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = offk < DK
    mv = offv < DV
    m2 = mk[:, None] & mv[None, :]
    slot = tl.load(Slots + b).to(tl.int64)
    init = tl.load(HasInit + b)
    start = tl.load(Starts + b)
    end = tl.load(Ends + b)
    tile = h * stride_sh + offk[:, None] * stride_sk + offv[None, :]
    s = tl.load(State + slot * stride_ss + tile, mask=m2 & (init != 0), other=0.0).to(tl.float32)
    first_ckpt = checkpoint_base + slot * num_checkpoints
    for t in range(start, end):
        q = tl.load(Q + t * stride_qt + hk * stride_qh + offk, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(K + t * stride_kt + hk * stride_kh + offk, mask=mk, other=0.0).to(tl.float32)
        if L2NORM:
            q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)
            k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        q = q * scale
        v = tl.load(V + t * stride_vt + h * stride_vh + offv, mask=mv, other=0.0).to(tl.float32)
        g = tl.load(G + t * stride_gt + h).to(tl.float32)
        beta = tl.load(Beta + t * stride_betat + h).to(tl.float32)
        s = s * tl.exp(g)
        pred = tl.sum(s * k[:, None], axis=0)
        u = beta * (v - pred)
        s = s + k[:, None] * u[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(Out + t * stride_ot + h * stride_oh + offv, o.to(Out.dtype.element_ty), mask=mv)
        row = first_ckpt + (t - start)
        tl.store(State + row * stride_ss + tile, s.to(State.dtype.element_ty), mask=m2 & (t < end - 1))
    tl.store(State + slot * stride_ss + tile, s.to(State.dtype.element_ty), mask=m2 & (end > start))


@triton.jit
def _conv_verify_kernel(
    X, W, State, Slots, HasInit, Starts, Ends, Out,
    stride_xt, stride_ss, stride_sk, stride_ot, C, checkpoint_base, num_checkpoints,
    KW: tl.constexpr, BLOCK_C: tl.constexpr, SILU: tl.constexpr,
):
    # one program per (walk, block of channels) walks rows start .. end-1 of one request: position p's window is
    # [old state (KW-1 rows) | x rows][p : p + KW], its conv state afterwards the window's last KW-1 rows, stored
    # to checkpoint row p (p < n - 1) or, after the loop, to the slot. Only this program touches the slot's columns,
    # and the slot is written last (rows in ascending order: each reads an old row above the one it writes)
    b = tl.program_id(0)
    offc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = offc < C
    slot = tl.load(Slots + b).to(tl.int64)
    init = tl.load(HasInit + b) != 0
    start = tl.load(Starts + b)
    end = tl.load(Ends + b)
    base = State + slot * stride_ss + offc
    first_ckpt = checkpoint_base + slot * num_checkpoints
    for t in range(start, end):
        acc = tl.load(X + t * stride_xt + offc, mask=mc, other=0.0).to(tl.float32) * tl.load(
            W + offc * KW + (KW - 1), mask=mc, other=0.0).to(tl.float32)
        for j in tl.static_range(KW - 1):
            r = t - (KW - 1) + j  # the input row of tap j (r < start: the old state's row KW-1 + r - start)
            xv = tl.load(X + r * stride_xt + offc, mask=mc & (r >= start), other=0.0).to(tl.float32)
            sv = tl.load(base + (KW - 1 + r - start) * stride_sk, mask=mc & (r < start) & init, other=0.0)
            acc += (xv + sv.to(tl.float32)) * tl.load(W + offc * KW + j, mask=mc, other=0.0).to(tl.float32)
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(Out + t * stride_ot + offc, acc.to(Out.dtype.element_ty), mask=mc)
        keep = t < end - 1
        ckpt = State + (first_ckpt + t - start) * stride_ss + offc
        for m in tl.static_range(KW - 1):
            r = t - (KW - 2) + m
            xv = tl.load(X + r * stride_xt + offc, mask=mc & keep & (r >= start), other=0.0)
            sv = tl.load(base + (KW - 1 + r - start) * stride_sk, mask=mc & keep & (r < start) & init, other=0.0)
            val = tl.where(r >= start, xv.to(State.dtype.element_ty), sv)
            tl.store(ckpt + m * stride_sk, val, mask=mc & keep)
    for m in tl.static_range(KW - 1):
        r = end - 1 - (KW - 2) + m
        xv = tl.load(X + r * stride_xt + offc, mask=mc & (end > start) & (r >= start), other=0.0)
        sv = tl.load(base + (KW - 1 + r - start) * stride_sk, mask=mc & (end > start) & (r < start) & init,
                     other=0.0)
        tl.store(base + m * stride_sk, tl.where(r >= start, xv.to(State.dtype.element_ty), sv),
                 mask=mc & (end > start))


@triton.jit
def _conv_decode_kernel(
    X, W, Bias, State, Slots, HasInit, Out,
    stride_xb, stride_ss, stride_sk, stride_ob, C,
    KW: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, PDL: tl.constexpr,
):
    b = tl.program_id(0)
    offc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = offc < C
    slot = tl.load(Slots + b).to(tl.int64)  # (inputs of the host's copies: readable before the PDL wait)
    init = tl.load(HasInit + b)
    pdl_enter(PDL)
    x = tl.load(X + b * stride_xb + offc, mask=mc, other=0.0)
    acc = x.to(tl.float32) * tl.load(W + offc * KW + (KW - 1), mask=mc, other=0.0).to(tl.float32)
    base = State + slot * stride_ss + offc
    # state rows: 0 = oldest input, KW-2 = newest; the new state drops row 0 and appends x
    for j in tl.static_range(KW - 1):
        sj = tl.load(base + j * stride_sk, mask=mc & (init != 0), other=0.0)
        acc += sj.to(tl.float32) * tl.load(W + offc * KW + j, mask=mc, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(base + (j - 1) * stride_sk, sj, mask=mc)
    if KW > 1:
        tl.store(base + (KW - 2) * stride_sk, x.to(State.dtype.element_ty), mask=mc)
    if HAS_BIAS:
        acc += tl.load(Bias + offc, mask=mc, other=0.0).to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(Out + b * stride_ob + offc, acc.to(Out.dtype.element_ty), mask=mc)


def _gdn_specs() -> list[CompileSpec]:
    specs = []
    for act in ("fp16", "fp32"):
        for dk, dv, r, raw in ((128, 128, 3, True), (128, 128, 2, True), (64, 64, 1, True), (128, 128, 3, False)):
            gate = f"*{act}" if raw else "*fp32"  # raw: the layer's projections a, b; else g, beta in fp32
            sig = {"Q": f"*{act}", "K": f"*{act}", "V": f"*{act}", "G": gate, "Beta": gate,
                   "ALog": "*fp32", "DtBias": "*fp32", "State": "*fp32", "Slots": "*i64", "HasInit": "*u8",
                   "Out": f"*{act}",
                   **{n: "i32" for n in ("stride_qb", "stride_qh", "stride_kb", "stride_kh", "stride_vb",
                                         "stride_vh", "stride_gb", "stride_betab")},
                   "stride_ss": "i64", "stride_sh": "i32", "stride_sk": "i32", "stride_ob": "i32",
                   "stride_oh": "i32", "scale": "fp32",
                   **{n: "constexpr" for n in ("HV_PER_K", "DK", "DV", "BLOCK_K", "BLOCK_V", "L2NORM",
                                               "RAW_GATES", "PDL")}}
            specs.append(CompileSpec(signature=sig, constexprs={"HV_PER_K": r, "DK": dk, "DV": dv, "BLOCK_K": dk,
                                                                "BLOCK_V": 32, "L2NORM": True, "RAW_GATES": raw,
                                                                "PDL": False},
                                     label=f"{act} dk{dk} dv{dv} r{r}" + (" raw gates" if raw else "")))
    return specs


def _verify_specs() -> list[CompileSpec]:
    specs = []
    for act in ("fp16", "fp32"):
        for dk, dv, r in ((128, 128, 3), (128, 128, 2), (64, 64, 1)):
            sig = {"Q": f"*{act}", "K": f"*{act}", "V": f"*{act}", "G": "*fp32", "Beta": "*fp32", "State": "*fp32",
                   "Slots": "*i64", "HasInit": "*u8", "Starts": "*i32", "Ends": "*i32", "Out": f"*{act}",
                   **{n: "i32" for n in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt",
                                         "stride_vh", "stride_gt", "stride_betat")},
                   "stride_ss": "i64", "stride_sh": "i32", "stride_sk": "i32", "stride_ot": "i32",
                   "stride_oh": "i32", "scale": "fp32", "checkpoint_base": "i64", "num_checkpoints": "i64",
                   **{n: "constexpr" for n in ("HV_PER_K", "DK", "DV", "BLOCK_K", "BLOCK_V", "L2NORM")}}
            specs.append(CompileSpec(signature=sig, constexprs={"HV_PER_K": r, "DK": dk, "DV": dv, "BLOCK_K": dk,
                                                                "BLOCK_V": 32, "L2NORM": True},
                                     label=f"{act} dk{dk} dv{dv} r{r}"))
    return specs


def _conv_verify_specs() -> list[CompileSpec]:
    specs = []
    for act in ("fp16", "fp32"):
        sig = {"X": f"*{act}", "W": f"*{act}", "State": f"*{act}", "Slots": "*i64", "HasInit": "*u8",
               "Starts": "*i32", "Ends": "*i32", "Out": f"*{act}", "stride_xt": "i32", "stride_ss": "i64",
               "stride_sk": "i32", "stride_ot": "i32", "C": "i32", "checkpoint_base": "i64",
               "num_checkpoints": "i64", "KW": "constexpr", "BLOCK_C": "constexpr", "SILU": "constexpr"}
        specs.append(CompileSpec(signature=sig, constexprs={"KW": 4, "BLOCK_C": 256, "SILU": True},
                                 label=f"{act} k4"))
    return specs


def _conv_specs() -> list[CompileSpec]:
    specs = []
    for act in ("fp16", "fp32"):
        sig = {"X": f"*{act}", "W": f"*{act}", "Bias": f"*{act}", "State": f"*{act}", "Slots": "*i64",
               "HasInit": "*u8", "Out": f"*{act}", "stride_xb": "i32", "stride_ss": "i64", "stride_sk": "i32",
               "stride_ob": "i32", "C": "i32",
               "KW": "constexpr", "BLOCK_C": "constexpr", "HAS_BIAS": "constexpr", "SILU": "constexpr",
               "PDL": "constexpr"}
        specs.append(CompileSpec(signature=sig, constexprs={"KW": 4, "BLOCK_C": 256, "HAS_BIAS": False,
                                                            "SILU": True, "PDL": False}, label=f"{act} k4"))
    return specs


register_kernel("gdn.decode_delta_rule", _gdn_decode_kernel, _gdn_specs(), compat=True)
register_kernel("gdn.decode_conv1d", _conv_decode_kernel, _conv_specs(), compat=True)
register_kernel("gdn.verify_delta_rule", _gdn_verify_kernel, _verify_specs(), compat=True)
register_kernel("gdn.verify_conv1d", _conv_verify_kernel, _conv_verify_specs(), compat=True)


def _flags(has_initial_state: torch.Tensor) -> torch.Tensor:
    """The kernels read has_initial_state as bytes: a bool tensor is viewed as uint8 (no conversion launch per
    layer and step), anything else converted."""
    if has_initial_state.dtype == torch.bool:
        return has_initial_state.view(torch.uint8)
    return has_initial_state.to(torch.uint8)


# The delta-rule decode step's tile by batch (benchmarks/micro/gdn_decode_sweep.py, H200, session 22, 35B / 27B
# heads, results/gdn-decode-sweep-77c8fce/): at 1 row 16 value columns on 2 warps (3.4 / 4.3 us; 32 on 4, the old
# default: 3.8 / 4.9), from 8 rows 64 on 4 (timed at 16 rows: 22.9 vs 23.2 us, 35B; at 64: 79.5 / 118.7 us = 3.4
# TB/s, against 90.0 / 135.4).
SMALL_DECODE_BATCH = 8


def decode_tile(bsz: int, block_k: int) -> tuple[int, int]:
    """(value columns per program, warps) of the decode step for `bsz` rows and a key block of block_k."""
    if bsz < SMALL_DECODE_BATCH:
        return max(16, 2048 // block_k), 2
    return max(16, 8192 // block_k), 4


def gated_delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, ssm_states: torch.Tensor, slots: torch.Tensor,
                            has_initial_state: torch.Tensor, scale: Optional[float] = None,
                            use_qk_l2norm: bool = True,
                            gate_params: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                            block_v: Optional[int] = None, num_warps: Optional[int] = None) -> torch.Tensor:
    """q, k [B, Hk, Dk]; v [B, Hv, Dv]; g, beta [B, Hv] fp32; ssm_states [num_slots, Hv, Dk, Dv] fp32 (updated
    at `slots`, long [B]); has_initial_state bool [B] -> out [B, Hv, Dv] in v's dtype.
    gate_params (A_log [Hv], dt_bias [Hv]): g and beta are then the layer's raw projections a and b (any float
    dtype, rows may be strided), and the kernel computes g = -exp(A_log) softplus(a + dt_bias) and
    beta = sigmoid(b) itself (the layer's ~8 elementwise launches per step). block_v (value columns per program,
    a power of two) and num_warps: the tile (default: decode_tile)."""
    bsz, hk, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    out = torch.empty(bsz, hv, dv, dtype=v.dtype, device=v.device)
    if bsz == 0:
        return out
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if gate_params is None:
        g, beta = g.float().contiguous(), beta.float().contiguous()
        a_log = dt_bias = g  # (not read)
    else:
        g, beta = (t if t.stride(-1) == 1 else t.contiguous() for t in (g, beta))
        a_log, dt_bias = (t.float().contiguous() for t in gate_params)
    assert ssm_states.stride(-1) == 1 and ssm_states.dtype == torch.float32
    block_k = triton.next_power_of_2(dk)
    tile_v, tile_warps = decode_tile(bsz, block_k)
    block_v = min(triton.next_power_of_2(dv), block_v or tile_v)
    num_warps = num_warps or tile_warps
    grid = (bsz, hv, triton.cdiv(dv, block_v))
    _gdn_decode_kernel[grid](
        q, k, v, g, beta, a_log, dt_bias, ssm_states, slots, _flags(has_initial_state), out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2), out.stride(0), out.stride(1),
        float(scale if scale is not None else dk ** -0.5),
        HV_PER_K=hv // hk, DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=block_v, L2NORM=use_qk_l2norm,
        RAW_GATES=gate_params is not None, num_warps=num_warps, **pdl.launch_options(),
    )
    return out


def gated_delta_rule_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            ssm_rows: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                            has_initial_state: torch.Tensor, checkpoint_base: int, num_checkpoints: int,
                            scale: Optional[float] = None, use_qk_l2norm: bool = True) -> torch.Tensor:
    """gdn_ref.gated_delta_rule_checkpointed on the GPU: q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv] (fp32
    log decay and beta); ssm_rows [rows, Hv, Dk, Dv] fp32 (a StateCache's ssm_rows[layer]: slots, then checkpoint
    rows); per walk i (int32 device tensors starts, ends [m]; slots long [m]; has_initial_state bool [m]): rows
    starts[i]:ends[i] (at most num_checkpoints + 1; none: nothing done) from the state at slots[i] -> out
    [T, Hv, Dv] in v's dtype (rows in no walk: zero)."""
    t, hk, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    out = torch.zeros(t, hv, dv, dtype=v.dtype, device=v.device)
    m = slots.shape[0]
    if m == 0 or t == 0:
        return out
    assert starts.dtype == ends.dtype == torch.int32
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    g, beta = g.float().contiguous(), beta.float().contiguous()
    assert ssm_rows.stride(-1) == 1 and ssm_rows.dtype == torch.float32
    block_k = triton.next_power_of_2(dk)
    block_v, num_warps = decode_tile(m, block_k)
    block_v = min(triton.next_power_of_2(dv), block_v)
    grid = (m, hv, triton.cdiv(dv, block_v))
    _gdn_verify_kernel[grid](
        q, k, v, g, beta, ssm_rows, slots, _flags(has_initial_state), starts, ends, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        ssm_rows.stride(0), ssm_rows.stride(1), ssm_rows.stride(2), out.stride(0), out.stride(1),
        float(scale if scale is not None else dk ** -0.5), checkpoint_base, num_checkpoints,
        HV_PER_K=hv // hk, DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=block_v, L2NORM=use_qk_l2norm,
        num_warps=num_warps,
    )
    return out


def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         conv_states: torch.Tensor, slots: torch.Tensor, has_initial_state: torch.Tensor,
                         activation: Optional[str] = "silu") -> torch.Tensor:
    """x [B, C] (last dim contiguous); weight [C, K] contiguous; conv_states [num_slots, K-1, C] (updated at
    `slots`) -> out [B, C]."""
    bsz, c = x.shape
    kw = weight.shape[1]
    out = torch.empty_like(x)
    if bsz == 0:
        return out
    if activation not in ("silu", None):
        raise ValueError(f"unsupported conv activation {activation!r}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight.contiguous()
    assert conv_states.stride(-1) == 1 and conv_states.shape[1:] == (kw - 1, c)
    block_c = min(1024, triton.next_power_of_2(c))
    grid = (bsz, triton.cdiv(c, block_c))
    _conv_decode_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_states, slots, _flags(has_initial_state), out,
        x.stride(0), conv_states.stride(0), max(conv_states.stride(1), 1), out.stride(0), c,
        KW=kw, BLOCK_C=block_c, HAS_BIAS=bias is not None, SILU=activation == "silu",
        num_warps=4, **pdl.launch_options(),
    )
    return out


def causal_conv1d_verify(x: torch.Tensor, weight: torch.Tensor, conv_rows: torch.Tensor, slots: torch.Tensor,
                         starts: torch.Tensor, ends: torch.Tensor, has_initial_state: torch.Tensor,
                         checkpoint_base: int, num_checkpoints: int, activation: Optional[str] = "silu"
                         ) -> torch.Tensor:
    """The conv of a verification in walks (as gated_delta_rule_verify's): x [T, C] (last dim contiguous); weight
    [C, K]; conv_rows [rows, K-1, C] (a StateCache's conv_rows[layer]); walk i runs rows starts[i]:ends[i] from the
    conv state at slots[i], leaving the state after each row but the last in its checkpoint rows and after the
    last in the slot -> out [T, C] (rows in no walk: zero)."""
    t, c = x.shape
    kw = weight.shape[1]
    out = torch.zeros_like(x)
    m = slots.shape[0]
    if m == 0 or t == 0:
        return out
    if activation not in ("silu", None):
        raise ValueError(f"unsupported conv activation {activation!r}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    assert conv_rows.stride(-1) == 1 and conv_rows.shape[1:] == (kw - 1, c)
    assert starts.dtype == ends.dtype == torch.int32
    block_c = min(1024, triton.next_power_of_2(c))
    _conv_verify_kernel[(m, triton.cdiv(c, block_c))](
        x, weight.contiguous(), conv_rows, slots, _flags(has_initial_state), starts, ends, out,
        x.stride(0), conv_rows.stride(0), max(conv_rows.stride(1), 1), out.stride(0), c, checkpoint_base,
        num_checkpoints, KW=kw, BLOCK_C=block_c, SILU=activation == "silu", num_warps=4,
    )
    return out
