"""Checks of the Triton GDN prefill conv1d (voltllm.kernels.gdn_conv) against voltllm.kernels.gdn_ref.

Run as a script under TRITON_INTERPRET=1 by tests/unit/test_gdn_conv_interp.py, or on a GPU by
tests/gpu/test_gdn_conv.py (device argument); prints one line per check:
    CHECK <name> <ok|FAIL> <detail>
"""
from __future__ import annotations

import sys

import torch

from voltllm.kernels import gdn_ref as R

# requests: empty, one row (a decode row in a mixed step), fewer rows than the state (K-1), several tiles
MIXED = [0, 0, 1, 3, 9, 139, 140]


def run_conv(device: str, qsl: list[int], c: int, kw: int, dtype: torch.dtype, bias: bool, seed: int,
             pad_rows: int = 0, row_stride_extra: int = 0, block_t: int = 64) -> str:
    from voltllm.kernels.gdn_conv import causal_conv1d_prefill, conv_tiles

    g = torch.Generator().manual_seed(seed)
    n, t = len(qsl) - 1, qsl[-1] + pad_rows
    wide = torch.randn(t, c + row_stride_extra, generator=g).to(device, dtype)
    x = wide[:, row_stride_extra:]  # rows strided like a slice of the in-projection's output
    w = torch.randn(c, kw, generator=g).to(device, dtype)
    b = torch.randn(c, generator=g).to(device, dtype) if bias else None
    num_slots = n + 3
    pool = torch.randn(num_slots, kw - 1, c, generator=g).to(device, dtype)
    slots = torch.randperm(num_slots, generator=g)[:n].to(device)
    init = (torch.arange(n) % 3 != 1).to(device)
    # the reference in fp32 on the same values: the kernel accumulates in fp32 and rounds its output once
    ref_pool = pool.to(torch.float32, copy=True)
    ref = R.causal_conv1d_varlen(x.float(), w.float(), None if b is None else b.float(), ref_pool, slots, qsl, init)
    out = causal_conv1d_prefill(x, w, b, pool, slots, qsl, init, tiles=conv_tiles(qsl, init, block_t))
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    err_o = (out.float() - ref.float()).abs().max().item()
    err_s = (pool.float() - ref_pool.float()).abs().max().item()
    if not torch.isfinite(out).all() or err_o > tol * max(1.0, ref.float().abs().max().item()) or err_s > 0:
        return f"FAIL out err {err_o:.3e} state err {err_s:.3e}"
    return f"ok out err {err_o:.2e}"


def run_layer(device: str) -> str:
    """A GatedDeltaNet layer's prefill + mixed steps with the Triton conv == with the torch conv (same state)."""
    from tiny_models import tiny_gdn_layer
    from voltllm.model.layers.gdn import HybridBatch
    from voltllm.model.state_cache import StateCache

    layer = tiny_gdn_layer(device)
    layer.triton_prefill = False  # the delta rule through the torch form on both sides
    results = []
    for triton_on in (False, True):
        layer.triton_conv = triton_on
        cache = StateCache(1, 4, layer.conv_state_shape, layer.ssm_state_shape, torch.float32, device)
        outs = []
        # step 1: two prompts from scratch; step 2: one continues with 1 row, the other with 2, a third starts
        for qsl, slots, init in (([0, 7, 12], [3, 0], [False, False]), ([0, 1, 3, 8], [3, 0, 2], [True, True, False])):
            x = torch.randn(qsl[-1], 32, generator=torch.Generator().manual_seed(len(outs))).to(device)
            batch = HybridBatch(cache, torch.tensor(slots, device=device), torch.tensor(init, device=device), qsl,
                                False)
            outs.append(layer(x, batch))
        results.append((torch.cat(outs), cache.conv[0].clone(), cache.ssm[0].clone()))
    layer.triton_conv = layer.triton_prefill = None
    errs = [(a - b).abs().max().item() for a, b in zip(*results)]
    if max(errs) > 1e-4:
        return f"FAIL out / conv / ssm err {errs}"
    return f"ok out err {errs[0]:.2e}"


CHECKS = {
    "conv_f32_mixed_k4": lambda d: run_conv(d, MIXED, 100, 4, torch.float32, False, 0),
    "conv_f32_mixed_k4_tile16_padded": lambda d: run_conv(d, MIXED, 100, 4, torch.float32, False, 1, pad_rows=5,
                                                          block_t=16),
    "conv_f16_mixed_k4_bias_strided": lambda d: run_conv(d, MIXED, 300, 4, torch.float16, True, 2,
                                                         row_stride_extra=40),
    "conv_f32_k2": lambda d: run_conv(d, [0, 1, 5, 70], 64, 2, torch.float32, False, 3),
    "conv_f32_k3_one_request": lambda d: run_conv(d, [0, 200], 129, 3, torch.float32, False, 4),
    "conv_f32_no_tokens": lambda d: run_conv(d, [0, 0, 0], 32, 4, torch.float32, False, 5, pad_rows=2),
    "layer_prefill_triton_conv_vs_ref": run_layer,
}


def main(device: str = "cpu") -> int:
    from interp_util import run_checks

    return run_checks(CHECKS, device)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
