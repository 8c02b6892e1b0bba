"""`voltllm bench --scenario kernels` cases with the real Triton kernels, at tiny shapes, under the Triton CPU
interpreter: the bench calls every kernel entry point with the arguments the layers use, and each agrees with
its reference through the bench's own comparison. Run as a script under TRITON_INTERPRET=1 by
tests/unit/test_bench_kernels.py; prints one line per case:  CHECK <name> <ok|FAIL> <detail>
"""
from __future__ import annotations

import sys
import traceback

import torch

from voltllm.bench.kernel_cases import LayerShapes, Sizes, build_cases

SHAPES = LayerShapes(hidden=64, gdn=(2, 4, 16, 16, 4), moe=(8, 2, 32, True))  # key/value heads 2/4: r = 2
SIZES = Sizes(prefill=((70,), (40, 30)), decode=(1, 3), moe_tokens=(1, 5, 40))


def _cases(device: str):
    return build_cases(SHAPES, torch.float32, torch.device(device), SIZES)[0]


CHECKS = {f"{c.kernel}_{c.label}": i for i, c in enumerate(_cases("cpu"))}


def main(device: str = "cpu") -> int:
    from interp_util import claimed, patch_interpreter_index
    from voltllm.bench.kernel_timings import run_cases

    patch_interpreter_index()
    failed = 0
    for case in claimed(_cases(device), lambda c: f"{c.kernel}_{c.label}"):
        name = f"{case.kernel}_{case.label}"
        try:
            row = run_cases([case], torch.device(device), torch.float32, iters=1, ref_iters=1, warmup=0)[0]
            status = ("ok" if row["ok"] else "FAIL") + f" relerr {row['relerr']:.2e} {row['relerr_parts']}"
            if row["ms"] <= 0 or row["ref_ms"] <= 0:
                status = f"FAIL times {row['ms']} {row['ref_ms']}"
        except Exception as e:  # report and go on
            status = f"FAIL {type(e).__name__}: {e} {traceback.format_exc()[-600:]!r}"
        failed += not status.startswith("ok")
        print(f"CHECK {name} {status}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
