"""How much do programmatic dependent launch (PDL) and the L2 weight prefetch before its wait shorten a
batch-1 decode chain? (GPU only, sm_90+; the
experiment behind pdl.PREFETCH_MAX_BYTES.)

    PYTHONPATH=$PWD python3 benchmarks/micro/pdl_gemv_chain.py

Replays, from a CUDA graph, the production kernels of a qwen3-8b batch-1 decode step without attention:
per layer add+RMSNorm, qkv GEMV, a small stand-in kernel (RMSNorm of 4096 values, for RoPE / attention),
o GEMV, add+RMSNorm, gate_up GEMV, down GEMV with the SiLU*mul prologue; 36 layers (own weights, 15 GB)
and the lm_head. Modes: PDL off; PDL on with PREFETCH_K = 0 / 512 / 1024 / 2048 / 4096 weight elements per
row prefetched into L2 before the wait; and PDL on with cuBLAS for qkv (what the start-up tuner picks when
cuBLAS is within 3% alone); and PDL on with the down projection as a SiLU*mul kernel then the plain GEMV
(instead of the activation in the GEMV's prologue), or with gate_up computing the SiLU*mul in its epilogue
(gemv gated=True) and the down projection plain. Prints us per chain, the weight read rate, and checks each mode gives the same
logits as PDL off (same kernels, same inputs: the same bits).
"""
import torch

from voltllm.kernels import pdl
from voltllm.kernels.fused import fused_add_rms_norm, rms_norm, silu_and_mul
from voltllm.kernels.gemv import gemv

# qwen3-8b shapes with the tiles the start-up tuner chose on the H200 (session 5 logs)
QKV, O, GATE_UP, DOWN = (6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)
CFG = {QKV: (4, 512, 2, 3), O: (4, 1024, 4, 1), GATE_UP: (4, 1024, 4, 1), DOWN: (4, 1024, 4, 1),
       (151936, 4096): (4, 512, 2, 3)}
LAYERS = 36
# (name, PDL, prefetch elements per row, cuBLAS qkv, where the SiLU*mul runs: down's prologue, its own kernel, or
# gate_up's epilogue)
MODES = [("pdl off", False, 0, False, "prologue")] \
    + [(f"pdl prefetch {k}", True, k, False, "prologue") for k in (0, 512, 1024, 2048, 4096)] \
    + [("pdl prefetch 1024, cuBLAS qkv", True, 1024, True, "prologue"),
       ("pdl, SiLU kernel + plain down", True, 0, False, "kernel"),
       ("pdl, gated gate_up + plain down", True, 0, False, "gated")]


def main():
    torch.manual_seed(0)
    dev, dt = "cuda", torch.float16
    layers = [{s: torch.randn(*s, dtype=dt, device=dev) * 0.02 for s in (QKV, O, GATE_UP, DOWN)}
              for _ in range(LAYERS)]
    lm_head = torch.randn(151936, 4096, dtype=dt, device=dev) * 0.02
    norm_w = torch.ones(4096, dtype=dt, device=dev)
    total_bytes = sum(w.numel() * 2 for ws in layers for w in ws.values()) + lm_head.numel() * 2
    h0 = torch.randn(1, 4096, dtype=dt, device=dev)
    h, res, x = h0.clone(), torch.zeros_like(h0), torch.empty_like(h0)
    qkv = torch.empty(1, 6144, dtype=dt, device=dev)
    o = torch.empty(1, 4096, dtype=dt, device=dev)
    gu = torch.empty(1, 24576, dtype=dt, device=dev)
    act = torch.empty(1, 12288, dtype=dt, device=dev)
    logits = torch.empty(1, 151936, dtype=dt, device=dev)

    def chain(prefetch, cublas_qkv, silu):
        for ws in layers:
            fused_add_rms_norm(h, res, norm_w, 1e-6, out=x)
            if cublas_qkv:
                torch.matmul(x, ws[QKV].t(), out=qkv)
            else:
                gemv(x, ws[QKV], out=qkv, config=CFG[QKV], prefetch_k=prefetch)
            rms_norm(qkv[:, :4096], norm_w, 1e-6, out=o)  # stand-in for RoPE + attention
            gemv(o, ws[O], out=h, config=CFG[O], prefetch_k=prefetch)
            fused_add_rms_norm(h, res, norm_w, 1e-6, out=x)
            if silu == "gated":
                gemv(x, ws[GATE_UP], out=act, config=CFG[GATE_UP], prefetch_k=prefetch, gated=True)
                gemv(act, ws[DOWN], out=h, config=CFG[DOWN], prefetch_k=prefetch)
                continue
            gemv(x, ws[GATE_UP], out=gu, config=CFG[GATE_UP], prefetch_k=prefetch)
            if silu == "kernel":
                silu_and_mul(gu, out=act)
                gemv(act, ws[DOWN], out=h, config=CFG[DOWN], prefetch_k=prefetch)
            else:
                gemv(gu, ws[DOWN], out=h, config=CFG[DOWN], silu_mul=True, prefetch_k=prefetch)
        fused_add_rms_norm(h, res, norm_w, 1e-6, out=x)
        gemv(x, lm_head, out=logits, config=CFG[(151936, 4096)], prefetch_k=prefetch)

    def reset():
        h.copy_(h0)
        res.zero_()

    results, rows = {}, []
    for name, on, prefetch, cublas_qkv, silu in MODES:
        pdl.configure(on)
        reset()
        chain(prefetch, cublas_qkv, silu)  # compile
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chain(prefetch, cublas_qkv, silu)
        reset()
        g.replay()
        torch.cuda.synchronize()
        results[name] = logits.float().clone()
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        reps = 10
        s.record()
        for _ in range(reps):
            g.replay()
        e.record()
        e.synchronize()
        us = s.elapsed_time(e) / reps * 1e3
        rows.append((name, us, total_bytes / us / 1e6))
        del g
    pdl.configure(False)
    base = results["pdl off"]
    print(f"{'mode':<32} {'us/chain':>9} {'TB/s':>6}  same logits as PDL off")
    for name, us, tbs in rows:
        same = torch.equal(results[name], base) if "cuBLAS" not in name and "plain down" not in name else \
            bool(((results[name] - base).norm() / base.norm()).item() < 1e-2)
        print(f"{name:<32} {us:9.1f} {tbs:6.2f}  {same}")


if __name__ == "__main__":
    main()
