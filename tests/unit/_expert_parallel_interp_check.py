"""Checks of the MoE kernels' expert-parallel form (--enable-expert-parallel): a rank holds a run of whole experts and
passes its local ids, -1 for the other ranks' experts, whose pairs must add exactly nothing. Each result is compared
with the torch reference over all experts with the other ranks' routing weights set to zero.

Run as a script under TRITON_INTERPRET=1 by tests/unit/test_expert_parallel_kernels.py; prints one line per check:
    CHECK <name> <ok|FAIL> <detail>
Outputs and workspaces are poisoned with NaN first, so a row the kernels forget to write (or a skipped pair's garbage
that leaks into a sum) shows up.
"""
from __future__ import annotations

import sys

import torch
from interp_util import patch_interpreter_index, run_checks


def _shard(e: int, rank: int, size: int):
    from voltllm.distributed.experts import ExpertShard

    return ExpertShard.of(e, rank, size)


def _case(seed: int, t: int, e: int, k: int, h: int, inter: int, dtype: torch.dtype, device: str):
    """x, global w13 / w2, router weights and global ids (top-k of random logits, renormalized)."""
    from voltllm.model.layers.moe import route

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen).to(device, dtype)
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) * h ** -0.5).to(device, dtype)
    w2 = (torch.randn(e, h, inter, generator=gen) * inter ** -0.5).to(device, dtype)
    weights, ids = route(torch.randn(t, e, generator=gen), k, True)
    return x, w13, w2, weights.to(device), ids.to(device)


def _held_ref(x, w13, w2, weights, ids, shard) -> torch.Tensor:
    """The reference over every expert with the other ranks' pairs weighted zero (fp32)."""
    from voltllm.model.layers.moe import fused_experts_ref

    held = (ids >= shard.start) & (ids < shard.start + shard.count)
    return fused_experts_ref(x.float(), w13.float(), w2.float(), weights * held.to(weights.dtype), ids)


def _degenerate(ids: torch.Tensor, shard) -> str:
    """'FAIL ...' when the routing gives the rank no pair, or only its own (nothing would be checked)."""
    held = int(((ids >= shard.start) & (ids < shard.start + shard.count)).sum())
    return f"FAIL a degenerate case: {held} of {ids.numel()} pairs held" if held in (0, ids.numel()) else ""


def _local(ids: torch.Tensor, shard) -> torch.Tensor:
    m = shard.expert_map(ids.device)
    return m.index_select(0, ids.reshape(-1).to(torch.int64)).view(ids.shape)


def _verdict(got, out, ref, dtype) -> str:
    if out is not None and got.data_ptr() != out.data_ptr():
        return "FAIL the result is not in `out`"
    if torch.isnan(got).any():
        return f"FAIL {int(torch.isnan(got).any(-1).sum())} rows NaN (unwritten, or a skipped pair leaked)"
    err = (got.float() - ref.float()).abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    if err > tol * max(ref.abs().max().item(), 1.0):
        return f"FAIL max err {err:.3e}"
    return f"ok max err {err:.2e}"


def run_align(device: str, t: int, e: int, k: int, bm: int, rank: int, size: int, use_triton, sort=None) -> str:
    """moe_align over local ids with the other ranks' pairs as id E_local: exactly the held pairs are in the rows in
    use, each block one expert's, in pair order, the padded length within the static bound; the one-launch kernels
    equal the torch version."""
    from voltllm.kernels.moe import moe_align

    _, _, _, _, ids = _case(40 + rank, t, e, k, 8, 8, torch.float32, device)
    shard = _shard(e, rank, size)
    local = _local(ids, shard)
    local = torch.where(local < 0, shard.count, local)
    sorted_ids, block_expert, num_padded = moe_align(local, shard.count, bm, use_triton=use_triton, sort=sort)
    if use_triton:
        want = moe_align(local, shard.count, bm, use_triton=False)
        used = int(want[2].cpu()[0])
        if int(num_padded.cpu()[0]) != used or not torch.equal(sorted_ids.cpu()[:used], want[0].cpu()[:used]) \
                or not torch.equal(block_expert.cpu()[:used // bm], want[1].cpu()[:used // bm]):
            return "FAIL differs from the torch align"
    flat = local.reshape(-1).cpu()
    n = flat.numel()
    counts = torch.bincount(flat, minlength=shard.count + 1)[:shard.count].tolist()
    used = int(num_padded.cpu()[0])
    if used != sum(-(-c // bm) * bm for c in counts) or used > sorted_ids.numel():
        return f"FAIL num_padded {used}"
    s, be = sorted_ids.cpu().tolist(), block_expert.cpu().tolist()
    real = [p for p in s[:used] if p < n]
    held = [p for p in range(n) if int(flat[p]) < shard.count]
    if sorted(real) != held:
        return f"FAIL rows in use hold {len(real)} pairs, {len(held)} held"
    for b in range(used // bm):
        rows = [p for p in s[b * bm:(b + 1) * bm] if p < n]
        if any(int(flat[p]) != be[b] for p in rows) or rows != sorted(rows):
            return f"FAIL block {b}"
    return f"ok {len(held)} of {n} pairs held, {used // bm} blocks"


def run_grouped(device: str, t: int, e: int, k: int, rank: int, size: int, dtype: torch.dtype) -> str:
    """kernels/moe.fused_experts(skip_foreign=True) over the rank's experts == the held reference."""
    from voltllm.kernels.moe import fused_experts

    h, inter = 48, 32
    x, w13, w2, weights, ids = _case(50 + rank, t, e, k, h, inter, dtype, device)
    shard = _shard(e, rank, size)
    if bad := _degenerate(ids, shard):
        return bad
    ref = _held_ref(x, w13, w2, weights, ids, shard)
    a, b = shard.start, shard.start + shard.count
    pairs = t * k
    ws = (torch.full((pairs, inter), float("nan"), dtype=dtype, device=device),
          torch.full((pairs, h), float("nan"), dtype=dtype, device=device))
    out = torch.full((t, h), float("nan"), dtype=dtype, device=device)
    config = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=2)
    got = fused_experts(x, w13[a:b], w2[a:b], weights, _local(ids, shard), out=out, config=config, _workspaces=ws,
                        skip_foreign=True)
    return _verdict(got, out, ref, dtype)


def run_small(device: str, t: int, e: int, k: int, rank: int, size: int, dtype: torch.dtype) -> str:
    """moe_decode.fused_experts_small with local ids, -1 for the other ranks' experts == the held reference."""
    from voltllm.kernels.moe_decode import fused_experts_small

    h, inter = 40, 24
    x, w13, w2, weights, ids = _case(60 + rank, t, e, k, h, inter, dtype, device)
    shard = _shard(e, rank, size)
    if bad := _degenerate(ids, shard):
        return bad
    ref = _held_ref(x, w13, w2, weights, ids, shard)
    a, b = shard.start, shard.start + shard.count
    out = torch.full((t, h), float("nan"), dtype=dtype, device=device)
    got = fused_experts_small(x, w13[a:b], w2[a:b], weights, _local(ids, shard), out=out)
    return _verdict(got, out, ref, dtype)


def run_small_shared(device: str, t: int, e: int, k: int, rank: int, size: int) -> str:
    """moe_route(shared_gate=...) + the expert map (the shared entry E -> E_local) + fused_experts_small(shared=...)
    == the held reference plus the gated shared expert."""
    import torch.nn.functional as F

    from voltllm.kernels.moe_decode import fused_experts_small, moe_route
    from voltllm.model.layers.moe import route

    h, inter, si = 48, 24, 40
    gen = torch.Generator().manual_seed(70 + rank)
    x, w13, w2, _, _ = _case(71 + rank, t, e, k, h, inter, torch.float32, device)
    ws13 = (torch.randn(2 * si, h, generator=gen) * h ** -0.5).to(device)
    ws2 = (torch.randn(h, si, generator=gen) * si ** -0.5).to(device)
    wsg = (torch.randn(1, h, generator=gen) * h ** -0.5).to(device)
    logits = torch.randn(t, e, generator=gen).to(device)
    w_ref, ids_ref = route(logits, k, True)
    shard = _shard(e, rank, size)
    if bad := _degenerate(ids_ref, shard):
        return bad
    gu = x @ ws13.t()
    ref = _held_ref(x, w13, w2, w_ref, ids_ref, shard) + \
        torch.sigmoid(x @ wsg.t()) * ((F.silu(gu[:, :si]) * gu[:, si:]) @ ws2.t())
    w, ids = moe_route(logits, k, True, shared_gate=(x, wsg))
    local = _local(ids, shard)
    if not bool((local[:, k] == shard.count).all()):
        return f"FAIL the shared entries map to {local[:, k].tolist()}, not {shard.count}"
    a, b = shard.start, shard.start + shard.count
    out = torch.full((t, h), float("nan"), device=device)
    got = fused_experts_small(x, w13[a:b], w2[a:b], w, local, out=out, shared=(ws13, ws2))
    return _verdict(got, out, ref, torch.float32)


class _Rank:
    """A stand-in tensor-parallel group placing whole experts; the all-reduce is the check's own sum."""

    expert_parallel = True

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def all_reduce_(self, x):
        return x


def run_layer(device: str, tokens: int, size: int) -> str:
    """SparseMoE on every rank with the Triton experts (9 tokens x top 2: the unsorted decode launches with the shared
    expert inside; 40: the grouped GEMM): the ranks' outputs add up to the whole layer's (torch reference)."""
    from voltllm.model.layers.moe import SparseMoE

    e, h, inter, si = 6, 32, 24, 16
    gen = torch.Generator().manual_seed(80)
    g = lambda *shape: torch.randn(*shape, generator=gen) * 0.3  # noqa: E731
    w = {"gate.weight": g(e, h), "shared_expert_gate.weight": g(1, h), "shared_expert.gate_proj.weight": g(si, h),
         "shared_expert.up_proj.weight": g(si, h), "shared_expert.down_proj.weight": g(h, si)}
    for i in range(e):
        w.update({f"experts.{i}.gate_proj.weight": g(inter, h), f"experts.{i}.up_proj.weight": g(inter, h),
                  f"experts.{i}.down_proj.weight": g(h, inter)})

    def layer(tp):
        moe = SparseMoE(h, e, 2, inter, si, False, torch.float32, tp=tp)
        for name, t in w.items():
            moe.load_hf_weight(name, t.clone(), "mlp.")
        return moe.to(device)

    x = torch.randn(tokens, h, generator=gen).to(device)
    whole = layer(None)
    parts = [layer(_Rank(r, size)) for r in range(size)]
    with torch.no_grad():
        ref = whole(x)
        try:
            SparseMoE.triton_experts = True
            got = sum(p(x) for p in parts)
        finally:
            SparseMoE.triton_experts = None
    return _verdict(got, None, ref, torch.float32) + f" ({[p.num_local_experts for p in parts]} experts per rank)"


def run_quant_pairs(device: str) -> str:
    """quant_moe_matmul: a pair whose expert is -1 gets a zero row, the others their expert's product."""
    from _quant_gemv_interp_check import _int4_planes, rel

    from voltllm.kernels.quant_gemv import quant_moe_matmul
    from voltllm.model.layers.gguf_planes import dequantize_planes, int4_kind

    gen = torch.Generator().manual_seed(90)
    e, rows, k = 2, 40, 256
    p = _int4_planes(int4_kind(64, True), e * rows, k, gen)
    w = dequantize_planes(p)
    x = torch.randn(3, k, dtype=torch.float16)
    x_rows = torch.tensor([0, 0, 1, 2, 2], dtype=torch.int32)
    experts = torch.tensor([1, -1, -1, 0, 1], dtype=torch.int32)
    out = quant_moe_matmul(x, p, rows, x_rows, experts, out=torch.full((5, rows), float("nan"), dtype=torch.float16))
    ref = torch.stack([x[r].float() @ w[ex * rows:(ex + 1) * rows].T if ex >= 0 else torch.zeros(rows)
                       for r, ex in zip(x_rows.tolist(), experts.tolist())])
    if torch.isnan(out).any() or not bool((out[1:3] == 0).all()):
        return "FAIL the other ranks' pairs are not zero rows"
    err = rel(out, ref)
    return f"{'ok' if err < 2e-3 else 'FAIL'} rel {err:.2e}"


def run_quant_sorted(device: str, split) -> str:
    """quant_moe_dot(skip_foreign=True) after moe_align of local ids (the other ranks' pairs as id E_local): their
    rows are zero, split K or not, the held pairs' rows their weighted products."""
    from _quant_gemv_interp_check import INT4_KINDS, _int4_planes, rel

    from voltllm.kernels.moe import moe_align
    from voltllm.kernels.quant_dot import quant_moe_dot
    from voltllm.model.layers.gguf_planes import dequantize_planes

    gen = torch.Generator().manual_seed(91)
    e, rows, k, pairs = 3, 40, 256, 10
    p = _int4_planes(INT4_KINDS[1], e * rows, k, gen)
    w = dequantize_planes(p)
    flat = [0, -1, 2, 2, -1, 1, 0, -1, 1, 2]
    ids = torch.tensor(flat, dtype=torch.int32).view(5, 2)
    order = moe_align(torch.where(ids < 0, e, ids), e, 16)
    xp = torch.randn(pairs, k, dtype=torch.float16)
    weights = torch.rand(pairs)
    out = quant_moe_dot(xp, p, rows, *order, pairs, 1, 16, row_weights=weights, split=split, skip_foreign=True)
    ref = torch.stack([weights[q] * (xp[q].float() @ w[ex * rows:(ex + 1) * rows].T) if ex >= 0
                       else torch.zeros(rows) for q, ex in enumerate(flat)])
    if torch.isnan(out).any() or not bool((out[[1, 4, 7]] == 0).all()):
        return "FAIL the other ranks' pairs are not zero rows"
    err = rel(out, ref)
    return f"{'ok' if err < 2e-3 else 'FAIL'} rel {err:.2e}"


CHECKS = {
    # 7 experts over 2 ranks (4 + 3) and 3 ranks (3 + 2 + 2): vLLM's linear placement of an uneven count
    "align_torch_e7_r1of2": lambda d: run_align(d, 23, 7, 2, 16, 1, 2, False),
    "align_triton_e7_r0of2": lambda d: run_align(d, 23, 7, 2, 16, 0, 2, True),
    "align_sort_e7_r2of3": lambda d: run_align(d, 23, 7, 2, 4, 2, 3, True, sort=True),
    "grouped_e7_k2_r0of2_f32": lambda d: run_grouped(d, 19, 7, 2, 0, 2, torch.float32),
    "grouped_e8_k3_r3of4_f16": lambda d: run_grouped(d, 21, 8, 3, 3, 4, torch.float16),
    "small_e7_k2_r1of2_f32": lambda d: run_small(d, 5, 7, 2, 1, 2, torch.float32),
    "small_e8_k4_r1of4_f16": lambda d: run_small(d, 3, 8, 4, 1, 4, torch.float16),
    "small_shared_e6_k2_r1of3": lambda d: run_small_shared(d, 4, 6, 2, 1, 3),
    "layer_decode_shared_2ranks": lambda d: run_layer(d, 9, 2),
    "layer_grouped_4ranks": lambda d: run_layer(d, 40, 4),
    "quant_pairs_foreign_zero": run_quant_pairs,
    "quant_sorted_foreign_zero": lambda d: run_quant_sorted(d, 1),
    "quant_sorted_foreign_zero_split2": lambda d: run_quant_sorted(d, 2),
}


def main(device: str = "cpu") -> int:
    patch_interpreter_index()
    return run_checks(CHECKS, device)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
