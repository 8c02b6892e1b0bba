"""Plain-PyTorch reference ops of the Gated DeltaNet layer (run anywhere; the CPU path of the engine).

Gated delta rule, per value head h (state S: [Dk, Dv], fp32), for each token t:
    S   <- exp(g_t) * S                            (gated decay, g_t <= 0)
    u_t  = beta_t * (v_t - S^T k_t)                (delta: the part of v_t the memory does not predict)
    S   <- S + k_t u_t^T                           (write)
    o_t  = S^T q_t                                 (read)
q and k are L2-normalized and q is scaled by Dk^-0.5 before this (flags below). With Hk key heads and
Hv = r * Hk value heads, value head h reads key/query head h // r.

Chunked form (prefill): inside a chunk of C tokens starting from state S0, with gamma_t = sum_{s<=t} g_s
(within the chunk) and D[t, s] = exp(gamma_t - gamma_s) for s <= t, the deltas U solve the unit lower
triangular system
    (I + tril_strict(diag(beta) K K^T * D)) U = beta V - (beta exp(gamma) K) S0
so U = Wv - Wk S0 with Wv, Wk independent of S0 (solved once for all chunks), and
    O      = (exp(gamma) Q) S0 + ((Q K^T) * D * tril) U
    S_next = exp(gamma_last) S0 + (K * exp(gamma_last - gamma))^T U
Only the S0-dependent products run sequentially over chunks. Every exponent is <= 0 (no overflow).
Any chunk size and any split of a sequence into calls give the same result as the recurrent form.

Causal depthwise conv1d with carried state: out[t, c] = sum_j w[c, j] * xp[t + j, c] where
xp = concat(state [K-1, C], x [L, C]); the new state is the last K-1 rows of xp.

The *_varlen entry points take the flat token batch of one forward step (request i owns rows
qsl[i]:qsl[i+1]) and the state pool of one layer indexed by slot; a request without initial state
(nothing computed before this step) starts from zeros. Triton kernels implement the same entry points.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from voltllm.host_to_device import upload


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


# ---- causal depthwise conv1d ------------------------------------------------------------------------
def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  state: Optional[torch.Tensor], activation: Optional[str] = "silu"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [L, C], weight [C, K], state [K-1, C] or None (zeros) -> (out [L, C], new state [K-1, C])."""
    L, C = x.shape
    K = weight.shape[1]
    if state is None:
        state = x.new_zeros(K - 1, C)
    xp = torch.cat([state.to(x.dtype), x], dim=0)  # [K-1+L, C]
    out = F.conv1d(xp.t().unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), bias, groups=C)[0].t()
    if activation == "silu":
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"unsupported conv activation {activation!r}")
    return out.to(x.dtype), xp[L:].clone() if K > 1 else xp[:0].clone()


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       states: torch.Tensor, activation: Optional[str] = "silu"
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B requests: x [B, C], states [B, K-1, C] -> (out [B, C], new states)."""
    xp = torch.cat([states.to(x.dtype), x.unsqueeze(1)], dim=1)  # [B, K, C]
    out = (xp.to(weight.dtype) * weight.t().unsqueeze(0)).sum(1)
    if bias is not None:
        out = out + bias
    if activation == "silu":
        out = F.silu(out)
    return out.to(x.dtype), xp[:, 1:]


@dataclass
class ConvPlan:
    """Where a flat batch's rows go in the one-sequence form of causal_conv1d_varlen (index tensors on the
    device; built once per step from the host's qsl, shared by every GDN layer: conv_plan)."""
    live: torch.Tensor  # long [B']: the requests with tokens this step
    gather: torch.Tensor  # long [T + B' (K-1)]: row of [states of the live requests | x] for each row of xp
    rows: torch.Tensor  # long [T]: the conv output row of each token
    state_rows: torch.Tensor  # long [B' (K-1)]: the rows of xp that become the live requests' new states
    tokens: int  # T = qsl[-1]
    single: bool  # one live request: xp is [state | x] as it is and the conv rows are the tokens (no gathers)


def conv_plan(qsl: Sequence[int], kernel: int, device: torch.device) -> Optional[ConvPlan]:
    """ConvPlan of a flat batch (request i owns rows qsl[i]:qsl[i+1]); None when no request has tokens.
    xp stacks, per live request, its K-1 state rows and then its tokens, so one depthwise conv over xp gives every
    token's output at row (request's block start + token index) and the new state is each block's last K-1 rows."""
    bounds = np.asarray(qsl, dtype=np.int64)
    lens = bounds[1:] - bounds[:-1]
    live = np.nonzero(lens > 0)[0]
    if live.size == 0:
        return None
    k1 = kernel - 1
    n, lens, starts = live.size, lens[live], bounds[:-1][live]
    blocks = lens + k1
    offs = np.concatenate([[0], np.cumsum(blocks)[:-1]])
    req = np.repeat(np.arange(n), blocks)  # the live request of each row of xp
    r = np.arange(int(blocks.sum())) - offs[req]  # row within its block
    gather = np.where(r < k1, req * k1 + r, n * k1 + starts[req] + r - k1)
    tok_req = np.repeat(np.arange(n), lens)
    tokens = int(bounds[-1])
    rows = offs[tok_req] + np.arange(tokens) - starts[tok_req]
    state_rows = (offs + lens)[:, None] + np.arange(k1)[None, :]
    flat = upload(torch.from_numpy(np.concatenate([live, gather, rows, state_rows.reshape(-1)])), device)
    a, b, c = n, n + gather.size, n + gather.size + tokens
    return ConvPlan(flat[:a], flat[a:b], flat[b:c], flat[c:], tokens, n == 1)


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         conv_states: torch.Tensor, slots: torch.Tensor, qsl: Sequence[int],
                         has_initial_state: torch.Tensor, activation: Optional[str] = "silu",
                         decode_only: bool = False, plan: Optional[ConvPlan] = None) -> torch.Tensor:
    """Flat batch x [T, C]; conv_states [num_slots, K-1, C] updated in place at `slots` (long [B]).
    has_initial_state: bool [B]. decode_only: every request has exactly one row (vectorized path). Otherwise
    one depthwise conv over all requests' [state | tokens] blocks (`plan`: conv_plan(qsl, K, x.device), if the
    caller keeps it for several layers): a fixed number of launches and no host sync, whatever the batch.
    A request without tokens keeps its slot as it is."""
    out = torch.zeros_like(x)
    if decode_only:
        n = len(qsl) - 1
        st = conv_states.index_select(0, slots)
        st = torch.where(has_initial_state[:, None, None], st, torch.zeros_like(st))
        y, new = causal_conv1d_step(x[:n], weight, bias, st, activation)
        out[:n] = y
        conv_states.index_copy_(0, slots, new.to(conv_states.dtype))
        return out
    if activation not in ("silu", None):
        raise ValueError(f"unsupported conv activation {activation!r}")
    c, k = x.shape[1], weight.shape[1]
    if plan is None:
        plan = conv_plan(qsl, k, x.device)
    if plan is None:
        return out
    slots_live = slots.index_select(0, plan.live)
    st = conv_states.index_select(0, slots_live)
    st = torch.where(has_initial_state.index_select(0, plan.live)[:, None, None], st, torch.zeros_like(st))
    xp = torch.cat([st.reshape(-1, c).to(x.dtype), x[:plan.tokens]])
    if not plan.single:
        xp = xp.index_select(0, plan.gather)
    y = F.conv1d(xp.t().unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), bias, groups=c)[0].t()
    if not plan.single:
        y = y.index_select(0, plan.rows)
    if activation == "silu":
        y = F.silu(y)
    out[:plan.tokens] = y.to(x.dtype)
    if k > 1:
        new = xp.index_select(0, plan.state_rows).reshape(-1, k - 1, c)
        conv_states.index_copy_(0, slots_live, new.to(conv_states.dtype))
    return out


# ---- gated delta rule -------------------------------------------------------------------------------
def _prepare(q, k, v, g, beta, scale, use_qk_l2norm):
    """fp32, l2norm + scale, key heads expanded to value heads. Shapes stay token-major [L, H, D]."""
    hk, hv = k.shape[-2], v.shape[-2]
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (scale if scale is not None else q.shape[-1] ** -0.5)
    if hv != hk:
        q = q.repeat_interleave(hv // hk, dim=-2)
        k = k.repeat_interleave(hv // hk, dim=-2)
    return q, k, v, g, beta


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: Optional[torch.Tensor] = None,
                               scale: Optional[float] = None, use_qk_l2norm: bool = True
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token. q, k [L, Hk, Dk]; v [L, Hv, Dv]; g, beta [L, Hv]; state [Hv, Dk, Dv] fp32 or None.
    Also accepts a leading batch dim on everything (q [B, L, ...], state [B, Hv, Dk, Dv]).
    Returns (out [.., L, Hv, Dv] in v's dtype, final state fp32)."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    L = q.shape[-3]
    if state is None:
        state = q.new_zeros(*q.shape[:-3], q.shape[-2], q.shape[-1], v.shape[-1])
    S = state.float().clone()
    out = torch.empty_like(v)
    for t in range(L):
        qt, kt, vt = q[..., t, :, :], k[..., t, :, :], v[..., t, :, :]
        S = S * g[..., t, :].exp()[..., None, None]
        pred = (S * kt.unsqueeze(-1)).sum(-2)  # S^T k: [.., H, Dv]
        u = (vt - pred) * beta[..., t, :].unsqueeze(-1)
        S = S + kt.unsqueeze(-1) * u.unsqueeze(-2)
        out[..., t, :, :] = (S * qt.unsqueeze(-1)).sum(-2)
    return out.to(out_dtype), S


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: Optional[torch.Tensor] = None, chunk_size: int = 64,
                           scale: Optional[float] = None, use_qk_l2norm: bool = True
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form for one sequence (any length). Same arguments as the recurrent form, no batch dim."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    L, H, Dk = q.shape
    Dv = v.shape[-1]
    C = chunk_size
    pad = (-L) % C
    # head-major, padded with zeros: a padded token has g = 0 and beta = 0, so it changes nothing
    q, k, v = (F.pad(t.transpose(0, 1), (0, 0, 0, pad)) for t in (q, k, v))  # [H, L+pad, D]
    g, beta = (F.pad(t.t(), (0, pad)) for t in (g, beta))  # [H, L+pad]
    N = (L + pad) // C
    q, k, v = (t.reshape(H, N, C, -1) for t in (q, k, v))
    g, beta = g.reshape(H, N, C), beta.reshape(H, N, C)

    gam = g.cumsum(-1)  # [H, N, C]
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = (gam.unsqueeze(-1) - gam.unsqueeze(-2)).masked_fill(~incl, float("-inf")).exp()  # D[t, s]
    kb = k * beta.unsqueeze(-1)
    lower = (kb @ k.transpose(-1, -2)) * decay  # diagonal ignored by the unit-triangular solve
    egam = gam.exp().unsqueeze(-1)
    wv = torch.linalg.solve_triangular(lower, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    wk = torch.linalg.solve_triangular(lower, kb * egam, upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # inclusive of the diagonal
    qg = q * egam
    kd = k * (gam[..., -1:] - gam).exp().unsqueeze(-1)
    chunk_decay = gam[..., -1].exp()  # [H, N]

    S = q.new_zeros(H, Dk, Dv) if state is None else state.float().clone()
    out = q.new_empty(H, N, C, Dv)
    for n in range(N):
        u = wv[:, n] - wk[:, n] @ S  # [H, C, Dv]
        out[:, n] = qg[:, n] @ S + attn[:, n] @ u
        S = S * chunk_decay[:, n, None, None] + kd[:, n].transpose(-1, -2) @ u
    out = out.reshape(H, N * C, Dv)[:, :L].transpose(0, 1)
    return out.to(out_dtype), S


def gated_delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, ssm_states: torch.Tensor, slots: torch.Tensor,
                            qsl: Sequence[int], has_initial_state: torch.Tensor, decode_only: bool = False,
                            chunk_size: int = 64, scale: Optional[float] = None,
                            use_qk_l2norm: bool = True) -> torch.Tensor:
    """Flat batch: q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; ssm_states [num_slots, Hv, Dk, Dv]
    (fp32) read and written at `slots`. Returns out [T, Hv, Dv] (rows past qsl[-1] are zero)."""
    out = torch.zeros_like(v)
    if decode_only:
        n = len(qsl) - 1
        st = ssm_states.index_select(0, slots)
        st = torch.where(has_initial_state[:, None, None, None], st, torch.zeros_like(st))
        o, new = recurrent_gated_delta_rule(q[:n, None], k[:n, None], v[:n, None], g[:n, None],
                                            beta[:n, None], st, scale, use_qk_l2norm)
        out[:n] = o[:, 0]
        ssm_states.index_copy_(0, slots, new.to(ssm_states.dtype))
        return out
    init, slot_ids = has_initial_state.tolist(), slots.tolist()  # (host values: one sync each, not one per request)
    for i in range(len(qsl) - 1):
        s, e = qsl[i], qsl[i + 1]
        if e == s:
            continue
        slot = slot_ids[i]
        o, new = chunk_gated_delta_rule(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e],
                                        ssm_states[slot] if init[i] else None, chunk_size, scale, use_qk_l2norm)
        out[s:e] = o
        ssm_states[slot] = new.to(ssm_states.dtype)
    return out


def gated_delta_rule_checkpointed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                  beta: torch.Tensor, ssm_rows: torch.Tensor, slots: torch.Tensor, qsl: Sequence[int],
                                  has_initial_state: torch.Tensor, checkpoint_base: int, num_checkpoints: int,
                                  scale: Optional[float] = None, use_qk_l2norm: bool = True) -> torch.Tensor:
    """A speculative verification's delta rule, token by token: request i owns rows qsl[i]:qsl[i+1] (its known
    token, then its drafts; n_i - 1 <= num_checkpoints) and its state at ssm_rows[slots[i]]. The state after the
    request's position j < n_i - 1 goes to row checkpoint_base + slots[i] * num_checkpoints + j, the state after
    its last position to slots[i] (so a rejected draft's effect can be dropped: StateCache.keep_accepted).
    Shapes as gated_delta_rule_varlen's; returns out [T, Hv, Dv] (rows past qsl[-1] are zero)."""
    out = torch.zeros_like(v)
    lens = [qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)]
    if not lens or max(lens) == 0:
        return out
    if max(lens) - 1 > num_checkpoints:
        raise ValueError(f"a request verifies {max(lens) - 1} drafts, more than the {num_checkpoints} checkpoints")
    m, width, t = len(lens), max(lens), q.shape[0]
    dev = q.device
    # requests padded to the longest: padding rows take g = beta = 0 (index t of a zero row), which keeps S as is
    pad_idx = [qsl[i] + j if j < lens[i] else t for i in range(m) for j in range(width)]
    pad = torch.tensor(pad_idx, dtype=torch.long, device=dev)

    def padded(x):
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])]).index_select(0, pad).reshape(m, width, *x.shape[1:])

    qp, kp, vp, gp, bp = (padded(x) for x in _prepare(q, k, v, g, beta, scale, use_qk_l2norm))
    S = ssm_rows.index_select(0, slots).float()
    S = torch.where(has_initial_state[:, None, None, None], S, torch.zeros_like(S))
    base = checkpoint_base + slots * num_checkpoints
    op = torch.empty_like(vp)
    for j in range(width):
        S = S * gp[:, j].exp()[..., None, None]
        pred = (S * kp[:, j].unsqueeze(-1)).sum(-2)
        u = (vp[:, j] - pred) * bp[:, j].unsqueeze(-1)
        S = S + kp[:, j].unsqueeze(-1) * u.unsqueeze(-2)
        op[:, j] = (S * qp[:, j].unsqueeze(-1)).sum(-2)
        keep = [i for i in range(m) if j < lens[i] - 1]
        if keep:
            sel = torch.tensor(keep, dtype=torch.long, device=dev)
            ssm_rows.index_copy_(0, base.index_select(0, sel) + j, S.index_select(0, sel).to(ssm_rows.dtype))
    ssm_rows.index_copy_(0, slots, S.to(ssm_rows.dtype))
    real = pad < t
    out[pad[real]] = op.reshape(m * width, *op.shape[2:])[real].to(out.dtype)
    return out
