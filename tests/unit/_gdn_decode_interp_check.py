"""Checks of the Triton GDN decode kernels against voltllm.kernels.gdn_ref (decode_only paths).

Run as a script under TRITON_INTERPRET=1 (set before triton is imported) by
tests/unit/test_gdn_decode_interp.py, or on a GPU by tests/gpu (device argument); prints one line per check:
    CHECK <name> <ok|FAIL> <detail>
"""
from __future__ import annotations

import sys

import torch

from interp_util import patch_interpreter_index
from voltllm.kernels import gdn_ref as R

patch_interpreter_index()  # the verification kernel loops over each request's rows (loaded bounds)


def _compare(out: torch.Tensor, ref: torch.Tensor, pool: torch.Tensor, ref_pool: torch.Tensor,
             dtype: torch.dtype) -> str:
    """Outputs within the dtype's tolerance of the reference's, the fp32 state pools within 1e-4 (relative)."""
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    err_o = (out.float() - ref.float()).abs().max().item()
    err_s = (pool - ref_pool).abs().max().item()
    if err_o > tol * max(1.0, ref.float().abs().max().item()) or err_s > 1e-4 * max(1.0, ref_pool.abs().max().item()):
        return f"FAIL out err {err_o:.3e} state err {err_s:.3e}"
    return f"ok out err {err_o:.2e} state err {err_s:.2e}"


def run_delta(device: str, bsz: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, seed: int,
              **tile) -> str:
    from voltllm.kernels.gdn_decode import gated_delta_rule_decode

    g = torch.Generator().manual_seed(seed)
    num_slots = bsz + 3
    q = torch.randn(bsz, hk, dk, generator=g).to(device, dtype)
    k = torch.randn(bsz, hk, dk, generator=g).to(device, dtype)
    v = torch.randn(bsz, hv, dv, generator=g).to(device, dtype)
    gl = (-torch.rand(bsz, hv, generator=g) * 2).to(device)
    beta = torch.rand(bsz, hv, generator=g).to(device)
    pool = torch.randn(num_slots, hv, dk, dv, generator=g).to(device)
    slots = torch.randperm(num_slots, generator=g)[:bsz].to(device)
    init = (torch.arange(bsz) % 3 != 1).to(device)
    ref_pool = pool.clone()
    ref = R.gated_delta_rule_varlen(q, k, v, gl, beta, ref_pool, slots, list(range(bsz + 1)), init,
                                    decode_only=True)
    out = gated_delta_rule_decode(q, k, v, gl, beta, pool, slots, init, **tile)
    return _compare(out, ref, pool, ref_pool, dtype)


def run_delta_raw_gates(device: str, bsz: int, hk: int, hv: int, d: int, dtype: torch.dtype, seed: int) -> str:
    """gate_params: the kernel takes the raw projections a, b (strided columns of one projection output, as the
    layer passes them) and computes g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) itself."""
    import torch.nn.functional as F

    from voltllm.kernels.gdn_decode import gated_delta_rule_decode

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(bsz, hk, d, generator=g).to(device, dtype)
    k = torch.randn(bsz, hk, d, generator=g).to(device, dtype)
    v = torch.randn(bsz, hv, d, generator=g).to(device, dtype)
    proj = (torch.randn(bsz, 3 * hv + 5, generator=g) * 4).to(device, dtype)  # large |a|: both softplus branches
    proj[0, 2 * hv + 1] = 30.0  # past softplus' threshold
    b, a = proj[:, 5:5 + hv], proj[:, 2 * hv:3 * hv]
    a_log = torch.randn(hv, generator=g).to(device)
    dt_bias = torch.randn(hv, generator=g).to(device)
    beta = torch.sigmoid(b.float())
    gl = -a_log.exp() * F.softplus(a.float() + dt_bias)
    pool = torch.randn(bsz + 1, hv, d, d, generator=g).to(device)
    slots = torch.arange(bsz, device=device)
    init = (torch.arange(bsz) % 2 == 0).to(device)
    ref_pool = pool.clone()
    ref = R.gated_delta_rule_varlen(q, k, v, gl, beta, ref_pool, slots, list(range(bsz + 1)), init,
                                    decode_only=True)
    out = gated_delta_rule_decode(q, k, v, a, b, pool, slots, init, gate_params=(a_log, dt_bias))
    return _compare(out, ref, pool, ref_pool, dtype)


def run_conv(device: str, bsz: int, c: int, kw: int, dtype: torch.dtype, bias: bool, seed: int) -> str:
    from voltllm.kernels.gdn_decode import causal_conv1d_decode

    g = torch.Generator().manual_seed(seed)
    num_slots = bsz + 2
    x = torch.randn(bsz, c, generator=g).to(device, dtype)
    w = torch.randn(c, kw, generator=g).to(device, dtype)
    b = torch.randn(c, generator=g).to(device, dtype) if bias else None
    pool = torch.randn(num_slots, kw - 1, c, generator=g).to(device, dtype)
    slots = torch.randperm(num_slots, generator=g)[:bsz].to(device)
    init = (torch.arange(bsz) % 2 == 0).to(device)
    ref_pool = pool.clone()
    ref = R.causal_conv1d_varlen(x, w, b, ref_pool, slots, list(range(bsz + 1)), init, decode_only=True)
    out = causal_conv1d_decode(x, w, b, pool, slots, init)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    err_o = (out.float() - ref.float()).abs().max().item()
    err_s = (pool.float() - ref_pool.float()).abs().max().item()
    if err_o > tol * max(1.0, ref.float().abs().max().item()) or err_s > 0:
        return f"FAIL out err {err_o:.3e} state err {err_s:.3e}"
    return f"ok out err {err_o:.2e}"


def run_verify(device: str, lens: list, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, seed: int) -> str:
    """The multi-token verification kernel vs gdn_ref.gated_delta_rule_checkpointed: requests of lens[i] rows
    (one known token + drafts), fresh random inputs, the state pool's slots and checkpoint rows (poisoned with 1e30
    where nothing may be written: rows of other slots stay as they were, the ones written hold no poison)."""
    from voltllm.kernels.gdn_decode import gated_delta_rule_verify

    g = torch.Generator().manual_seed(seed)
    m, nc = len(lens), max(lens) - 1 if max(lens) > 1 else 1
    num_slots = m + 2
    base = num_slots + 1
    t = sum(lens)
    q = torch.randn(t, hk, dk, generator=g).to(device, dtype)
    k = torch.randn(t, hk, dk, generator=g).to(device, dtype)
    v = torch.randn(t, hv, dv, generator=g).to(device, dtype)
    gl = (-torch.rand(t, hv, generator=g) * 2).to(device)
    beta = torch.rand(t, hv, generator=g).to(device)
    pool = torch.randn(base + num_slots * nc, hv, dk, dv, generator=g)
    pool[base:] = 1e30
    pool = pool.to(device)
    slots = torch.randperm(num_slots, generator=g)[:m].to(device)
    init = (torch.arange(m) % 3 != 1).to(device)
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    ref_pool = pool.clone()
    ref = R.gated_delta_rule_checkpointed(q, k, v, gl, beta, ref_pool, slots, qsl, init, base, nc)
    bounds = torch.tensor(qsl, dtype=torch.int32, device=device)
    out = gated_delta_rule_verify(q, k, v, gl, beta, pool, slots, bounds[:-1], bounds[1:], init, base, nc)
    written = [base + int(slots[i]) * nc + j for i in range(m) for j in range(lens[i] - 1)]
    if written and pool[written].abs().max().item() >= 1e29:
        return "FAIL a checkpoint row was not written"
    return _compare(out, ref, pool, ref_pool, dtype)


def run_conv_verify(device: str, lens: list, c: int, kw: int, dtype: torch.dtype, seed: int) -> str:
    """The verification conv kernel vs a direct torch form: walk i's rows from its slot's state (zeros when not
    init), outputs, checkpoint rows and final state; walks given as (start, end) per row of a padded row layout
    (a graph step: only a request's first row has a non-empty walk)."""
    import torch.nn.functional as F

    from voltllm.kernels.gdn_decode import causal_conv1d_verify

    g = torch.Generator().manual_seed(seed)
    m, nc = len(lens), max(max(lens) - 1, 1)
    num_slots = m + 2
    base = num_slots + 1
    t = sum(lens)
    x = torch.randn(t, c, generator=g).to(device, dtype)
    w = torch.randn(c, kw, generator=g).to(device, dtype)
    rows = torch.randn(base + num_slots * nc, kw - 1, c, generator=g)
    rows[base:] = 1e4
    rows = rows.to(device, dtype)
    slot_of = torch.randperm(num_slots, generator=g)[:m].tolist()
    init_of = [i % 3 != 1 for i in range(m)]
    # one walk per row: a request's first row walks its rows, the others are empty
    starts, ends, slots, init, first = [], [], [], [], []
    at = 0
    for i, n in enumerate(lens):
        for j in range(n):
            starts.append(at + j if j else at)
            ends.append(at + j if j else at + n)
            slots.append(slot_of[i])
            init.append(init_of[i])
        first.append(at)
        at += n
    ref_rows = rows.clone()
    ref = torch.zeros(t, c, dtype=torch.float32)
    for i, n in enumerate(lens):
        s0, slot = first[i], slot_of[i]
        old = rows[slot].float().cpu() if init_of[i] else torch.zeros(kw - 1, c)
        xp = torch.cat([old, x[s0:s0 + n].float().cpu()])
        for p in range(n):
            ref[s0 + p] = F.silu((xp[p:p + kw].t() * w.float().cpu()).sum(-1))
            dst = slot if p == n - 1 else base + slot * nc + p
            ref_rows[dst] = xp[p + 1:p + kw].to(device, dtype)
    dev = lambda v, dt: torch.tensor(v, dtype=dt, device=device)  # noqa: E731
    out = causal_conv1d_verify(x, w, rows, dev(slots, torch.long), dev(starts, torch.int32), dev(ends, torch.int32),
                               dev(init, torch.bool), base, nc)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    err_o = (out.float().cpu() - ref).abs().max().item()
    err_s = (rows.float() - ref_rows.float()).abs().max().item()
    if err_o > tol * max(1.0, ref.abs().max().item()) or err_s > 0:
        return f"FAIL out err {err_o:.3e} state err {err_s:.3e}"
    return f"ok out err {err_o:.2e}"


def run_layer_verify(device: str, triton_on: bool) -> str:
    """A GatedDeltaNet layer's verification step (drafting requests, a decode row, a prompt chunk) then
    StateCache.keep_accepted == the same tokens as one-token steps up to each request's last accepted one: the
    outputs of every row, and the slots' conv and SSM states afterwards."""
    from tiny_models import tiny_gdn_layer
    from voltllm.model.layers.gdn import HybridBatch
    from voltllm.model.state_cache import StateCache

    layer = tiny_gdn_layer(device)
    layer.triton_decode = triton_on
    nc = 3
    lens, drafts, slots, init = [4, 1, 3, 5], [3, 0, 2, 0], [2, 0, 3, 1], [True, True, True, False]
    accepted = [1, 0, 2, 0]  # request 2 accepts all its drafts, request 0 one of three
    qsl = [0, 4, 5, 8, 13]
    x = torch.randn(13, 32, generator=torch.Generator().manual_seed(21)).to(device)
    cache = StateCache(1, 4, layer.conv_state_shape, layer.ssm_state_shape, torch.float32, device, checkpoints=nc)
    torch.manual_seed(2)
    cache.conv[0].copy_(torch.randn_like(cache.conv[0]))
    cache.ssm[0].copy_(torch.randn_like(cache.ssm[0]))
    ref_cache = StateCache(1, 4, layer.conv_state_shape, layer.ssm_state_shape, torch.float32, device)
    ref_cache.conv[0].copy_(cache.conv[0])
    ref_cache.ssm[0].copy_(cache.ssm[0])
    batch = HybridBatch(cache, torch.tensor(slots, device=device), torch.tensor(init, device=device), qsl, False,
                        drafts=drafts, host_rows=(slots, init))
    out = layer(x, batch)
    cache.keep_accepted(torch.tensor([slots[0], slots[2]], device=device), torch.tensor([3, 2], device=device),
                        torch.tensor([accepted[0], accepted[2]], device=device))
    # reference: each request's rows one token a step (the prompt chunk in one step), states saved at the kept point
    layer.triton_decode = False
    ref_out = torch.zeros_like(out)
    keep_conv, keep_ssm = ref_cache.conv[0].clone(), ref_cache.ssm[0].clone()
    for i in range(4):
        if lens[i] > 1 and not drafts[i]:
            b = HybridBatch(ref_cache, torch.tensor([slots[i]], device=device),
                            torch.tensor([init[i]], device=device), [0, lens[i]], False)
            ref_out[qsl[i]:qsl[i + 1]] = layer(x[qsl[i]:qsl[i + 1]], b)
        else:
            for j in range(lens[i]):
                b = HybridBatch(ref_cache, torch.tensor([slots[i]], device=device),
                                torch.tensor([init[i] or j > 0], device=device), [0, 1], True)
                ref_out[qsl[i] + j:qsl[i] + j + 1] = layer(x[qsl[i] + j:qsl[i] + j + 1], b)
                if j == accepted[i]:
                    keep_conv[slots[i]] = ref_cache.conv[0][slots[i]]
                    keep_ssm[slots[i]] = ref_cache.ssm[0][slots[i]]
            continue
        keep_conv[slots[i]] = ref_cache.conv[0][slots[i]]
        keep_ssm[slots[i]] = ref_cache.ssm[0][slots[i]]
    layer.triton_decode = None
    err = (out - ref_out).abs().max().item()
    err_s = (cache.ssm[0][:4] - keep_ssm[:4]).abs().max().item()
    err_c = (cache.conv[0][:4] - keep_conv[:4]).abs().max().item()
    if max(err, err_s, err_c) > 1e-4:
        return f"FAIL out err {err:.3e} ssm err {err_s:.3e} conv err {err_c:.3e}"
    return f"ok out err {err:.2e} ssm err {err_s:.2e}"


def run_layer_walks(device: str, triton_on: bool) -> str:
    """A verification as decode rows (a CUDA graph's form: per-row walks, padding rows on the scratch slot) ==
    the same verification as a prompt-form step (per-request rows, the torch path): outputs, slots and
    checkpoint rows. triton_on: the walk kernels, else the torch path through HybridBatch.regrouped()."""
    from tiny_models import tiny_gdn_layer
    from voltllm.model.layers.gdn import HybridBatch
    from voltllm.model.state_cache import StateCache

    layer = tiny_gdn_layer(device)
    nc = 3
    lens, slot_of = [4, 1, 3], [2, 0, 3]
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(22)).to(device)  # 8 rows + 1 padding row
    caches = []
    for _ in range(2):
        cache = StateCache(1, 4, layer.conv_state_shape, layer.ssm_state_shape, torch.float32, device, checkpoints=nc)
        torch.manual_seed(3)
        cache.conv_rows[0].copy_(torch.randn_like(cache.conv_rows[0]))
        cache.ssm_rows[0].copy_(torch.randn_like(cache.ssm_rows[0]))
        caches.append(cache)
    # reference: a prompt-form verification step (torch path)
    layer.triton_decode = False
    ref = HybridBatch(caches[0], torch.tensor(slot_of, device=device), torch.ones(3, dtype=torch.bool, device=device),
                      [0, 4, 5, 8], False, drafts=[3, 0, 2], host_rows=(slot_of, [True] * 3))
    want = layer(x[:8], ref)
    # walks: one row per token, the padding row last
    starts, ends, slots = [], [], []
    at = 0
    for n, slot in zip(lens, slot_of):
        for j in range(n):
            starts.append(at + j if j else at)
            ends.append(at + j if j else at + n)
            slots.append(slot)
        at += n
    starts.append(8)
    ends.append(9)
    slots.append(caches[1].pad_slot)
    init = [True] * 8 + [False]
    dev = lambda v, dt: torch.tensor(v, dtype=dt, device=device)  # noqa: E731
    batch = HybridBatch(caches[1], dev(slots, torch.long), dev(init, torch.bool), list(range(10)), True,
                        walks=(dev(starts, torch.int32), dev(ends, torch.int32)))
    layer.triton_decode = triton_on
    got = layer(x, batch)
    layer.triton_decode = None
    rows = list(range(4)) + list(range(caches[0].checkpoint_base, caches[0].conv_rows[0].shape[0]))
    err = (got[:8] - want).abs().max().item()
    err_s = (caches[0].ssm_rows[0][rows] - caches[1].ssm_rows[0][rows]).abs().max().item()
    err_c = (caches[0].conv_rows[0][rows] - caches[1].conv_rows[0][rows]).abs().max().item()
    if max(err, err_s, err_c) > 1e-4:
        return f"FAIL out err {err:.3e} ssm err {err_s:.3e} conv err {err_c:.3e}"
    return f"ok out err {err:.2e} ssm err {err_s:.2e}"


CHECKS = {
    "layer_walks_triton_vs_prompt_form": lambda d: run_layer_walks(d, True),
    "verify_f32_dk16_dv16_r2": lambda d: run_verify(d, [4, 1, 3, 2], 2, 4, 16, 16, torch.float32, 11),
    "verify_f32_dk24_dv40_r1_masked": lambda d: run_verify(d, [5, 5, 1], 2, 2, 24, 40, torch.float32, 12),
    "verify_f16_dk64_dv64_r2": lambda d: run_verify(d, [3, 1, 4, 4, 2], 2, 4, 64, 64, torch.float16, 13),
    "verify_f32_dk128_dv128_r3": lambda d: run_verify(d, [2, 6], 1, 3, 128, 128, torch.float32, 14),
    "layer_verify_triton_vs_stepwise": lambda d: run_layer_verify(d, True),
    "conv_verify_f32_k4": lambda d: run_conv_verify(d, [4, 1, 3, 2], 100, 4, torch.float32, 15),
    "conv_verify_f32_c2100_k4": lambda d: run_conv_verify(d, [5, 2], 2100, 4, torch.float32, 16),
    "conv_verify_f16_k3": lambda d: run_conv_verify(d, [3, 1, 4], 64, 3, torch.float16, 17),
    "delta_f32_dk16_dv16_r2": lambda d: run_delta(d, 5, 2, 4, 16, 16, torch.float32, 0),
    "delta_f32_dk128_dv128_r3": lambda d: run_delta(d, 3, 1, 3, 128, 128, torch.float32, 1),
    "delta_f32_dk24_dv40_r1_masked": lambda d: run_delta(d, 4, 2, 2, 24, 40, torch.float32, 2),
    "delta_f16_dk64_dv64_r2": lambda d: run_delta(d, 6, 2, 4, 64, 64, torch.float16, 3),
    "delta_f32_dk128_dv128_bv16_w2": lambda d: run_delta(d, 3, 1, 2, 128, 128, torch.float32, 9, block_v=16,
                                                         num_warps=2),
    "delta_f32_dk32_dv40_bv64_w8_masked": lambda d: run_delta(d, 2, 1, 2, 32, 40, torch.float32, 10, block_v=64,
                                                              num_warps=8),
    "delta_raw_gates_f32_r2": lambda d: run_delta_raw_gates(d, 3, 2, 4, 32, torch.float32, 7),
    "delta_raw_gates_f16_r3": lambda d: run_delta_raw_gates(d, 2, 1, 3, 64, torch.float16, 8),
    "conv_f32_c100_k4": lambda d: run_conv(d, 5, 100, 4, torch.float32, False, 4),
    "conv_f32_c2100_k4_bias": lambda d: run_conv(d, 3, 2100, 4, torch.float32, True, 5),
    "conv_f16_c64_k3": lambda d: run_conv(d, 4, 64, 3, torch.float16, False, 6),
}


def main(device: str = "cpu") -> int:
    from interp_util import run_checks

    return run_checks(CHECKS, device)


def run_layer(device: str) -> str:
    """A GatedDeltaNet layer's decode steps through the Triton kernels == through the torch reference."""
    from tiny_models import tiny_gdn_layer
    from voltllm.model.layers.gdn import HybridBatch
    from voltllm.model.state_cache import StateCache

    layer = tiny_gdn_layer(device)
    caches = []
    outs = []
    for triton_on in (False, True):
        layer.triton_decode = triton_on
        cache = StateCache(1, 4, layer.conv_state_shape, layer.ssm_state_shape, torch.float32, device)
        torch.manual_seed(1)
        cache.conv[0].copy_(torch.randn_like(cache.conv[0]))
        cache.ssm[0].copy_(torch.randn_like(cache.ssm[0]))
        batch = HybridBatch(cache, torch.tensor([3, 0, 2], device=device),
                            torch.tensor([True, False, True], device=device), [0, 1, 2, 3], True)
        steps = []
        for step in range(3):
            x = torch.randn(3, 32, generator=torch.Generator().manual_seed(10 + step)).to(device)
            steps.append(layer(x, batch))
            batch.has_initial_state = torch.ones(3, dtype=torch.bool, device=device)
        outs.append(torch.stack(steps))
        caches.append(cache)
    layer.triton_decode = None
    err = (outs[0] - outs[1]).abs().max().item()
    err_s = (caches[0].ssm[0] - caches[1].ssm[0]).abs().max().item()
    err_c = (caches[0].conv[0] - caches[1].conv[0]).abs().max().item()
    if max(err, err_s, err_c) > 1e-4:
        return f"FAIL out err {err:.3e} ssm err {err_s:.3e} conv err {err_c:.3e}"
    return f"ok out err {err:.2e}"


CHECKS["layer_decode_triton_vs_ref"] = run_layer


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
