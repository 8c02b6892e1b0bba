"""Checks of the Triton chunked gated delta rule (voltllm.kernels.gdn_chunk) against voltllm.kernels.gdn_ref
(gated_delta_rule_varlen, the torch chunked form, itself tested against the recurrent form).

Run as a script under TRITON_INTERPRET=1 (set before triton is imported) by tests/unit/test_gdn_chunk_interp.py,
or on a GPU by tests/gpu/test_hybrid_gpu.py (device argument); prints one line per check:
    CHECK <name> <ok|FAIL> <detail>
"""
from __future__ import annotations

import functools
import sys

import torch
from interp_util import patch_interpreter_index, run_checks

from voltllm.kernels import gdn_ref as R


def run_varlen(device: str, lens: list[int], hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, seed: int,
               init_every: int = 2, decay: float = 1.0, block_v=None, repeat_keys: bool = False,
               precision=None, hoist=None, split=None) -> str:
    """A flat batch of requests of the given lengths; some start from a stored state, some from zeros (their
    slot holds garbage that must not be read). Outputs poisoned with NaN beforehand. precision None: the
    kernels' own choice for the dtype and device (tf32 products for half inputs on sm_80+). hoist: the tile's
    HOIST form (None: the default tile's); split: pieces of the key / value dimension in the prep and hoist
    kernels (None: the default tile's)."""
    from voltllm.kernels.gdn_chunk import auto_precision, gated_delta_rule_chunked

    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    q = torch.randn(t, hk, dk, generator=gen)
    k = torch.randn(t, hk, dk, generator=gen)
    if repeat_keys:  # the same key over and over: the worst case for the triangular solve
        k[:] = k[:1]
    v = torch.randn(t, hv, dv, generator=gen)
    g = -torch.rand(t, hv, generator=gen) * decay
    beta = torch.rand(t, hv, generator=gen)
    q, k, v = (x.to(device, dtype) for x in (q, k, v))
    g, beta = g.to(device), beta.to(device)
    n = len(lens)
    pool = torch.randn(n + 2, hv, dk, dv, generator=gen).to(device)
    slots = torch.randperm(n + 2, generator=gen)[:n].to(device)
    init = torch.tensor([i % init_every == 0 for i in range(n)], device=device)
    ref_pool = pool.clone()
    ref = R.gated_delta_rule_varlen(q.float(), k.float(), v.float(), g, beta, ref_pool, slots, qsl, init)
    if precision is None:
        precision = auto_precision(dtype, torch.device(device))
    out = gated_delta_rule_chunked(q, k, v, g, beta, pool, slots, qsl, init, block_v=block_v, precision=precision,
                                   hoist=hoist, split=split)
    if torch.isnan(out).any():
        return "FAIL NaN in the output"
    err_o = (out.float() - ref.float()).abs().max().item()
    err_s = (pool - ref_pool).abs().max().item()
    scale_o = max(1.0, ref.float().abs().max().item())
    scale_s = max(1.0, ref_pool.abs().max().item())
    tol = 2e-4 if dtype == torch.float32 else 5e-3
    tol_s = 2e-4
    if precision == "tf32" and torch.device(device).type == "cuda":  # operands rounded to 10 mantissa bits
        tol, tol_s = 1e-2, 5e-3
    # (tf32x3 keeps the fp32 tolerances: three tf32 products per fp32 one)
    if err_o > tol * scale_o or err_s > tol_s * scale_s:
        return f"FAIL out err {err_o:.3e} (max {scale_o:.2e}) state err {err_s:.3e} (max {scale_s:.2e})"
    untouched = [i for i in range(n + 2) if i not in slots.tolist()]
    if untouched and not torch.equal(pool[untouched], ref_pool[untouched]):
        return "FAIL a slot outside the batch changed"
    return f"ok out err {err_o:.2e} state err {err_s:.2e}"


def run_smem_fallback(device: str) -> str:
    """A GPU with less shared memory than the first tiles need: the call falls back through the precision's tiles,
    then to the "ieee" ones, remembers what ran, and fails with a clear error when nothing fits. Simulated: the
    launch of a tile raises Triton's OutOfResources as its compile would."""
    from triton.runtime.errors import OutOfResources

    from voltllm.kernels import gdn_chunk as GC

    real, tried = GC._launch, []

    def small_gpu(fits):
        def launch(precision, tile, *args):
            tried.append((precision, tile))
            if not fits(precision, tile):
                raise OutOfResources(300_000, 101_376, "shared memory")
            return real(precision, tile, *args)
        return launch

    try:
        GC._chosen.clear()  # a GPU where only the tf32x3 tile with 16 value columns fits
        GC._launch = small_gpu(lambda p, t: t.block_v <= 16)
        status = run_varlen(device, [70, 5], 1, 2, 16, 32, torch.float16, 11, precision="tf32x3")
        want = [("tf32x3", t) for t in GC.TILES["tf32x3"]]
        if not status.startswith("ok") or tried != want or want[-1][1].block_v != 16:
            return f"FAIL smaller tile: {status}, tried {tried}"
        (key, chosen), = GC._chosen.items()
        tried.clear()
        run_varlen(device, [9], 1, 2, 16, 32, torch.float16, 12, precision="tf32x3")  # remembered: one launch
        if chosen != want[-1] or tried != [want[-1]]:
            return f"FAIL remembered tile: {chosen}, then tried {tried}"
        GC._chosen.clear()
        tried.clear()
        GC._launch = small_gpu(lambda p, t: p == "ieee")
        status = run_varlen(device, [40], 1, 2, 16, 32, torch.float16, 13, precision="tf32x3")
        if not status.startswith("ok") or tried[-1] != ("ieee", GC.TILES["ieee"][0]) or \
                len(tried) != len(GC.TILES["tf32x3"]) + 1:
            return f"FAIL ieee fallback: {status}, tried {tried}"
        GC._chosen.clear()
        GC._launch = small_gpu(lambda p, t: False)
        try:
            run_varlen(device, [40], 1, 2, 16, 32, torch.float16, 14, precision="tf32x3")
        except RuntimeError as e:
            if "no tile fits" not in str(e):
                return f"FAIL error message: {e}"
        else:
            return "FAIL no error when nothing fits"
    finally:
        GC._launch = real
        GC._chosen.clear()
    return "ok falls back through the tiles, then to ieee, and says so when nothing fits"


def _tiny_layer(device: str, seed: int):
    """A GatedDeltaNet of 2 key / 4 value heads of 16 dims, hidden 32, random fp32 weights."""
    from types import SimpleNamespace

    from voltllm.model.layers.gdn import GatedDeltaNet

    cfg = SimpleNamespace(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                          linear_value_head_dim=16, linear_conv_kernel_dim=4, hidden_size=32, rms_norm_eps=1e-6)
    gen = torch.Generator().manual_seed(seed)
    layer = GatedDeltaNet(cfg, 0, torch.float32).to(device)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) * 0.3).to(device))
        layer.A_log.copy_(torch.empty(4).uniform_(0.02, 0.5, generator=gen).log().to(device))
    return layer


def run_layer(device: str) -> str:
    """GatedDeltaNet prefill chunks through the Triton kernel == through the torch reference."""
    from voltllm.model.layers.gdn import HybridBatch
    from voltllm.model.state_cache import StateCache

    layer = _tiny_layer(device, 5)
    outs = {}
    for flag in (False, True):
        layer.triton_prefill = flag
        cache = StateCache(1, 3, layer.conv_state_shape, layer.ssm_state_shape, torch.float32, device)
        x1 = torch.randn(70 + 5, 32, generator=torch.Generator().manual_seed(6)).to(device)
        x2 = torch.randn(40 + 1, 32, generator=torch.Generator().manual_seed(7)).to(device)
        ys = []
        # step 1: two requests from token 0; step 2: both resume (40 more / 1 more)
        for x, qsl, starts, init in ((torch.cat([x1[:70], x2[:5]]), [0, 70, 75], [0, 0], [False, False]),
                                     (torch.cat([x1[70:], x2[5:]]), [0, 5, 41], [70, 5], [True, True])):
            batch = HybridBatch(state_cache=cache, slots=torch.tensor([2, 0], device=device),
                                has_initial_state=torch.tensor(init, device=device), query_start_loc=qsl,
                                decode_only=False)
            ys.append(layer(x, batch))
        outs[flag] = (torch.cat(ys), cache.ssm[0].clone(), cache.conv[0].clone())
    layer.triton_prefill = None
    errs = [(a - b).abs().max().item() for a, b in zip(outs[False], outs[True])]
    if max(errs) > 1e-4:
        return f"FAIL errors {errs}"
    return f"ok max err {max(errs):.2e}"


def run_layer_mixed(device: str) -> str:
    """A mixed step (decode rows, a one-token prompt, a prompt chunk, a padding token) through GatedDeltaNet with
    the Triton kernels: the one-row requests take the decode kernel (RowSplit), the rest the chunk kernels, and
    outputs and states equal the torch path's."""
    from voltllm.kernels import gdn_chunk, gdn_decode
    from voltllm.model.layers.gdn import HybridBatch
    from voltllm.model.state_cache import StateCache

    layer = _tiny_layer(device, 15)
    xs = torch.randn(200, 32, generator=torch.Generator().manual_seed(16)).to(device)
    # step 1: prompts of 70 / 5 / 3 tokens; step 2: decode row, 36 more, decode row, a new one-token prompt, then
    # one padding token (past the last request)
    steps = (([0, 70, 75, 78], [False, False, False], [2, 0, 3]),
             ([0, 1, 37, 38, 39], [True, True, True, False], [2, 0, 3, 1]))
    seen = {"decode_rows": 0, "chunk_tokens": 0}
    real_dec, real_chunk = gdn_decode.gated_delta_rule_decode, gdn_chunk.gated_delta_rule_chunked

    def dec(q, *a, **kw):
        seen["decode_rows"] += q.shape[0]
        return real_dec(q, *a, **kw)

    def chunk(q, *a, **kw):
        seen["chunk_tokens"] += q.shape[0]
        return real_chunk(q, *a, **kw)

    outs = {}
    try:
        gdn_decode.gated_delta_rule_decode, gdn_chunk.gated_delta_rule_chunked = dec, chunk
        for flag in (False, True):
            layer.triton_prefill = layer.triton_decode = layer.triton_conv = flag
            cache = StateCache(1, 5, layer.conv_state_shape, layer.ssm_state_shape, torch.float32, device)
            ys, used = [], 0
            for qsl, init, slots in steps:
                n = qsl[-1] + (1 if len(qsl) == 5 else 0)
                batch = HybridBatch(state_cache=cache, slots=torch.tensor(slots, device=device),
                                    has_initial_state=torch.tensor(init, device=device), query_start_loc=qsl,
                                    decode_only=False)
                ys.append(layer(xs[used:used + n], batch))
                used += n
            outs[flag] = (torch.cat(ys), cache.ssm[0].clone(), cache.conv[0].clone())
    finally:
        gdn_decode.gated_delta_rule_decode, gdn_chunk.gated_delta_rule_chunked = real_dec, real_chunk
        layer.triton_prefill = layer.triton_decode = layer.triton_conv = None
    # Triton run: step 1 all chunked (78 tokens), step 2 three decode rows and the 36-token chunk
    if seen != {"decode_rows": 3, "chunk_tokens": 78 + 36}:
        return f"FAIL the step was not split as expected: {seen}"
    errs = [(a - b).abs().max().item() for a, b in zip(outs[False], outs[True])]
    if max(errs) > 1e-4:
        return f"FAIL errors {errs}"
    return f"ok max err {max(errs):.2e}"


def run_model(device: str) -> str:
    """A tiny Qwen3-Next (GDN + gated attention + MoE) over chunked prefill and decode steps: every Triton path
    of the hybrid model on (chunked delta rule, decode kernels, MoE grouped GEMM, the attention output gate) == all
    torch references."""
    import transformers

    from voltllm.attention.backend import AttentionMetadata, make_kv_cache
    from voltllm.attention.torch_ref import TorchReferenceBackend
    from voltllm.model.forward_context import ForwardContext
    from voltllm.model.layers.gdn import GatedDeltaNet
    from voltllm.model.layers.moe import SparseMoE
    from voltllm.model.models.qwen3_next import GatedAttention, Qwen3NextForCausalLM
    from voltllm.model.state_cache import StateCache

    cfg = transformers.Qwen3NextConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, intermediate_size=48, num_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=24, max_position_embeddings=512)
    model = Qwen3NextForCausalLM(cfg, torch.float32, 512).to(device).eval()
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.02, 0.5, generator=gen).log().to(device))
            else:
                p.copy_((torch.randn(p.shape, generator=gen) * (0.3 if p.dim() < 2 else 0.15)).to(device))
    seqs = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (92, 22, 42)]
    # (mixed steps with decode rows: RowSplit; then a decode-only step)
    schedule = [[(0, 70), (1, 5)], [(0, 20), (1, 1), (2, 40)], [(0, 1), (1, 15), (2, 1)], [(0, 1), (1, 1), (2, 1)]]

    def run(triton: bool) -> torch.Tensor:
        GatedDeltaNet.triton_prefill = GatedDeltaNet.triton_decode = GatedDeltaNet.triton_conv = triton
        GatedDeltaNet.triton_norm = triton
        SparseMoE.triton_experts = triton
        GatedAttention.triton_gate = triton
        bs, heads_dim = 16, model.kv_heads_and_dim
        kv = make_kv_cache(model.num_attention_layers, 24, bs, *heads_dim, torch.float32, torch.device(device))
        states = StateCache.for_model(model, 3, device)
        done = [0, 0, 0]
        tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
        logits = []
        for step in schedule:
            ids, pos, smap, qsl, lens = [], [], [], [0], []
            for i, n in step:
                ids += seqs[i][done[i]:done[i] + n]
                for p in range(done[i], done[i] + n):
                    pos.append(p)
                    smap.append(tables[i][p // bs] * bs + p % bs)
                qsl.append(qsl[-1] + n)
                lens.append(done[i] + n)
            meta = AttentionMetadata(
                num_tokens=len(ids), query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
                seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
                block_tables=torch.tensor([tables[i] for i, _ in step], dtype=torch.int32, device=device),
                slot_mapping=torch.tensor(smap, device=device), max_query_len=max(n for _, n in step),
                max_seq_len=max(lens), query_start_loc_cpu=qsl, seq_lens_cpu=lens)
            ctx = ForwardContext(meta=meta, kv_caches=kv, backend=TorchReferenceBackend(),
                                 extra={"state_cache": states, "state_slots": [i for i, _ in step]})
            with torch.no_grad():
                logits.append(model.compute_logits(model(torch.tensor(ids, device=device),
                                                         torch.tensor(pos, device=device), ctx)))
            for i, n in step:
                done[i] += n
        return torch.cat(logits)

    from voltllm.kernels import moe_decode

    small = moe_decode.fused_experts_small
    try:
        ref = run(False)
        # the few-token MoE path with wider tiles than its default (2 / 4 columns a program): 4x fewer interpreted
        # programs (it was 70% of this check's time); the default tiles have their own checks (_moe_interp_check.py)
        moe_decode.fused_experts_small = functools.partial(small, tiles=(8, 16, 2, 1024))
        got = run(True)
    finally:
        moe_decode.fused_experts_small = small
        GatedDeltaNet.triton_prefill = GatedDeltaNet.triton_decode = GatedDeltaNet.triton_conv = None
        GatedDeltaNet.triton_norm = None
        SparseMoE.triton_experts = None
        GatedAttention.triton_gate = None
    err = (got - ref).abs().max().item()
    if err > 1e-4 * max(1.0, ref.abs().max().item()) or ref.std() < 1e-3:
        return f"FAIL max err {err:.3e} (ref std {ref.std():.2e})"
    return f"ok max err {err:.2e}"


CHECKS = {
    "one_seq_150_f32_d16": lambda d: run_varlen(d, [150], 1, 2, 16, 16, torch.float32, 0),
    "varlen_f32_d32_r2": lambda d: run_varlen(d, [64, 1, 130, 7, 65], 2, 4, 32, 32, torch.float32, 1),
    "varlen_f32_dk24_dv40_masked": lambda d: run_varlen(d, [20, 90], 1, 3, 24, 40, torch.float32, 2),
    "varlen_f32_fast_decay": lambda d: run_varlen(d, [100, 33], 2, 2, 16, 16, torch.float32, 3, decay=8.0),
    "varlen_f32_block_v16": lambda d: run_varlen(d, [77, 12], 1, 2, 16, 48, torch.float32, 4, block_v=16),
    "repeated_keys_f32": lambda d: run_varlen(d, [128], 1, 1, 16, 16, torch.float32, 5, decay=0.01,
                                              repeat_keys=True),
    "all_initial_state_f16": lambda d: run_varlen(d, [66, 3], 2, 4, 32, 32, torch.float16, 6, init_every=1),
    # the tensor-core tiles (gdn_chunk.TILES); on a GPU with tensor cores, tf32 / 3xTF32 products
    "tf32_tile_f16": lambda d: run_varlen(d, [150, 9, 64, 1], 2, 4, 32, 64, torch.float16, 7, precision="tf32"),
    "tf32_tile_bf16_dk128": lambda d: run_varlen(d, [130, 70], 1, 3, 128, 128, torch.bfloat16, 8,
                                                 precision="tf32"),
    "tf32x3_tile_f16": lambda d: run_varlen(d, [150, 9, 64, 1], 2, 4, 32, 64, torch.float16, 9, precision="tf32x3"),
    "tf32x3_tile_f16_dk128": lambda d: run_varlen(d, [200, 33, 1], 1, 3, 128, 128, torch.float16, 10,
                                                  precision="tf32x3"),
    # the HOIST form (U's S-independent parts and Q K^T from a third kernel)
    "hoist_varlen_f32_d32_r2": lambda d: run_varlen(d, [64, 1, 130, 7, 65], 2, 4, 32, 32, torch.float32, 1,
                                                    hoist=True),
    "hoist_f32_dk24_dv40_masked": lambda d: run_varlen(d, [20, 90], 1, 3, 24, 40, torch.float32, 2, hoist=True),
    "hoist_repeated_keys_f32": lambda d: run_varlen(d, [128], 1, 1, 16, 16, torch.float32, 5, decay=0.01,
                                                    repeat_keys=True, hoist=True),
    "hoist_tf32x3_f16_dk128": lambda d: run_varlen(d, [200, 33, 1], 1, 3, 128, 128, torch.float16, 10,
                                                   precision="tf32x3", hoist=True),
    # the prep / hoist kernels' dots by pieces of the key / value dimension (the tiles for 64-99 KB of shared memory)
    "hoist_split2_f32_dk24_dv40_masked": lambda d: run_varlen(d, [20, 90], 1, 3, 24, 40, torch.float32, 2,
                                                              hoist=True, split=2),
    "hoist_split4_f16_d64_r2": lambda d: run_varlen(d, [64, 1, 130, 7], 2, 4, 64, 64, torch.float16, 15, hoist=True,
                                                    split=4),
    "split2_no_hoist_f32_d32": lambda d: run_varlen(d, [100, 33], 2, 2, 32, 32, torch.float32, 16, hoist=False,
                                                    split=2),
    "smem_fallback": lambda d: run_smem_fallback(d),
    "layer_prefill_f32": lambda d: run_layer(d),
    "layer_mixed_decode_rows_f32": lambda d: run_layer_mixed(d),
    "model_qwen3_next_all_triton_f32": lambda d: run_model(d),
}



def main(device: str = "cpu") -> int:
    patch_interpreter_index()
    return run_checks(CHECKS, device, set(sys.argv[2:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
