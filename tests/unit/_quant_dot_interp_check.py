"""Run under TRITON_INTERPRET=1 (test_quant_dot.py): the tiled dequant-GEMM (kernels/quant_dot.py) against the torch
reference (gguf_planes.dequantize_planes) for every kept GGUF kind, the AWQ / GPTQ int4 kinds, 8-bit GPTQ's int8 kinds,
FP8, NVFP4 and bitsandbytes' NF4 / FP4, with row and
group tails, two row blocks, a bias and an output that is a column slice of a wider tensor; and its SORTED (MoE)
mode over experts stacked in one weight, routed pairs sorted by kernels/moe.moe_align. Prints `CHECK name ok|FAIL
detail` lines."""
import sys

import torch
from _quant_gemv_interp_check import INT4_KINDS, _int4_planes, rel
from interp_util import patch_interpreter_index

patch_interpreter_index()
from voltllm.kernels.moe import moe_align  # noqa: E402
from voltllm.kernels.quant_dot import quant_dot, quant_moe_dot  # noqa: E402
from voltllm.model.layers.gguf_planes import KINDS, dequantize_planes, planes_from_blocks, random_blocks  # noqa: E402

KIND_NAMES = list(KINDS) + [k.name for k in INT4_KINDS]
CHECKS = [f"{name}-rows20" for name in KIND_NAMES] + ["fp32-rows5", "split3-Q6_K", "split2-AWQ-bias",
                                                     "wfirst-split2-AWQ-bias", "wfirst-rows20", "MOE-sorted",
                                                     "MOE-sorted-Q3_K", "MOE-sorted-IQ4_XS", "MOE-sorted-INT8_G128_ZP",
                                                     "MOE-sorted-BNB_NF4_B64"]


def _planes(name, n, k, gen):
    if name in KINDS:
        return planes_from_blocks(random_blocks(name, n, k, gen), name, k)
    return _int4_planes(next(kind for kind in INT4_KINDS if kind.name == name), n, k, gen)


def _check(name, label, p, x, bias, config=None, split=None) -> bool:
    n = p.n
    wide = torch.full((x.shape[0], n + 8), float("nan"), dtype=x.dtype)
    out = quant_dot(x, p, bias, out=wide[:, 4:4 + n], config=config, split=split)
    ref = x.float() @ dequantize_planes(p).T + (0 if bias is None else bias.float())
    err = rel(out, ref)
    ok = err < 2e-3 and not torch.isnan(out).any() and torch.isnan(wide[:, :4]).all() and \
        torch.isnan(wide[:, 4 + n:]).all()
    print(f"CHECK {label} {'ok' if ok else 'FAIL'} rel {err:.2e}", flush=True)
    return ok


def main() -> int:
    gen = torch.Generator().manual_seed(2)
    torch.manual_seed(0)
    failed = 0
    for i, name in enumerate(KIND_NAMES):
        kind = KINDS.get(name) or next(k for k in INT4_KINDS if k.name == name)
        k = 768 if kind.block in (256, 128) else 576  # 576: 9 groups of 64 (a unit tail for U = 4)
        p = _planes(name, 37, k, gen)  # 37: a row tail for BLOCK_N 32
        x = torch.randn(20, k, dtype=torch.float16)  # two row blocks of 16
        bias = torch.randn(37, dtype=torch.float16) if i % 2 else None
        failed += not _check(name, f"{name}-rows20", p, x, bias, config=(16, 32, 4, 4, 1))
    p = _planes("Q4_K", 24, 512, gen)  # fp32 activations: the tile is not rounded to half precision
    failed += not _check("Q4_K", "fp32-rows5", p, torch.randn(5, 512), None)
    # split K: partial sums over uneven parts (1,280 inputs = 40 units, 3 parts of 16 / 16 / 8 at U = 4)
    p = _planes("Q6_K", 37, 1280, gen)
    failed += not _check("Q6_K", "split3-Q6_K", p, torch.randn(7, 1280, dtype=torch.float16), None,
                         config=(16, 32, 4, 4, 1), split=3)
    p = _planes(INT4_KINDS[1].name, 37, 768, gen)
    failed += not _check("AWQ", "split2-AWQ-bias", p, torch.randn(9, 768, dtype=torch.float16),
                         torch.randn(37, dtype=torch.float16), config=(16, 32, 2, 4, 1), split=2)
    # the transposed form (W x^T): bias and split K through it, a row tail and a weight-row tail
    failed += not _check("AWQ", "wfirst-split2-AWQ-bias", p, torch.randn(9, 768, dtype=torch.float16),
                         torch.randn(37, dtype=torch.float16), config=(16, 32, 2, 4, 1, True), split=2)
    p = _planes("Q4_K", 37, 768, gen)
    failed += not _check("Q4_K", "wfirst-rows20", p, torch.randn(20, 768, dtype=torch.float16), None,
                         config=(16, 32, 4, 4, 1, True))
    failed += not _check_moe_sorted(gen)
    failed += not _check_moe_sorted(gen, "Q3_K")  # GGUF low-bit experts (a Q2_K / Q3_K_M file's)
    failed += not _check_moe_sorted(gen, "IQ4_XS")
    failed += not _check_moe_sorted(gen, "INT8_G128_ZP")  # 8-bit GPTQ experts
    failed += not _check_moe_sorted(gen, "BNB_NF4_B64")  # bitsandbytes experts
    return 1 if failed else 0


def _check_moe_sorted(gen, gguf_kind: str = "") -> bool:
    """7 tokens routed to 2 of 4 experts of 40 rows (one expert gets none): the gate_up form (x rows pair // 2) and
    the weighted down form (the pairs' own rows), against each pair's row times its expert's dequantized block.
    gguf_kind: a GGUF kind's name or one of INT4_KINDS' (default: AWQ g128)."""
    kind, e, rows, k, t, top_k = INT4_KINDS[1], 4, 40, 256, 7, 2
    p = _planes(gguf_kind, e * rows, k, gen) if gguf_kind else _int4_planes(kind, e * rows, k, gen)
    w = dequantize_planes(p)
    x = torch.randn(t, k, dtype=torch.float16)
    ids = torch.tensor([[0, 2], [2, 0], [1, 2], [0, 1], [2, 0], [1, 0], [2, 1]], dtype=torch.int32)
    weights = torch.rand(t * top_k)
    sorted_ids, block_expert, num_padded = moe_align(ids, e, 16)
    pairs = t * top_k
    out = quant_moe_dot(x, p, rows, sorted_ids, block_expert, num_padded, pairs, top_k, 16,
                        out=torch.full((pairs, rows), float("nan"), dtype=torch.float16))
    flat = ids.reshape(-1).tolist()
    ref = torch.stack([x[q // top_k].float() @ w[ex * rows:(ex + 1) * rows].T for q, ex in enumerate(flat)])
    err = rel(out, ref)
    xp = torch.randn(pairs, k, dtype=torch.float16)  # the down form: each pair's own row, weighted
    out2 = quant_moe_dot(xp, p, rows, sorted_ids, block_expert, num_padded, pairs, 1, 16, row_weights=weights,
                         split=2)  # and K in two parts
    ref2 = torch.stack([weights[q] * (xp[q].float() @ w[ex * rows:(ex + 1) * rows].T) for q, ex in enumerate(flat)])
    err2 = rel(out2, ref2)
    # the transposed form with a tile wider than an expert's 40 rows (the tail masked per expert block)
    out3 = quant_moe_dot(xp, p, rows, sorted_ids, block_expert, num_padded, pairs, 1, 16, row_weights=weights,
                         tile=(64, 4, 4, 1, True), out=torch.full((pairs, rows), float("nan"), dtype=torch.float16))
    err3 = rel(out3, ref2)
    ok = err < 2e-3 and err2 < 2e-3 and err3 < 2e-3 and not torch.isnan(out).any() and not torch.isnan(out3).any()
    name = "MOE-sorted" + (f"-{gguf_kind}" if gguf_kind else "")
    print(f"CHECK {name} {'ok' if ok else 'FAIL'} rel {err:.2e} / weighted {err2:.2e} / transposed {err3:.2e}",
          flush=True)
    return ok


if __name__ == "__main__":
    sys.exit(main())
