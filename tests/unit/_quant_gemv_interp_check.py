"""Run under TRITON_INTERPRET=1 (test_gguf_planes.py): the GGUF dequant-GEMM (one row; several, over two programs along the rows) and the
dequant-to-fp16 kernel against the torch reference (gguf_planes.dequantize_planes), for every kept GGUF kind, on
random blocks, with row / group tails, a bias and an output that is a column slice of a wider tensor. Prints
`CHECK name ok|FAIL detail` lines."""
import sys

import torch
from interp_util import patch_interpreter_index

patch_interpreter_index()
from voltllm.kernels.quant_gemv import dequantize, quant_matmul  # noqa: E402
from voltllm.model.layers.gguf_planes import KINDS, dequantize_planes, planes_from_blocks, random_blocks  # noqa: E402

CHECKS = [f"{name}-{form}" for name in KINDS for form in ("dequant", "rows1", "rows3", "rows6")]


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main() -> int:
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    failed = 0
    for name, kind in KINDS.items():
        k = 768 if kind.block == 256 else 576  # 576: 9 groups of 64, a tail for G64 = 2 and 4
        n = 37  # a row tail for every BLOCK_N
        p = planes_from_blocks(random_blocks(name, n, k, gen), name, k)
        ref_w = dequantize_planes(p)
        got = dequantize(p, torch.float32, out=torch.full((n, k), float("nan")))
        ok = torch.equal(got, ref_w)
        failed += not ok
        print(f"CHECK {name}-dequant {'ok' if ok else 'FAIL'} max {float((got - ref_w).abs().max()):.3g}")
        for form, m in (("rows1", 1), ("rows3", 3), ("rows6", 6)):  # 6: two programs along the rows
            x = torch.randn(m, k, dtype=torch.float16)
            bias = torch.randn(n, dtype=torch.float16) if m == 3 else None
            wide = torch.full((m, n + 8), float("nan"), dtype=torch.float16)
            out = quant_matmul(x, p, bias, out=wide[:, 4:4 + n])
            ref = x.float() @ ref_w.T + (0 if bias is None else bias.float())
            err = rel(out, ref)
            ok = err < 2e-3 and not torch.isnan(out).any() and torch.isnan(wide[:, :4]).all()
            failed += not ok
            print(f"CHECK {name}-{form} {'ok' if ok else 'FAIL'} rel {err:.2e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
