"""Checks of the Triton MoE grouped GEMM (voltllm.kernels.moe) against the torch reference
(voltllm.model.layers.moe.fused_experts_ref) on random inputs.

Run as a script under TRITON_INTERPRET=1 (set before triton is imported) by tests/unit/test_moe_kernels.py,
or on a GPU by tests/gpu/test_hybrid_gpu.py (device argument); prints one line per check:
    CHECK <name> <ok|FAIL> <detail>
Outputs and workspaces are poisoned with NaN first, so a row the kernels forget to write shows up.
"""
from __future__ import annotations

import sys

import torch
from interp_util import patch_interpreter_index, run_checks


def _routing(t: int, e: int, k: int, skew: str, gen: torch.Generator, device: str):
    """Router logits -> (weights fp32 [T, k], ids [T, k]). skew: 'uniform' | 'hot' (a few experts take most
    tokens, several get none) | 'few' (only experts 1, 2, ... k+1 ever chosen)."""
    from voltllm.model.layers.moe import route

    logits = torch.randn(t, e, generator=gen)
    if skew == "hot":
        logits[:, : e // 2] -= 6.0  # the first half is (almost) never chosen
        logits[:, e - 1] += 4.0  # one hot expert
    elif skew == "few":
        logits[:, :] = -30.0
        logits[:, 1:k + 2] = torch.randn(t, k + 1, generator=gen)
    w, ids = route(logits, k, renormalize=True)
    return w.to(device), ids.to(device)


def _inputs(gen: torch.Generator, t: int, e: int, h: int, inter: int, device: str, dtype: torch.dtype):
    """x [T, H] and expert weights w13 [E, 2I, H], w2 [E, H, I], scaled to keep the outputs O(1)."""
    x = torch.randn(t, h, generator=gen).to(device, dtype)
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) * h ** -0.5).to(device, dtype)
    w2 = (torch.randn(e, h, inter, generator=gen) * inter ** -0.5).to(device, dtype)
    return x, w13, w2


def _verdict(got: torch.Tensor, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> str:
    """The result is in the (NaN-poisoned) `out`, every row written, within the dtype's tolerance of ref."""
    if got.data_ptr() != out.data_ptr():
        return "FAIL the result is not in `out`"
    if torch.isnan(got).any():
        return f"FAIL {int(torch.isnan(got).any(-1).sum())} rows unwritten (NaN)"
    err = (got.float() - ref.float()).abs().max().item()
    scale = ref.abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    if err > tol * max(scale, 1.0):
        return f"FAIL max err {err:.3e} (max |ref| {scale:.3e})"
    return f"ok max err {err:.2e}"


def run_experts(device: str, t: int, e: int, k: int, h: int, inter: int, dtype: torch.dtype, skew: str,
                seed: int, config: dict | None = None, chunk_pairs: int | None = None) -> str:
    from voltllm.kernels import moe as M
    from voltllm.model.layers.moe import fused_experts_ref

    gen = torch.Generator().manual_seed(seed)
    x, w13, w2 = _inputs(gen, t, e, h, inter, device, dtype)
    weights, ids = _routing(t, e, k, skew, gen, device)
    counts = torch.bincount(ids.reshape(-1).cpu(), minlength=e)
    ref = fused_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
    old = M.MAX_CHUNK_PAIRS
    if chunk_pairs is not None:
        M.MAX_CHUNK_PAIRS = chunk_pairs
    try:
        pairs = min(t, max(1, M.MAX_CHUNK_PAIRS // k)) * k
        ws = (torch.full((pairs + 3, inter), float("nan"), dtype=dtype, device=device),
              torch.full((pairs + 3, h), float("nan"), dtype=dtype, device=device))
        out = torch.full((t, h), float("nan"), dtype=dtype, device=device)
        got = M.fused_experts(x, w13, w2, weights, ids, out=out, config=config, _workspaces=ws)
    finally:
        M.MAX_CHUNK_PAIRS = old
    empty = int((counts == 0).sum())
    return f"{_verdict(got, out, ref, dtype)} (empty experts {empty}, max load {int(counts.max())})"


def run_align(device: str, t: int, e: int, k: int, bm: int, seed: int, use_triton: bool | None = None,
              sort: bool | None = None) -> str:
    """moe_align's outputs have its properties; with use_triton, the one-launch kernel's rows in use also equal
    the torch version's exactly."""
    from voltllm.kernels.moe import moe_align

    gen = torch.Generator().manual_seed(seed)
    _, ids = _routing(t, e, k, "hot", gen, device)
    sorted_ids, block_expert, num_padded = moe_align(ids, e, bm, use_triton=use_triton, sort=sort)
    if use_triton:
        want_ids, want_be, want_np = moe_align(ids, e, bm, use_triton=False)
        used = int(want_np.cpu()[0])
        if (int(num_padded.cpu()[0]) != used or not torch.equal(sorted_ids.cpu(), want_ids.cpu())
                or not torch.equal(block_expert.cpu()[:used // bm], want_be.cpu()[:used // bm])):
            return f"FAIL differs from the torch align: num_padded {int(num_padded.cpu()[0])} vs {used}"
    n = t * k
    flat = ids.reshape(-1).cpu()
    s = sorted_ids.cpu().tolist()
    be = block_expert.cpu().tolist()
    used = int(num_padded.cpu()[0])
    counts = torch.bincount(flat, minlength=e).tolist()
    if used != sum(-(-c // bm) * bm for c in counts):
        return f"FAIL num_padded {used}"
    if used > len(s):
        return "FAIL padded length over the bound"
    real = [p for p in s[:used] if p < n]
    if sorted(real) != list(range(n)) or any(p != n for p in s[used:]):
        return "FAIL pairs lost or duplicated"
    for b in range(used // bm):
        for p in s[b * bm:(b + 1) * bm]:
            if p < n and int(flat[p]) != be[b]:
                return f"FAIL block {b} mixes experts"
    for b in range(used // bm):  # stable: pairs of one expert in token order
        rows = [p for p in s[b * bm:(b + 1) * bm] if p < n]
        if rows != sorted(rows):
            return f"FAIL block {b} not in pair order"
    return f"ok {used // bm} blocks"


def run_route(device: str, t: int, e: int, k: int, renorm: bool, dtype: torch.dtype, seed: int) -> str:
    """moe_decode.moe_route (one launch) == route (softmax, topk, renormalize) on the same logits."""
    from voltllm.kernels.moe_decode import moe_route
    from voltllm.model.layers.moe import route

    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(t, e, generator=gen) * 2).to(device, dtype)
    want_w, want_ids = route(logits, k, renorm)
    got_w, got_ids = moe_route(logits, k, renorm)
    if got_ids.dtype != torch.int32 or tuple(got_ids.shape) != (t, k) or got_w.dtype != torch.float32:
        return f"FAIL outputs {got_ids.dtype} {tuple(got_ids.shape)} {got_w.dtype}"
    if not torch.equal(got_ids.long().cpu(), want_ids.cpu()):
        return f"FAIL ids {got_ids[:2].tolist()} vs {want_ids[:2].tolist()}"
    err = (got_w - want_w).abs().max().item()
    if err > 1e-6:
        return f"FAIL weights max err {err:.3e}"
    return f"ok weights max err {err:.1e}"


def run_small_experts(device: str, t: int, e: int, k: int, h: int, inter: int, dtype: torch.dtype, skew: str,
                      seed: int) -> str:
    """moe_decode.fused_experts_small (unsorted, one pair per program) == fused_experts_ref, `out` poisoned."""
    from voltllm.kernels.moe_decode import fused_experts_small
    from voltllm.model.layers.moe import fused_experts_ref

    gen = torch.Generator().manual_seed(seed)
    x, w13, w2 = _inputs(gen, t, e, h, inter, device, dtype)
    weights, ids = _routing(t, e, k, skew, gen, device)
    ref = fused_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
    out = torch.full((t, h), float("nan"), dtype=dtype, device=device)
    got = fused_experts_small(x, w13, w2, weights, ids.to(torch.int32), out=out)
    return _verdict(got, out, ref, dtype)


def run_route_nan(device: str) -> str:
    """A row of NaN / inf logits (a padded CUDA-graph row, an fp16 overflow) still yields expert ids in range."""
    from voltllm.kernels.moe_decode import moe_route

    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(30)).to(device)
    logits[1] = float("nan")
    logits[2, 3] = float("inf")
    _, ids = moe_route(logits, 4, True)
    if not bool(((ids >= 0) & (ids < 16)).all()):
        return f"FAIL ids out of range: {ids.tolist()}"
    return f"ok ids {ids[1].tolist()} for the NaN row"


def run_small_shared(device: str, t: int, e: int, k: int, h: int, inter: int, shared_inter: int,
                     dtype: torch.dtype, seed: int) -> str:
    """moe_route(shared_gate=...) + fused_experts_small(shared=...) == the routed experts' reference plus
    sigmoid(x w_gate) * shared MLP(x), `out` poisoned."""
    import torch.nn.functional as F

    from voltllm.kernels.moe_decode import fused_experts_small, moe_route
    from voltllm.model.layers.moe import fused_experts_ref, route

    gen = torch.Generator().manual_seed(seed)
    x, w13, w2 = _inputs(gen, t, e, h, inter, device, dtype)
    ws13 = (torch.randn(2 * shared_inter, h, generator=gen) * h ** -0.5).to(device, dtype)
    ws2 = (torch.randn(h, shared_inter, generator=gen) * shared_inter ** -0.5).to(device, dtype)
    wsg = (torch.randn(1, h, generator=gen) * h ** -0.5).to(device, dtype)
    logits = torch.randn(t, e, generator=gen).to(device, dtype)
    w_ref, ids_ref = route(logits, k, True)
    xf = x.float()
    gu = xf @ ws13.float().t()
    shared_ref = torch.sigmoid(xf @ wsg.float().t()) * ((F.silu(gu[:, :shared_inter]) * gu[:, shared_inter:])
                                                         @ ws2.float().t())
    ref = fused_experts_ref(xf, w13.float(), w2.float(), w_ref, ids_ref) + shared_ref
    w, ids = moe_route(logits, k, True, shared_gate=(x, wsg))
    if tuple(ids.shape) != (t, k + 1) or not bool((ids[:, k] == e).all()):
        return f"FAIL shared entries: ids {ids.tolist()}"
    if not torch.equal(ids[:, :k].long().cpu(), ids_ref.cpu()):
        return "FAIL routed ids"
    gate_err = (w[:, k] - torch.sigmoid(xf @ wsg.float().t())[:, 0]).abs().max().item()
    if gate_err > 1e-5:
        return f"FAIL shared gate weight err {gate_err:.3e}"
    out = torch.full((t, h), float("nan"), dtype=dtype, device=device)
    got = fused_experts_small(x, w13, w2, w, ids, out=out, shared=(ws13, ws2))
    status = _verdict(got, out, ref, dtype)
    return status if status.startswith("FAIL") else f"{status}, shared gate err {gate_err:.1e}"


def run_layer(device: str, dtype: torch.dtype = torch.float32, tokens: int = 9) -> str:
    """SparseMoE with the Triton experts == with the torch reference (shared expert and gate included); 9
    tokens x top-2 take the unsorted decode path, 40 the grouped GEMM."""
    from voltllm.model.layers.moe import SparseMoE

    gen = torch.Generator().manual_seed(11)
    moe = SparseMoE(hidden=32, num_experts=6, top_k=2, moe_inter=24, shared_inter=16, norm_topk_prob=False,
                    dtype=dtype).to(device)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen).to(device, p.dtype) * 0.3)
    x = torch.randn(tokens, 32, generator=gen).to(device, dtype)
    try:
        moe.triton_experts = False
        ref = moe(x)
        moe.triton_experts = True
        got = moe(x)
    finally:
        moe.triton_experts = None
    err = (got.float() - ref.float()).abs().max().item()
    if err > 1e-4 * max(1.0, ref.abs().max().item()):
        return f"FAIL max err {err:.3e}"
    return f"ok max err {err:.2e}"


DECODE = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
PREFILL = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=2)

CHECKS = {
    "align_e8_k2_bm16": lambda d: run_align(d, 37, 8, 2, 16, 0),
    "align_e64_k8_bm16_decode": lambda d: run_align(d, 3, 64, 8, 16, 1),
    "align_e5_k1_bm4": lambda d: run_align(d, 50, 5, 1, 4, 2),
    "align_triton_e8_k2_bm16": lambda d: run_align(d, 37, 8, 2, 16, 0, use_triton=True),
    "align_triton_e64_k8_bm16_decode": lambda d: run_align(d, 3, 64, 8, 16, 1, use_triton=True),
    "align_triton_e5_k1_bm4": lambda d: run_align(d, 50, 5, 1, 4, 2, use_triton=True),
    "align_triton_e256_k8_bm16_t64": lambda d: run_align(d, 64, 256, 8, 16, 31, use_triton=True),
    "align_triton_e16_k8_bm64_t300": lambda d: run_align(d, 300, 16, 8, 64, 32, use_triton=True),
    # the sort form (CUDA-graph captures)
    "align_sort_e8_k2_bm16": lambda d: run_align(d, 37, 8, 2, 16, 0, use_triton=True, sort=True),
    "align_sort_e256_k8_bm16_t64": lambda d: run_align(d, 64, 256, 8, 16, 31, use_triton=True, sort=True),
    "align_sort_e16_k8_bm64_t300": lambda d: run_align(d, 300, 16, 8, 64, 32, use_triton=True, sort=True),
    "e4_k2_t7_f32": lambda d: run_experts(d, 7, 4, 2, 64, 48, torch.float32, "uniform", 3, DECODE),
    "e8_k2_t33_hot_f32_empty_experts": lambda d: run_experts(d, 33, 8, 2, 48, 40, torch.float32, "hot", 4, PREFILL),
    "e64_k8_t5_decode_f32": lambda d: run_experts(d, 5, 64, 8, 64, 32, torch.float32, "uniform", 5, DECODE),
    "e16_k8_t40_f16": lambda d: run_experts(d, 40, 16, 8, 64, 48, torch.float16, "hot", 6, PREFILL),
    "e12_k8_t20_few_experts_f32": lambda d: run_experts(d, 20, 12, 8, 40, 24, torch.float32, "few", 7, DECODE),
    "e6_k1_t17_f32": lambda d: run_experts(d, 17, 6, 1, 32, 32, torch.float32, "hot", 8, DECODE),
    "e8_k2_t30_chunked_f32": lambda d: run_experts(d, 30, 8, 2, 32, 24, torch.float32, "uniform", 9, PREFILL,
                                                   chunk_pairs=16),
    "e8_k2_t1_auto_config_f32": lambda d: run_experts(d, 1, 8, 2, 32, 16, torch.float32, "uniform", 10),
    "layer_sparse_moe_f32": lambda d: run_layer(d),
    "layer_sparse_moe_grouped_f32": lambda d: run_layer(d, tokens=40),
    # decode-sized batches (voltllm.kernels.moe_decode)
    "route_e256_k8_renorm_f16": lambda d: run_route(d, 3, 256, 8, True, torch.float16, 20),
    "route_e10_k3_f32": lambda d: run_route(d, 5, 10, 3, False, torch.float32, 21),
    "route_e512_k10_renorm_f32": lambda d: run_route(d, 2, 512, 10, True, torch.float32, 22),
    "route_e6_k6_all_f32": lambda d: run_route(d, 1, 6, 6, True, torch.float32, 23),
    "route_nan_rows_in_range": lambda d: run_route_nan(d),
    "small_e64_k8_t1_f32": lambda d: run_small_experts(d, 1, 64, 8, 64, 32, torch.float32, "uniform", 24),
    "small_e4_k2_t5_shared_experts_f32": lambda d: run_small_experts(d, 5, 4, 2, 40, 24, torch.float32, "hot", 25),
    "small_e16_k8_t3_f16": lambda d: run_small_experts(d, 3, 16, 8, 300, 48, torch.float16, "few", 26),
    "small_e8_k1_t2_f32": lambda d: run_small_experts(d, 2, 8, 1, 32, 520, torch.float32, "uniform", 27),
    "small_shared_e8_k2_t3_wider_shared_f32": lambda d: run_small_shared(d, 3, 8, 2, 48, 24, 40, torch.float32, 28),
    "small_shared_e64_k8_t1_narrower_shared_f16": lambda d: run_small_shared(d, 1, 64, 8, 300, 32, 16,
                                                                             torch.float16, 29),
}



def main(device: str = "cpu") -> int:
    patch_interpreter_index()
    return run_checks(CHECKS, device)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
