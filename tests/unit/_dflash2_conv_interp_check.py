"""DFlash2's block convolution kernel (voltllm.kernels.dflash2_conv.block_conv) against its torch form
(dflash2_layers.conv_torch over block_taps' masks), on fresh random inputs; run under TRITON_INTERPRET=1 by
tests/unit/test_dflash2_kernels.py, or imported by tests/gpu/test_dflash2_kernels_cuda.py with a CUDA device. Prints
`CHECK <name> <ok|FAIL> <detail>` per case."""
from __future__ import annotations

import sys

import torch

from interp_util import patch_interpreter_index


def _rows(blocks: list[tuple[int, int]], pad: int):
    """positions / context lengths of blocks (start, rows) laid side by side, then `pad` graph padding rows
    (position 0, one token of context)."""
    pos, lens = [], []
    for start, n in blocks:
        pos += list(range(start, start + n))
        lens += [start + n] * n
    return torch.tensor(pos + [0] * pad), torch.tensor(lens + [1] * pad, dtype=torch.int32)


def cases(device: str):
    g = torch.Generator().manual_seed(5)
    # blocks of 1..8 rows, two blocks whose positions continue one another (different context lengths), padding;
    # hidden 40 with groups of 8 (a partial feature tile), 320 with groups of 16 (two tiles)
    layouts = {"mixed": ([(10, 4), (14, 3), (3, 1), (50, 8)], 3), "one": ([(0, 5)], 0), "pad-only": ([], 4)}
    for dt in (torch.float32, torch.float16) + ((torch.bfloat16,) if device != "cpu" else ()):
        for hidden, group, taps in ((40, 8, 2), (320, 16, 2), (64, 16, 3)):
            for name, (blocks, pad) in layouts.items():
                pos, lens = _rows(blocks, pad)
                t = pos.shape[0]
                x = torch.randn(t, hidden, generator=g).to(dt)
                dyn = torch.randn(t, 2, taps, hidden // group, generator=g)[:, 1]  # (a strided slice, as prepare's)
                base = torch.randn(taps, hidden, generator=g).to(dt)
                yield f"{str(dt)[6:]}-h{hidden}-g{group}-taps{taps}-{name}", x, dyn, base, pos, lens, group


def run(device: str) -> list[tuple[str, bool, str]]:
    from voltllm.kernels.dflash2_conv import block_conv
    from voltllm.model.models.dflash2_layers import block_taps, conv_torch

    out = []
    for name, x, dyn, base, pos, lens, group in cases(device):
        want = conv_torch(x, dyn, base, block_taps(pos, lens, dyn.shape[1]), group).float()
        got = block_conv(x.to(device), dyn.to(device), base.to(device), pos.to(device), lens.to(device)).float().cpu()
        err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item() if want.numel() else 0.0
        tol = 1e-5 if x.dtype == torch.float32 else 1e-2
        out.append((name, got.shape == want.shape and err < tol, f"rel err {err:.2e}"))
    return out


if __name__ == "__main__":
    patch_interpreter_index()
    for name, ok, detail in run(sys.argv[1] if len(sys.argv) > 1 else "cpu"):
        print(f"CHECK {name} {'ok' if ok else 'FAIL'} {detail}", flush=True)
