"""Does a concurrent L2 prefetch of the o_proj weight, run beside the attention of a 64-row decode step, shorten
the step? (GPU only, sm_90+; the experiment behind the side-branch prefetch idea for issue #4.)

    PYTHONPATH=$PWD python3 benchmarks/micro/l2_side_prefetch.py

Replays, from a CUDA graph, a qwen3-8b decode layer at 64 rows x 36 layers (own weights): RMSNorm, qkv (cuBLAS),
a RoPE-sized stand-in, an attention stand-in that streams each layer's own KV-sized buffer (64 x 200 tokens x 8 kv
heads x 128 x K/V fp16 = 52 MB), o (cuBLAS), RMSNorm, gate_up (cuBLAS), SiLU*mul, down (cuBLAS). Variants put a
prefetch kernel for the layer's o weight (33.5 MB, fits the 50 MB L2) on a forked graph branch, from the layer's
start or after qkv, joined before o; with the attention stand-in's loads marked evict_first or not. Prints us
per step and the saving against the plain chain.
"""
import statistics

import torch
import triton
import triton.language as tl

LAYERS, ROWS, HIDDEN = 36, 64, 4096
QKV, O_PROJ, GATE_UP, DOWN = (6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)
KV_BYTES = 64 * 200 * 8 * 128 * 2 * 2
LINE = 128


@triton.jit
def _stream_sum_kernel(src, out, n_per_prog, BLOCK: tl.constexpr, EVICT_FIRST: tl.constexpr):
    """Attention stand-in: each program streams its slice of src (fp16) and writes one sum."""
    pid = tl.program_id(0)
    base = src + pid.to(tl.int64) * n_per_prog
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, n_per_prog, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        if EVICT_FIRST:
            v = tl.load(base + offs, mask=offs < n_per_prog, other=0.0, eviction_policy="evict_first")
        else:
            v = tl.load(base + offs, mask=offs < n_per_prog, other=0.0)
        acc += v.to(tl.float32)
    tl.store(out + pid, tl.sum(acc))


@triton.jit
def _prefetch_kernel(src, n_lines, lines_per_prog, BLOCK: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Ask for lines [pid * lines_per_prog, ...) of src (bytes) to be brought into L2."""
    pid = tl.program_id(0)
    first = pid.to(tl.int64) * lines_per_prog
    for i in range(0, lines_per_prog, BLOCK):
        line = first + i + tl.arange(0, BLOCK)
        line = tl.minimum(line, n_lines - 1)
        ptrs = src + line * 128
        if EVICT_LAST:
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                      dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                      dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _bulk_prefetch_kernel(src, piece_bytes, THREADS: tl.constexpr):
    """Each of THREADS threads per program: one cp.async.bulk.prefetch.L2 of its piece (sm_90)."""
    pid = tl.program_id(0)
    ptrs = src + (pid * THREADS + tl.arange(0, THREADS)).to(tl.int64) * piece_bytes
    size = tl.full([THREADS], 0, tl.int32) + piece_bytes
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                              [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(w: torch.Tensor, progs: int, evict_last: bool, bulk: bool):
    n_bytes = w.numel() * w.element_size()
    if bulk:
        piece = n_bytes // (progs * 32)
        assert piece % 16 == 0 and piece * progs * 32 == n_bytes
        _bulk_prefetch_kernel[(progs,)](w, piece, THREADS=32, num_warps=1)
        return
    n_lines = n_bytes // LINE
    per = triton.cdiv(n_lines, progs)
    _prefetch_kernel[(progs,)](w, n_lines, per, BLOCK=256, EVICT_LAST=evict_last, num_warps=4)


def main():
    torch.manual_seed(0)
    print(f"L2: {torch.cuda.get_device_properties(0).L2_cache_size / 2**20:.0f} MiB")
    dev, dt = "cuda", torch.float16
    layers = [{s: torch.randn(*s, dtype=dt, device=dev) * 0.02 for s in (QKV, O_PROJ, GATE_UP, DOWN)}
              for _ in range(LAYERS)]
    kv = [torch.randn(KV_BYTES // 2, dtype=dt, device=dev) for _ in range(LAYERS)]
    norm_w = torch.ones(HIDDEN, dtype=dt, device=dev)
    x0 = torch.randn(ROWS, HIDDEN, dtype=dt, device=dev)
    attn_out = torch.empty(512, dtype=torch.float32, device=dev)
    side = torch.cuda.Stream()

    def attention(i, evict_first):
        n = kv[i].numel() // 512
        _stream_sum_kernel[(512,)](kv[i], attn_out, n, BLOCK=1024, EVICT_FIRST=evict_first, num_warps=4)

    def step(mode):
        # mode: (fork point None / "start" / "qkv", attention evict_first, prefetch programs, evict_last, bulk)
        fork, evict_first, progs, evict_last, bulk = mode
        x = x0
        for i, w in enumerate(layers):
            main_s = torch.cuda.current_stream()
            if fork == "start":
                side.wait_stream(main_s)
                with torch.cuda.stream(side):
                    prefetch(w[O_PROJ], progs, evict_last, bulk)
            h = torch.nn.functional.rms_norm(x, (HIDDEN,), norm_w)
            qkv = h @ w[QKV].t()
            if fork == "qkv":
                side.wait_stream(main_s)
                with torch.cuda.stream(side):
                    prefetch(w[O_PROJ], progs, evict_last, bulk)
            q = qkv[:, :HIDDEN] * 1.0001  # RoPE-sized stand-in
            attention(i, evict_first)
            q = q + attn_out[:1].to(dt)
            if fork:
                main_s.wait_stream(side)
            x = x + q @ w[O_PROJ].t()
            h = torch.nn.functional.rms_norm(x, (HIDDEN,), norm_w)
            gu = h @ w[GATE_UP].t()
            a = torch.nn.functional.silu(gu[:, :12288]) * gu[:, 12288:]
            x = x + a @ w[DOWN].t()
        return x

    # interleaved: the card's power cap makes later replays slower (a drift of ~3% over this script)
    variants = {"plain": (None, False, 0, False, False), "evict_first attn": (None, True, 0, False, False),
                "fork@start ef=1 bulk 64": ("start", True, 64, False, True),
                "fork@start ef=1 progs=16 evict_last": ("start", True, 16, True, False)}
    modes = [(name, mode) for _ in range(4) for name, mode in variants.items()]
    results: dict[str, list] = {}
    for name, mode in modes:
        def fn(mode=mode):
            return step(mode)
        try:
            fn()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            g.replay()
            torch.cuda.synchronize()
            times = []
            for _ in range(3):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(10):
                    g.replay()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e) * 1e3 / 10)
            results.setdefault(name, []).extend(times)
            del g
        except Exception as exc:  # one failing variant must not hide the others
            results.setdefault(name, [])
            print(f"{name}: failed: {type(exc).__name__}: {exc}"[:300])
    base = statistics.median(results["plain"])
    print(f"\n{'variant (4 interleaved rounds x 3 x 10 replays)':50s} {'median':>8s} {'min':>8s} {'max':>8s} "
          f"{'saving us':>10s}")
    for name, times in results.items():
        if not times:
            print(f"{name:50s} {'failed':>8s}")
            continue
        med = statistics.median(times)
        print(f"{name:50s} {med:8.1f} {min(times):8.1f} {max(times):8.1f} {base - med:10.1f}")


if __name__ == "__main__":
    main()
