"""The 8B decode step's GEMM chain at 64 rows with the RMSNorms folded into the GEMMs, against the production chain.

Production (A): add + RMSNorm launch -> qkv -> o_proj -> add + RMSNorm launch -> gated gate_up -> down, per layer.
Folded (B): qkv with the input norm inside (sum of squares over its K loop, rsqrt in the epilogue) -> o_proj adding
into the fp32 residual in its epilogue (and writing the rounded rows the next GEMM reads) -> gated gate_up with the
post-attention norm inside -> down adding into the residual. Two launches fewer per layer (72 per 8B step).
Attention and RoPE are left out (the same in both). 36 layers, each with its own weights (a cold L2, as in the
engine), replayed from a CUDA graph with PDL on, median of 5 replays. Each GEMM role's tile is the fastest of the
TMA candidates (and cuBLAS for A's qkv, production's choice at 64 rows), timed as a 36-call chain first.
Forms C and D fold the norm weight into the GEMM weight at load (W * g); D takes each row's sum of squares from
the producer's per-tile partials instead of from x in the consumer's K loop. Also checks that each form's final
residual matches A's.

    python3 benchmarks/micro/norm_fold_chain.py [rows]
"""
import sys

import torch
import torch.nn.functional as F

from graph_timing import graph_median_us  # (beside this script)
from voltllm.kernels import pdl
from voltllm.kernels.batch_gemm import TMA_CONFIGS, FoldedNorm, batch_gemm
from voltllm.kernels.fused import fused_add_rms_norm

LAYERS, H, QKV, INTER, EPS = 36, 4096, 6144, 12288, 1e-6


def main(rows: int) -> None:
    pdl.configure(True)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    mk = lambda n, k: (torch.randn(n, k, device=dev, dtype=torch.float16) / k ** 0.5)  # noqa: E731
    layers = [dict(qkv=mk(QKV, H), o=mk(H, H) * 0.5, gu=mk(2 * INTER, H), d=mk(H, INTER) * 0.5,
                   g1=1 + 0.2 * torch.randn(H, device=dev), g2=1 + 0.2 * torch.randn(H, device=dev))
              for _ in range(LAYERS)]
    for lay in layers:
        lay["n1"], lay["n2"] = FoldedNorm(lay["g1"], EPS), FoldedNorm(lay["g2"], EPS)
        lay["g1h"], lay["g2h"] = lay["g1"].half(), lay["g2"].half()
        # the weight-folded form: W * g once at load, the kernel keeps only the sum of squares (scale 1)
        lay["qkv_w"], lay["gu_w"] = (lay["qkv"] * lay["g1h"]).contiguous(), (lay["gu"] * lay["g2h"]).contiguous()
        lay["n1w"], lay["n2w"] = FoldedNorm(torch.ones(H, device=dev), EPS), FoldedNorm(torch.ones(H, device=dev), EPS)
        lay["n1w"].in_weight = lay["n2w"].in_weight = True
    x0 = torch.randn(rows, H, device=dev)
    res = torch.empty(rows, H, device=dev)
    d = torch.empty(rows, H, device=dev, dtype=torch.float16)
    x16 = torch.empty(rows, H, device=dev, dtype=torch.float16)

    def role_us(fn) -> float:
        return graph_median_us(lambda: [fn(lay) for lay in layers], LAYERS)

    def best(name, candidates, call):
        times = []
        for cfg in candidates:
            try:
                times.append((role_us(lambda lay, c=cfg: call(lay, c)), cfg))
            except Exception as e:  # a tile that does not fit this form
                print(f"  {name} {cfg}: {type(e).__name__}: {str(e)[:80]}")
        times.sort(key=lambda t: t[0])
        print(f"{name:12s} " + "  ".join(f"{t:.2f} {c}" for t, c in times[:3]))
        return times[0][1]

    h = torch.randn(rows, H, device=dev, dtype=torch.float16)
    qkv_out = torch.empty(rows, QKV, device=dev, dtype=torch.float16)
    act = torch.randn(rows, INTER, device=dev, dtype=torch.float16)
    resw = torch.zeros(rows, H, device=dev)
    cands = list(TMA_CONFIGS)
    ss = torch.rand(64 * 256, device=dev)  # per-tile sums of squares (form D), any values for the tile timings
    cfg = {}
    cfg["qkv"] = best("qkv", [None] + cands, lambda lay, c: F.linear(h, lay["qkv"]) if c is None
                      else batch_gemm(h, lay["qkv"], config=c, out=qkv_out))
    cfg["qkv_n"] = best("qkv+norm", cands, lambda lay, c: batch_gemm(h, lay["qkv"], config=c, out=qkv_out,
                                                                     norm=lay["n1"]))
    cfg["qkv_w"] = best("qkv+norm(W)", cands, lambda lay, c: batch_gemm(h, lay["qkv_w"], config=c, out=qkv_out,
                                                                        norm=lay["n1w"]))
    cfg["qkv_p"] = best("qkv+norm(P)", cands, lambda lay, c: batch_gemm(h, lay["qkv_w"], config=c, out=qkv_out,
                                                                        norm=lay["n1w"], sumsq_in=(ss, 128)))
    cfg["o"] = best("o", cands, lambda lay, c: batch_gemm(qkv_out[:, :H], lay["o"], config=c, out=d))
    cfg["o_r"] = best("o+res", cands, lambda lay, c: batch_gemm(qkv_out[:, :H], lay["o"], config=c, out=x16,
                                                                residual=resw))
    cfg["o_s"] = best("o+res+ss", cands, lambda lay, c: batch_gemm(qkv_out[:, :H], lay["o"], config=c, out=x16,
                                                                   residual=resw, sumsq_out=ss))
    gated = [c for c in cands if c[4] == 1]
    cfg["gu"] = best("gate_up", gated, lambda lay, c: batch_gemm(h, lay["gu"], config=c, out=act, gated=True))
    cfg["gu_n"] = best("gate_up+norm", gated, lambda lay, c: batch_gemm(h, lay["gu"], config=c, out=act, gated=True,
                                                                         norm=lay["n2"]))
    cfg["gu_w"] = best("gate_up+n(W)", gated, lambda lay, c: batch_gemm(h, lay["gu_w"], config=c, out=act,
                                                                         gated=True, norm=lay["n2w"]))
    cfg["gu_p"] = best("gate_up+n(P)", gated, lambda lay, c: batch_gemm(h, lay["gu_w"], config=c, out=act,
                                                                         gated=True, norm=lay["n2w"],
                                                                         sumsq_in=(ss, 128)))
    cfg["d"] = best("down", cands, lambda lay, c: batch_gemm(act, lay["d"], config=c, out=d))
    cfg["d_s"] = best("down+res+ss", cands, lambda lay, c: batch_gemm(act, lay["d"], config=c, out=x16, residual=resw,
                                                                      sumsq_out=ss))
    cfg["d_r"] = best("down+res", cands, lambda lay, c: batch_gemm(act, lay["d"], config=c, out=x16, residual=resw))

    def qkv_prod(lay, x):
        return F.linear(x, lay["qkv"]) if cfg["qkv"] is None else batch_gemm(x, lay["qkv"], config=cfg["qkv"],
                                                                             out=qkv_out)

    def chain_a():
        res.copy_(x0)
        hh = torch.empty(rows, H, device=dev, dtype=torch.float16)
        d.zero_()
        for lay in layers:
            fused_add_rms_norm(d, res, lay["g1h"], EPS, out=hh)
            q = qkv_prod(lay, hh)
            o = batch_gemm(q[:, :H], lay["o"], config=cfg["o"], out=d)
            fused_add_rms_norm(o, res, lay["g2h"], EPS, out=hh)
            a = batch_gemm(hh, lay["gu"], config=cfg["gu"], out=act, gated=True)
            batch_gemm(a, lay["d"], config=cfg["d"], out=d)
        res.add_(d)

    def chain_in_loop(w: str, n: str, c: str):  # the sums of squares in the consumers' K loops: B ("", "", "_n"), C
        def chain():
            res.copy_(x0)
            x16.copy_(x0)
            for lay in layers:
                q = batch_gemm(x16, lay["qkv" + w], config=cfg["qkv" + c], out=qkv_out, norm=lay["n1" + n])
                batch_gemm(q[:, :H], lay["o"], config=cfg["o_r"], out=x16, residual=res)
                a = batch_gemm(x16, lay["gu" + w], config=cfg["gu" + c], out=act, gated=True, norm=lay["n2" + n])
                batch_gemm(a, lay["d"], config=cfg["d_r"], out=x16, residual=res)
        return chain

    chain_b = chain_in_loop("", "", "_n")
    chain_c = chain_in_loop("_w", "w", "_w")  # B with the norm weights folded into the weights

    def chain_d():  # C with the sums of squares from the producers' per-tile partials (layer 0's from its x)
        res.copy_(x0)
        x16.copy_(x0)
        parts = None
        for lay in layers:
            q = batch_gemm(x16, lay["qkv_w"], config=cfg["qkv_p"] if parts else cfg["qkv_w"], out=qkv_out,
                           norm=lay["n1w"], sumsq_in=parts)
            batch_gemm(q[:, :H], lay["o"], config=cfg["o_s"], out=x16, residual=res, sumsq_out=ss)
            parts = (ss, -(-H // cfg["o_s"][0]))
            a = batch_gemm(x16, lay["gu_w"], config=cfg["gu_p"], out=act, gated=True, norm=lay["n2w"], sumsq_in=parts)
            batch_gemm(a, lay["d"], config=cfg["d_s"], out=x16, residual=res, sumsq_out=ss)
            parts = (ss, -(-H // cfg["d_s"][0]))

    chain_a()
    ref = res.clone()
    for name, chain in (("B", chain_b), ("C", chain_c), ("D", chain_d)):
        chain()
        err = ((res - ref).norm() / ref.norm()).item()
        print(f"final residual, {name} vs production: relative error {err:.2e}")
    ta = [graph_median_us(chain_a, LAYERS) for _ in range(3)]
    tb = [graph_median_us(chain_b, LAYERS) for _ in range(3)]
    tc = [graph_median_us(chain_c, LAYERS) for _ in range(3)]
    td = [graph_median_us(chain_d, LAYERS) for _ in range(3)]
    print(f"tiles: {cfg}")
    print(f"{'form':34s} {'us/layer (3 graphs)':26s} {'us/step (x36)':>14s}")
    for name, t in (("A production (2 norm launches)", ta), ("B norms folded (x * g in the loop)", tb),
                    ("C norms folded (W * g at load)", tc), ("D as C, sums of squares from partials", td)):
        print(f"{name:34s} {' '.join(f'{v:7.2f}' for v in t):26s} {min(t) * LAYERS:14.0f}")
    print(f"B / C / D save {(min(ta) - min(tb)) * LAYERS:.0f} / {(min(ta) - min(tc)) * LAYERS:.0f} / "
          f"{(min(ta) - min(td)) * LAYERS:.0f} us per 8B step at {rows} rows")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 64)
