"""Does programmatic dependent launch (PDL, sm_90+) shorten a chain of skinny GEMMs? (GPU only, experiment.)

    PYTHONPATH=$PWD python3 benchmarks/micro/pdl_gemv_chain.py

Batch-1 decode is ~145 GEMVs per step (qwen3-8b: qkv, o, gate_up, down x 36 layers + lm_head) plus norms,
RoPE and attention; in the profile the GEMVs take ~12% longer inside the step's graph than the start-up
tuner measures them alone, and the GPU idles ~1 us between graph nodes. With PDL a kernel may launch while
its predecessor's last wave runs and waits (griddepcontrol.wait) before touching its inputs, which hides
the launch and CTA ramp. This replays the 8B GEMV chain (its own weights per layer, 15 GB, each layer's
output feeding the next) from a CUDA graph three ways: plain launches; each kernel waiting first and then
letting its dependents launch; and letting them launch at its end. Prints us per chain and the read rate.
The production kernels are unchanged; this only decides whether PDL is worth wiring into them.
"""
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from voltllm.kernels.gemv import _gemv_kernel

# qwen3-8b shapes with the tiles the start-up tuner chose on the H200 (session 4 logs)
LAYER = [((6144, 4096), (4, 512, 2, 3), False), ((4096, 4096), (4, 1024, 4, 1), False),
         ((24576, 4096), (4, 1024, 4, 1), False), ((4096, 12288), (4, 1024, 4, 1), True)]
LM_HEAD = ((151936, 4096), (4, 512, 2, 3), False)
LAYERS = 36


@triton.jit
def _gemv_pdl(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
              EVEN: tl.constexpr, SILU_MUL: tl.constexpr, EARLY: tl.constexpr):
    gdc_wait()  # the predecessor's writes are visible after this
    if EARLY:
        gdc_launch_dependents()
    _gemv_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym, BLOCK_M, BLOCK_N, BLOCK_K, HAS_BIAS, EVEN,
                 SILU_MUL)
    if not EARLY:
        gdc_launch_dependents()


def launch(mode, x, w, out, cfg, silu):
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    block_n, block_k, warps, stages = cfg
    block_k = max(16, min(block_k, triton.next_power_of_2(k)))
    args = (x, w, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0))
    meta = dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=False,
                EVEN=n % block_n == 0 and k % block_k == 0, SILU_MUL=silu, num_warps=warps, num_stages=stages)
    grid = (triton.cdiv(n, block_n),)
    if mode == "plain":
        _gemv_kernel[grid](*args, **meta)
    else:
        _gemv_pdl[grid](*args, **meta, EARLY=mode == "pdl-early", launch_pdl=True)


def main():
    torch.manual_seed(0)
    dev = "cuda"
    layers = [[torch.randn(n, k, dtype=torch.float16, device=dev) * 0.02 for (n, k), _, _ in LAYER]
              for _ in range(LAYERS)]
    lm_head = torch.randn(*LM_HEAD[0], dtype=torch.float16, device=dev) * 0.02
    total_bytes = sum(w.numel() * 2 for ws in layers for w in ws) + lm_head.numel() * 2
    h = torch.randn(1, 4096, dtype=torch.float16, device=dev)
    qkv = torch.empty(1, 6144, dtype=torch.float16, device=dev)
    o = torch.empty(1, 4096, dtype=torch.float16, device=dev)
    gu = torch.empty(1, 24576, dtype=torch.float16, device=dev)
    logits = torch.empty(1, 151936, dtype=torch.float16, device=dev)

    def chain(mode):
        for ws in layers:
            launch(mode, h, ws[0], qkv, LAYER[0][1], False)
            launch(mode, qkv[:, :4096], ws[1], o, LAYER[1][1], False)
            launch(mode, o, ws[2], gu, LAYER[2][1], False)
            launch(mode, gu, ws[3], h, LAYER[3][1], True)  # the next layer's input
        launch(mode, h, lm_head, logits, LM_HEAD[1], False)

    results = {}
    start = h.clone()
    for mode in ("plain", "pdl-early", "pdl-late"):
        h.copy_(start)
        chain(mode)  # compile
        torch.cuda.synchronize()
        h.copy_(start)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chain(mode)
        h.copy_(start)
        g.replay()
        torch.cuda.synchronize()
        results[mode] = logits.float().clone()
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        reps = 10
        s.record()
        for _ in range(reps):
            g.replay()
        e.record()
        e.synchronize()
        us = s.elapsed_time(e) / reps * 1e3
        print(f"{mode:>10}: {us:8.1f} us per chain of {4 * LAYERS + 1} GEMVs, {total_bytes / us / 1e6:5.2f} TB/s")
    for mode in ("pdl-early", "pdl-late"):  # same inputs, same kernels: the same bits
        print(f"{mode} equals plain: {torch.equal(results[mode], results['plain'])}")


if __name__ == "__main__":
    main()
