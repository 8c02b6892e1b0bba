"""row_argmax (voltllm.kernels.argmax) against torch.argmax; run under TRITON_INTERPRET=1 by
tests/unit/test_argmax_kernel.py, or imported by tests/gpu/test_argmax_cuda.py with a CUDA device.
Prints `CHECK <name> <ok|FAIL> <detail>` per case."""
from __future__ import annotations

import sys

import torch

from interp_util import patch_interpreter_index


def cases(device: str):
    g = torch.Generator().manual_seed(7)
    for dt in (torch.float16, torch.float32) + ((torch.bfloat16,) if device != "cpu" else ()):
        for rows, vocab in ((1, 151936), (3, 5000), (64, 4097), (2, 17), (5, 4096)):
            yield f"random-{str(dt)[6:]}-{rows}x{vocab}", torch.randn(rows, vocab, generator=g).to(dt)
        x = torch.zeros(6, 9000, dtype=dt)
        x[1, 4096] = x[1, 8000] = x[1, 8500] = 1.0  # ties inside and across chunks: the first wins
        x[2] = float("-inf")  # every token banned: index 0, as torch
        x[3, 5000] = x[3, 7000] = float("nan")  # NaN beats every number: its first index
        x[4, 8999] = float("inf")
        x[5, 100:200] = 3.0  # a tie inside one chunk
        yield f"edges-{str(dt)[6:]}", x
    wide = torch.randn(4, 300, generator=g).to(torch.float16)
    yield "strided-rows", torch.cat([wide, wide], dim=1)[:, :300]


def run(device: str) -> list[tuple[str, bool, str]]:
    from voltllm.kernels.argmax import row_argmax

    out = []
    for name, x in cases(device):
        x = x.to(device)
        got, want = row_argmax(x).cpu(), x.argmax(dim=-1).cpu()
        out.append((name, torch.equal(got, want), f"got {got.tolist()[:6]} want {want.tolist()[:6]}"))
    return out


if __name__ == "__main__":
    patch_interpreter_index()
    for name, ok, detail in run(sys.argv[1] if len(sys.argv) > 1 else "cpu"):
        print(f"CHECK {name} {'ok' if ok else 'FAIL'} {detail}", flush=True)
