"""The DFlash2 selector walk's Triton kernel (voltllm.kernels.dflash2_select.walk) against walk_torch, on fresh
random inputs; run under TRITON_INTERPRET=1 by tests/unit/test_dflash2_kernels.py, or imported by
tests/gpu/test_dflash2_kernels_cuda.py with a CUDA device. Prints `CHECK <name> <ok|FAIL> <detail>` per case."""
from __future__ import annotations

import sys

import torch

from interp_util import patch_interpreter_index


def cases(device: str):
    """(name, cand, unary, proj, pred_cb, succ_cb, anchors): candidates sorted by logit per row as torch.topk gives
    them; the public drafter's sizes (top 16, rank 256), odd ones (top 5, rank 6: masked lanes), one block, 64."""
    g = torch.Generator().manual_seed(11)
    for dt in (torch.float32, torch.float16) + ((torch.bfloat16,) if device != "cpu" else ()):
        for n, kmax, top, rank, vocab in ((1, 7, 16, 256, 5000), (3, 4, 5, 6, 97), (64, 15, 16, 256, 30000),
                                          (2, 1, 1, 3, 11)):
            logits = torch.randn(kmax * n, vocab, generator=g)
            unary, cand = logits.topk(top, dim=-1)
            proj = torch.randn(kmax * n, rank, generator=g)
            pred_cb = (torch.randn(vocab, rank, generator=g) * 0.8).to(dt)
            succ_cb = (torch.randn(vocab, rank, generator=g) * 0.8).to(dt)
            anchors = torch.randint(0, vocab, (n,), generator=g)
            yield f"{str(dt)[6:]}-n{n}-k{kmax}-top{top}-r{rank}", cand, unary, proj, pred_cb, succ_cb, anchors
    # equal scores everywhere (zero codebooks, equal logits): the first candidate, as torch.argmax
    cand = torch.arange(12).view(3, 4)
    yield "ties", cand, torch.zeros(3, 4), torch.ones(3, 2), torch.zeros(20, 2), torch.zeros(20, 2), \
        torch.tensor([5, 6, 7])


def _margin_ok(got, want, cand, unary, proj, pred_cb, succ_cb, anchors) -> bool:
    """A pick may differ from torch's only where the walk up to it agreed and its best two scores are within fp32
    summation noise (then the rest of that block's walk differs legitimately)."""
    if torch.equal(got, want):
        return True
    n = anchors.shape[0]
    for i in range(n):
        pred = int(anchors[i])
        for j in range(want.shape[0]):
            r = j * n + i
            s = unary[r] + (succ_cb[cand[r]].double() * (pred_cb[pred].double() * proj[r].double())).sum(-1)
            if int(got[j, i]) != int(want[j, i]):
                top2 = s.topk(min(2, s.numel())).values
                if top2.numel() < 2 or float(top2[0] - top2[1]) > 1e-4 * float(top2.abs().max() + 1):
                    return False
                break
            pred = int(want[j, i])
    return True


def run(device: str) -> list[tuple[str, bool, str]]:
    from voltllm.kernels.dflash2_select import walk, walk_torch

    out = []
    for name, *args in cases(device):
        want = walk_torch(*args)
        dev_args = [a.to(device) for a in args]
        got = walk(*dev_args).cpu()
        # (ties: every score equal, so the first candidate must win exactly)
        ok = got.shape == want.shape and (torch.equal(got, want) if name == "ties" else _margin_ok(got, want, *args))
        out.append((name, ok, f"got {got[:, :4].tolist()} want {want[:, :4].tolist()}"))
    return out


if __name__ == "__main__":
    patch_interpreter_index()
    for name, ok, detail in run(sys.argv[1] if len(sys.argv) > 1 else "cpu"):
        print(f"CHECK {name} {'ok' if ok else 'FAIL'} {detail[:300]}", flush=True)
