"""Can one persistent kernel run a chain of dependent decode GEMMs without paying the launch boundaries? (GPU, sm_90+)

    PYTHONPATH=$PWD python3 benchmarks/micro/gemm_chain_persistent.py [--no-wait | --pair | --x-off] [LAYERS]

gemm_preload.py measured ~3-5 us per 8B-shape GEMM launch in a PDL chain beyond its bytes, all of it the boundary (the
same GEMMs with no wait between them stream at the copy rate). This Gluon kernel runs x_{l+1} = x_l W_l^T for l < L
(64 rows, W_l [4096, 4096] fp16, o_proj's shape) in one launch: program c owns output features [c BN, (c+1) BN) of
every layer and keeps a ring of STAGES weight tiles in shared memory that it refills straight across layer boundaries
(a weight never depends on the chain), so the weight stream does not stop where a layer ends. The activations go
through a stacked buffer X [L + 1, 64, K]: a program writes its tile of x_{l+1}, fences, and bumps the ready count of
the K chunk that tile belongs to (release); a program reads chunk j of x_{l+1} by TMA once that count is complete
(acquire). Dependencies only point to the previous layer, so there is no cycle; the grid is one program per tile and
fits on the SMs.
Timed from a CUDA graph beside the same chain as L separate launches (the fastest production candidate, PDL on).
With --no-wait: the warp-specialized form with and without its count waits (a bound: layers then read stale x).
With --pair: two programs per 64-feature tile (one K half each, the partial handed over) against it.
With --x-off: the warp-specialized form with no x traffic after one tile, and with deeper weight rings (a bound).
"""
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from graph_timing import graph_median_us  # (beside this script)

D = 4096
ROWS = 64


@gluon.jit
def _fence_proxy_async_global():
    gl.inline_asm_elementwise("fence.proxy.async.global; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _wait_count(ptr, need):
    """Spin until the ready count at ptr reaches need (acquire), then order this program's later TMA reads after the
    writes it counts (they were plain stores: another proxy)."""
    ready = gl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    while ready < need:
        ready = gl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    _fence_proxy_async_global()


@gluon.jit
def _issue_mma(acc, w_ring, x_ring, w_ready, x_ready, g, STAGES: gl.constexpr, XSTAGES: gl.constexpr,
               XOFF: gl.constexpr = False):
    """Step g: wait until its weight and x slots have landed, then start acc += x w^T on them (async).
    XOFF (a diagnostic): x slot 0 is filled once and multiplied at every step (no x traffic after the first tile)."""
    ws = g % STAGES
    xs = 0 if XOFF else g % XSTAGES
    mbarrier.wait(w_ready.index(ws), (g // STAGES) & 1)
    mbarrier.wait(x_ready.index(xs), 0 if XOFF else (g // XSTAGES) & 1)
    return warpgroup_mma(x_ring.index(xs), w_ring.index(ws).permute((1, 0)), acc, is_async=True)


@gluon.jit
def _refill(w_desc, x_desc, w_ring, x_ring, wbars, xbars, FLAGS, gp, kp, layer, n_k, total, K, n0, BK: gl.constexpr,
            BLOCK_M: gl.constexpr, STAGES: gl.constexpr, XSTAGES: gl.constexpr, PER_CHUNK: gl.constexpr,
            TILES_PER_CHUNK: gl.constexpr):
    """Step gp (chunk kp of this layer) is done: its weight slot takes the chain's tile gp + STAGES, whatever its
    layer; its x slot takes chunk kp + XSTAGES of this layer's input, if there is one."""
    gn = gp + STAGES
    ws = gp % STAGES
    if gn < total:
        mbarrier.expect(wbars.index(ws), w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [(gn // n_k) * K + n0, (gn % n_k) * BK], wbars.index(ws),
                                        w_ring.index(ws))
    kn = kp + XSTAGES
    if kn < n_k:
        if PER_CHUNK and layer > 0:
            _wait_count(FLAGS + (layer - 1) * n_k + kn, TILES_PER_CHUNK)
        xs = gp % XSTAGES
        mbarrier.expect(xbars.index(xs), x_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [layer * BLOCK_M, kn * BK], xbars.index(xs), x_ring.index(xs))


@gluon.jit
def _chain_kernel(x_desc, w_desc, X, FLAGS, L, K, STAGES: gl.constexpr, XSTAGES: gl.constexpr,
                  PER_CHUNK: gl.constexpr, ASYNC: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    TILES_PER_CHUNK: gl.constexpr = BK // BN
    c = gl.program_id(0)
    n_programs = gl.num_programs(0)
    n_k = K // BK
    total = L * n_k
    w_bytes: gl.constexpr = w_desc.block_type.nbytes
    x_bytes: gl.constexpr = x_desc.block_type.nbytes
    w_ring = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    x_ring = gl.allocate_shared_memory(x_desc.dtype, [XSTAGES, BLOCK_M, BK], x_desc.layout)
    wbars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    xbars = gl.allocate_shared_memory(gl.int64, [XSTAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(wbars.index(s), count=1)
    for s in gl.static_range(XSTAGES):
        mbarrier.init(xbars.index(s), count=1)
    for s in gl.static_range(STAGES):  # weight tiles 0 .. STAGES-1 of the whole chain
        mbarrier.expect(wbars.index(s), w_bytes, pred=s < total)
        tma.async_copy_global_to_shared(w_desc, [(s // n_k) * K + c * BN, (s % n_k) * BK], wbars.index(s),
                                        w_ring.index(s), pred=s < total)
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BN, 16])
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    offs_n = c * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    acc = gl.zeros((BLOCK_M, BN), dtype=gl.float32, layout=layout)
    for layer in range(L):  # step g = layer * n_k + k uses weight slot g % STAGES and x slot g % XSTAGES
        if PER_CHUNK == 0 and layer > 0:  # x_layer is complete once every program has counted its tile
            _wait_count(FLAGS + layer - 1, n_programs)
        # the first x tiles of this layer (PER_CHUNK: chunk j of x_layer is ready once the previous layer's tiles in it
        # are)
        for s in gl.static_range(XSTAGES):
            if PER_CHUNK and layer > 0:
                _wait_count(FLAGS + (layer - 1) * n_k + s, TILES_PER_CHUNK)
            slot = (layer * n_k + s) % XSTAGES
            mbarrier.expect(xbars.index(slot), x_bytes, pred=s < n_k)
            tma.async_copy_global_to_shared(x_desc, [layer * BLOCK_M, s * BK], xbars.index(slot), x_ring.index(slot),
                                            pred=s < n_k)
        for k in range(n_k):
            g = layer * n_k + k
            acc = _issue_mma(acc, w_ring, x_ring, wbars, xbars, g, STAGES, XSTAGES)
            if ASYNC:  # keep this step's MMA in flight; the previous step's is done, so its slots are free
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                if k > 0:
                    _refill(w_desc, x_desc, w_ring, x_ring, wbars, xbars, FLAGS, g - 1, k - 1, layer, n_k, total, K,
                            c * BN, BK, BLOCK_M, STAGES, XSTAGES, PER_CHUNK, TILES_PER_CHUNK)
            else:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                _refill(w_desc, x_desc, w_ring, x_ring, wbars, xbars, FLAGS, g, k, layer, n_k, total, K, c * BN, BK,
                        BLOCK_M, STAGES, XSTAGES, PER_CHUNK, TILES_PER_CHUNK)
        if ASYNC:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            _refill(w_desc, x_desc, w_ring, x_ring, wbars, xbars, FLAGS, layer * n_k + n_k - 1, n_k - 1, layer, n_k,
                    total, K, c * BN, BK, BLOCK_M, STAGES, XSTAGES, PER_CHUNK, TILES_PER_CHUNK)
        # this program's tile of x_{layer+1}: store, make it visible to the other programs' TMA reads, count it
        gl.store(X + (layer + 1) * BLOCK_M * K + offs_m[:, None] * K + offs_n[None, :], acc.to(gl.float16))
        _fence_proxy_async_global()
        gl.thread_barrier()
        if PER_CHUNK:
            gl.atomic_add(FLAGS + layer * n_k + (c * BN) // BK, 1, sem="release", scope="gpu")
        else:
            gl.atomic_add(FLAGS + layer, 1, sem="release", scope="gpu")
        acc = gl.zeros((BLOCK_M, BN), dtype=gl.float32, layout=layout)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(wbars.index(s))
    for s in gl.static_range(XSTAGES):
        mbarrier.invalidate(xbars.index(s))


# ---- the same chain, warp-specialized (session 38: compiled for sm_90 on the CPU, not yet run on a GPU) ------------
# One warp streams the weight ring (it never waits for activations), one warp fills the x ring (it waits for each
# layer's ready count), and the four default warps only wait for full slots, multiply and hand slots back: so a layer
# boundary stops neither the weight stream nor the MMAs of tiles already landed.


@gluon.jit
def _ws_weight_loader(w_desc, w_ring, w_ready, w_empty, total, n_k, K, n0, BK: gl.constexpr, STAGES: gl.constexpr,
                      k_base):
    """n_k K tiles per layer from column k_base on (the pair form: one K half)."""
    for g in range(total):
        s = g % STAGES
        mbarrier.wait(w_empty.index(s), ((g // STAGES) & 1) ^ 1)  # a fresh barrier counts as released once
        mbarrier.expect(w_ready.index(s), w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [(g // n_k) * K + n0, k_base + (g % n_k) * BK], w_ready.index(s),
                                        w_ring.index(s))


@gluon.jit
def _ws_x_loader(x_desc, x_ring, x_ready, x_empty, FLAGS, total, n_k, n_programs, BLOCK_M: gl.constexpr,
                 BK: gl.constexpr, XSTAGES: gl.constexpr, WAIT: gl.constexpr, k_base, XOFF: gl.constexpr = False,
                 XHOT: gl.constexpr = False, CHUNKED: gl.constexpr = False, BN: gl.constexpr = 32):
    """n_programs: the count that completes a layer (the programs that store x tiles). XOFF: one tile, then stop.
    XHOT (a diagnostic, with WAIT off): every layer reads x_0, which stays in L2 (x_l written long before would
    not: the weight stream evicts it, so leaving the waits out alone turns x reads into DRAM reads).
    CHUNKED: a count per BK-feature chunk of each layer (BK / BN programs store into one); chunk k is read once its
    count is complete. One poll reads all n_k (<= 32) counts of the layer at once; later chunks found complete in
    that snapshot need no poll of their own."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    idx = gl.arange(0, 32, layout=lay)
    snap = gl.zeros([32], gl.int32, lay)
    for g in range(1 if XOFF else total):
        layer = g // n_k
        k = g % n_k
        if CHUNKED:
            if WAIT and layer > 0:
                if k == 0:
                    snap = gl.zeros([32], gl.int32, lay)
                have = gl.sum(gl.where(idx == k, snap, 0), axis=0)
                while have < BK // BN:
                    snap = gl.atomic_add(FLAGS + (layer - 1) * n_k + idx, gl.zeros([32], gl.int32, lay),
                                         mask=idx < n_k, sem="acquire", scope="gpu")
                    _fence_proxy_async_global()
                    have = gl.sum(gl.where(idx == k, snap, 0), axis=0)
        elif WAIT and k == 0 and layer > 0:  # x_layer is complete once every program has counted its tile
            _wait_count(FLAGS + layer - 1, n_programs)
        s = g % XSTAGES
        mbarrier.wait(x_empty.index(s), ((g // XSTAGES) & 1) ^ 1)
        mbarrier.expect(x_ready.index(s), x_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [0 if XHOT else layer * BLOCK_M, k_base + k * BK], x_ready.index(s),
                                        x_ring.index(s))


@gluon.jit
def _ws_layer(w_ring, x_ring, w_ready, w_empty, x_ready, x_empty, layer, n_k, layout: gl.constexpr,
              BLOCK_M: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, XSTAGES: gl.constexpr,
              INFLIGHT: gl.constexpr = False, XOFF: gl.constexpr = False):
    """A warp-specialized consumer's product for one layer: n_k ring steps, each slot released once multiplied.
    INFLIGHT: step g's MMA is issued before step g - 1's is waited for (one warpgroup MMA kept in flight).
    XOFF: see _issue_mma (its x releases then go nowhere: the x loader has stopped)."""
    acc = gl.zeros((BLOCK_M, BN), dtype=gl.float32, layout=layout)
    for k in range(n_k):
        g = layer * n_k + k
        acc = _issue_mma(acc, w_ring, x_ring, w_ready, x_ready, g, STAGES, XSTAGES, XOFF)
        if INFLIGHT:
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            if k > 0:
                mbarrier.arrive(w_empty.index((g - 1) % STAGES), count=1)
                mbarrier.arrive(x_empty.index((g - 1) % XSTAGES), count=1)
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(w_empty.index(g % STAGES), count=1)
            mbarrier.arrive(x_empty.index(g % XSTAGES), count=1)
    if INFLIGHT:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        g = layer * n_k + n_k - 1
        mbarrier.arrive(w_empty.index(g % STAGES), count=1)
        mbarrier.arrive(x_empty.index(g % XSTAGES), count=1)
    return acc


@gluon.jit
def _release(w_empty, x_empty, g, STAGES: gl.constexpr, XSTAGES: gl.constexpr):
    mbarrier.arrive(w_empty.index(g % STAGES), count=1)
    mbarrier.arrive(x_empty.index(g % XSTAGES), count=1)


@gluon.jit
def _ws_layer_two_acc(w_ring, x_ring, w_ready, w_empty, x_ready, x_empty, layer, n_k, layout: gl.constexpr,
                      BLOCK_M: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, XSTAGES: gl.constexpr,
                      XOFF: gl.constexpr = False):
    """_ws_layer with even and odd K steps on two accumulators (n_k even): consecutive warpgroup MMAs do not depend
    on each other, so one can run while the next is issued; each slot is released once its MMA is done."""
    acc0 = gl.zeros((BLOCK_M, BN), dtype=gl.float32, layout=layout)
    acc1 = gl.zeros((BLOCK_M, BN), dtype=gl.float32, layout=layout)
    g0 = layer * n_k
    acc0 = _issue_mma(acc0, w_ring, x_ring, w_ready, x_ready, g0, STAGES, XSTAGES, XOFF)
    for k in range(1, n_k - 1, 2):  # acc0 holds step k - 1 in flight as each pair starts
        acc1 = _issue_mma(acc1, w_ring, x_ring, w_ready, x_ready, g0 + k, STAGES, XSTAGES, XOFF)
        acc0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc0, ))  # step k - 1 is done
        _release(w_empty, x_empty, g0 + k - 1, STAGES, XSTAGES)
        acc0 = _issue_mma(acc0, w_ring, x_ring, w_ready, x_ready, g0 + k + 1, STAGES, XSTAGES, XOFF)
        acc1 = warpgroup_mma_wait(num_outstanding=1, deps=(acc1, ))  # step k is done
        _release(w_empty, x_empty, g0 + k, STAGES, XSTAGES)
    acc1 = _issue_mma(acc1, w_ring, x_ring, w_ready, x_ready, g0 + n_k - 1, STAGES, XSTAGES, XOFF)
    acc0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc0, ))
    _release(w_empty, x_empty, g0 + n_k - 2, STAGES, XSTAGES)
    acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, ))
    _release(w_empty, x_empty, g0 + n_k - 1, STAGES, XSTAGES)
    return acc0 + acc1


@gluon.jit
def _ws_layer_no_mma(w_ring, x_ring, w_ready, w_empty, x_ready, x_empty, layer, n_k, layout: gl.constexpr,
                     BLOCK_M: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, XSTAGES: gl.constexpr,
                     XOFF: gl.constexpr = False):
    """A diagnostic: the consumer only waits for each step's slots and releases them (no MMA; the result is 0)."""
    for k in range(n_k):
        g = layer * n_k + k
        mbarrier.wait(w_ready.index(g % STAGES), (g // STAGES) & 1)
        mbarrier.wait(x_ready.index(0 if XOFF else g % XSTAGES), 0 if XOFF else (g // XSTAGES) & 1)
        _release(w_empty, x_empty, g, STAGES, XSTAGES)
    return gl.zeros((BLOCK_M, BN), dtype=gl.float32, layout=layout)


@gluon.jit
def _ws_compute(X, FLAGS, w_ring, x_ring, w_ready, w_empty, x_ready, x_empty, L, n_k, K, n0, BLOCK_M: gl.constexpr,
                BN: gl.constexpr, STAGES: gl.constexpr, XSTAGES: gl.constexpr, num_warps: gl.constexpr,
                INFLIGHT: gl.constexpr, XOFF: gl.constexpr = False, FORM: gl.constexpr = 0,
                CHUNKED: gl.constexpr = False, BK: gl.constexpr = 256):
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BN, 16])
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    offs_n = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    for layer in range(L):
        if FORM == 1:
            acc = _ws_layer_two_acc(w_ring, x_ring, w_ready, w_empty, x_ready, x_empty, layer, n_k, layout, BLOCK_M,
                                    BN, STAGES, XSTAGES, XOFF)
        elif FORM == 2:
            acc = _ws_layer_no_mma(w_ring, x_ring, w_ready, w_empty, x_ready, x_empty, layer, n_k, layout, BLOCK_M,
                                   BN, STAGES, XSTAGES, XOFF)
        else:
            acc = _ws_layer(w_ring, x_ring, w_ready, w_empty, x_ready, x_empty, layer, n_k, layout, BLOCK_M, BN,
                            STAGES, XSTAGES, INFLIGHT, XOFF)
        gl.store(X + (layer + 1) * BLOCK_M * K + offs_m[:, None] * K + offs_n[None, :], acc.to(gl.float16))
        _fence_proxy_async_global()
        gl.thread_barrier()
        if CHUNKED:
            gl.atomic_add(FLAGS + layer * n_k + n0 // BK, 1, sem="release", scope="gpu")
        else:
            gl.atomic_add(FLAGS + layer, 1, sem="release", scope="gpu")


@gluon.jit
def _ws_rings(x_desc, w_desc, STAGES: gl.constexpr, XSTAGES: gl.constexpr):
    """The warp-specialized forms' weight and x rings with their ready / empty barriers (initialised)."""
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    w_ring = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    x_ring = gl.allocate_shared_memory(x_desc.dtype, [XSTAGES, BLOCK_M, BK], x_desc.layout)
    w_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    x_ready = gl.allocate_shared_memory(gl.int64, [XSTAGES, 1], mbarrier.MBarrierLayout())
    x_empty = gl.allocate_shared_memory(gl.int64, [XSTAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(w_ready.index(s), count=1)
        mbarrier.init(w_empty.index(s), count=1)
    for s in gl.static_range(XSTAGES):
        mbarrier.init(x_ready.index(s), count=1)
        mbarrier.init(x_empty.index(s), count=1)
    return w_ring, x_ring, w_ready, w_empty, x_ready, x_empty


@gluon.jit
def _chain_kernel_ws(x_desc, w_desc, X, FLAGS, L, K, STAGES: gl.constexpr, XSTAGES: gl.constexpr,
                     num_warps: gl.constexpr, WAIT: gl.constexpr = True, INFLIGHT: gl.constexpr = False,
                     XOFF: gl.constexpr = False, FORM: gl.constexpr = 0, XHOT: gl.constexpr = False,
                     CHUNKED: gl.constexpr = False):
    """FORM 0: one accumulator (INFLIGHT: one MMA kept in flight), 1: two accumulators (_ws_layer_two_acc), 2: no
    MMA (_ws_layer_no_mma, a diagnostic). CHUNKED: per-chunk ready counts (_ws_x_loader)."""
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    n0 = gl.program_id(0) * BN
    n_programs = gl.num_programs(0)
    n_k = K // BK
    total = L * n_k
    w_ring, x_ring, w_ready, w_empty, x_ready, x_empty = _ws_rings(x_desc, w_desc, STAGES, XSTAGES)
    gl.warp_specialize([
        (_ws_compute, (X, FLAGS, w_ring, x_ring, w_ready, w_empty, x_ready, x_empty, L, n_k, K, n0, BLOCK_M, BN, STAGES,
                       XSTAGES, num_warps, INFLIGHT, XOFF, FORM, CHUNKED, BK)),
        (_ws_weight_loader, (w_desc, w_ring, w_ready, w_empty, total, n_k, K, n0, BK, STAGES, 0)),
        (_ws_x_loader, (x_desc, x_ring, x_ready, x_empty, FLAGS, total, n_k, n_programs, BLOCK_M, BK, XSTAGES,
                        WAIT and not XOFF and not XHOT, 0, XOFF, XHOT, CHUNKED, BN)),
    ], [1, 1], [40, 40])


@gluon.jit
def _pair_compute(X, FLAGS, PART, PFLAGS, w_ring, x_ring, w_ready, w_empty, x_ready, x_empty, L, n_k, K, n0, tile, half,
                  BLOCK_M: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, XSTAGES: gl.constexpr,
                  num_warps: gl.constexpr):
    """One K half of a BN-feature tile per layer: the upper half hands its fp32 partial to the lower half, which adds
    it (a fixed order), stores the tile of x_{l+1} and counts it. One partial buffer per tile serves every layer:
    the upper half cannot finish layer l + 1 before x_{l+1} is complete, so its lower half has read layer l's."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BN, 16])
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    offs_b = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    part = PART + tile * BLOCK_M * BN + offs_m[:, None] * BN + offs_b[None, :]
    for layer in range(L):
        acc = _ws_layer(w_ring, x_ring, w_ready, w_empty, x_ready, x_empty, layer, n_k, layout, BLOCK_M, BN, STAGES,
                        XSTAGES)
        if half == 1:
            gl.store(part, acc)
            gl.thread_barrier()
            gl.atomic_add(PFLAGS + tile, 1, sem="release", scope="gpu")
        else:
            ready = gl.atomic_add(PFLAGS + tile, 0, sem="acquire", scope="gpu")
            while ready < layer + 1:
                ready = gl.atomic_add(PFLAGS + tile, 0, sem="acquire", scope="gpu")
            acc += gl.load(part, cache_modifier=".cg")
            gl.store(X + (layer + 1) * BLOCK_M * K + offs_m[:, None] * K + (n0 + offs_b)[None, :], acc.to(gl.float16))
            _fence_proxy_async_global()
            gl.thread_barrier()
            gl.atomic_add(FLAGS + layer, 1, sem="release", scope="gpu")


@gluon.jit
def _chain_kernel_pair(x_desc, w_desc, X, FLAGS, PART, PFLAGS, L, K, STAGES: gl.constexpr, XSTAGES: gl.constexpr,
                       num_warps: gl.constexpr, WAIT: gl.constexpr = True):
    """Program p computes K half p % 2 of output tile p // 2: each program reads half of x per layer."""
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    tile = gl.program_id(0) // 2
    half = gl.program_id(0) % 2
    n0 = tile * BN
    n_k = K // BK // 2
    k_base = half * (K // 2)
    total = L * n_k
    w_ring, x_ring, w_ready, w_empty, x_ready, x_empty = _ws_rings(x_desc, w_desc, STAGES, XSTAGES)
    gl.warp_specialize([
        (_pair_compute, (X, FLAGS, PART, PFLAGS, w_ring, x_ring, w_ready, w_empty, x_ready, x_empty, L, n_k, K, n0,
                         tile, half, BLOCK_M, BN, STAGES, XSTAGES, num_warps)),
        (_ws_weight_loader, (w_desc, w_ring, w_ready, w_empty, total, n_k, K, n0, BK, STAGES, k_base)),
        (_ws_x_loader, (x_desc, x_ring, x_ready, x_empty, FLAGS, total, n_k, K // BN, BLOCK_M, BK, XSTAGES, WAIT,
                        k_base)),
    ], [1, 1], [40, 40])


def pair_chain(xs: torch.Tensor, w: torch.Tensor, flags: torch.Tensor, part: torch.Tensor, tile,
               wait: bool = True) -> torch.Tensor:
    """The pair form of persistent_chain: 2 K / BN programs; flags int32 [L + K / BN + ...] zeroed here (the first L
    are the layer counts, the next K / BN the partial counts), part fp32 [K / BN, 64, BN]. wait=False: the x loader
    does not wait for the layer counts (a bound, as in persistent_chain; the partial hand-over still waits)."""
    bn, bk, stages, xstages = tile
    layers, k = xs.shape[0] - 1, xs.shape[2]
    if 2 * k // bn > torch.cuda.get_device_properties(xs.device).multi_processor_count or (k // 2) % bk:
        raise ValueError(f"tile {tile} does not fit the pair chain's rules")
    flags.zero_()
    fl = flags.view(-1)
    xd = TensorDescriptor.from_tensor(xs.view(-1, k), [ROWS, bk],
                                      gl.NVMMASharedLayout.get_default_for([ROWS, bk], gl.float16))
    wd = TensorDescriptor.from_tensor(w, [bn, bk], gl.NVMMASharedLayout.get_default_for([bn, bk], gl.float16))
    _chain_kernel_pair[(2 * k // bn,)](xd, wd, xs, fl, part, fl[layers:], layers, k, STAGES=stages, XSTAGES=xstages,
                                       num_warps=4, WAIT=wait)
    return xs


def _chain_problem(layers: int):
    """(w [L * D, D], xs [L + 1, 64, D] with a random input in xs[0], ref): the chain's weights, activations and its
    fp32 reference (products rounded to fp16 per layer, as the kernels do), seeded."""
    torch.manual_seed(0)
    w = torch.randn(layers * D, D, dtype=torch.float16, device="cuda") / D ** 0.5
    xs = torch.zeros(layers + 1, ROWS, D, dtype=torch.float16, device="cuda")
    xs[0].normal_()
    ref = [xs[0].clone()]
    for layer in range(layers):
        ref.append((ref[-1].float() @ w[layer * D:(layer + 1) * D].float().t()).half())
    return w, xs, ref


def main_pair(layers: int):
    """The pair form against the warp-specialized form (also with one MMA in flight), all checked against the fp32
    chain."""
    w, xs, ref = _chain_problem(layers)
    flags = torch.zeros(layers + D, dtype=torch.int32, device="cuda")
    part = torch.empty(D // 64, ROWS, 64, dtype=torch.float32, device="cuda")
    for name, tile in ([("WS", t) for t in TILES[1:3]] + [("WS, one MMA in flight", t) for t in TILES]
                       + [("pair", t) for t in ((64, 128, 6, 4), (64, 128, 5, 5), (64, 64, 10, 8))]):
        run = (lambda tile=tile: pair_chain(xs, w, flags, part, tile)) if name == "pair" else \
            (lambda tile=tile, f=name != "WS": persistent_chain(xs, w, flags, tile, False, f, True))
        xs[1:].fill_(float("nan"))
        try:
            run()
            torch.cuda.synchronize()
        except Exception as e:
            print(f"{name} {tile}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        err = max(((xs[i].float() - ref[i].float()).norm() / ref[i].float().norm()).item() for i in (1, layers))
        t = graph_median_us(run, layers)
        print(f"{name} {tile}: {t:.2f} us per layer ({D * D * 2 / 1e6 / t:.2f} TB/s), rel. error {err:.1e}"
              + ("" if err < 5e-3 else " WRONG"), flush=True)


def persistent_chain(xs: torch.Tensor, w: torch.Tensor, flags: torch.Tensor, tile, per_chunk: bool,
                     async_mma: bool = True, warp_specialized: bool = False, wait: bool = True,
                     x_off: bool = False, form: int = 0, x_hot: bool = False) -> torch.Tensor:
    # warp-specialized with per_chunk: one count per BK-feature chunk of each layer (flags [L, K / BK] at least)
    """xs [L + 1, 64, K] (xs[0] the input; the others are written), w [L * N, K] stacked with N == K, flags int32
    [L, K / BK] zeroed here. Returns xs. async_mma, warp-specialized: one MMA kept in flight. wait=False
    (warp-specialized only): the x loader does not wait for the layer counts, so layers overlap and read stale x: a
    bound, not a result. x_off (warp-specialized only): no x traffic after one tile (see _issue_mma): a bound.
    form (warp-specialized only): see _chain_kernel_ws. x_hot (warp-specialized, no waits): every layer reads x_0."""
    bn, bk, stages, xstages = tile
    layers = xs.shape[0] - 1
    k = xs.shape[2]
    # every program must be resident at once (a program waits for tiles of the others): one per SM at most here
    if (k // bn > torch.cuda.get_device_properties(xs.device).multi_processor_count or bk % bn or k // bk < xstages
            or (warp_specialized and per_chunk and k // bk > 32)):
        raise ValueError(f"tile {tile} does not fit the chain's rules")
    flags.zero_()
    x2 = xs.view(-1, k)
    xd = TensorDescriptor.from_tensor(x2, [ROWS, bk], gl.NVMMASharedLayout.get_default_for([ROWS, bk], gl.float16))
    wd = TensorDescriptor.from_tensor(w, [bn, bk], gl.NVMMASharedLayout.get_default_for([bn, bk], gl.float16))
    if warp_specialized:  # one ready count per layer
        _chain_kernel_ws[(k // bn,)](xd, wd, xs, flags, layers, k, STAGES=stages, XSTAGES=xstages, num_warps=4,
                                     WAIT=wait, INFLIGHT=async_mma, XOFF=x_off, FORM=form,
                                     XHOT=x_hot, CHUNKED=per_chunk)
    else:
        _chain_kernel[(k // bn,)](xd, wd, xs, flags, layers, k, STAGES=stages, XSTAGES=xstages,
                                  PER_CHUNK=per_chunk, ASYNC=async_mma, num_warps=4)
    return xs


TILES = ((32, 256, 6, 3), (32, 256, 4, 4), (32, 256, 5, 4), (32, 128, 8, 6))  # (BN, BK, STAGES, XSTAGES)


def main_no_wait(layers: int):
    """The warp-specialized chain with the count waits left out: what this kernel streams with no dependency."""
    torch.manual_seed(0)
    w = torch.randn(layers * D, D, dtype=torch.float16, device="cuda") / D ** 0.5
    xs = torch.randn(layers + 1, ROWS, D, dtype=torch.float16, device="cuda")
    flags = torch.zeros(layers, D // 16, dtype=torch.int32, device="cuda")
    for tile in TILES + ((64, 128, 6, 4), (64, 64, 8, 6)):  # (+ 64-feature programs: half the x reads per weight byte)
        for wait in (True, False):
            t = graph_median_us(lambda: persistent_chain(xs, w, flags, tile, False, False, True, wait), layers)
            print(f"persistent WS {tile} waits {'on ' if wait else 'off'}: {t:.2f} us per layer "
                  f"({D * D * 2 / 1e6 / t:.2f} TB/s)", flush=True)


def main_x_off(layers: int):
    """What limits the warp-specialized chain's streaming. x off: no x traffic after one tile (a bound: one x tile is
    multiplied throughout); consumer forms: one accumulator (MMA waited for at each step, or one kept in flight), two
    accumulators (even / odd K steps), no MMA (the rings alone). The real chain (x on, waits on) is checked against
    the fp32 chain in each consumer form."""
    w, xs, ref = _chain_problem(layers)
    flags = torch.zeros(layers, D // 16, dtype=torch.int32, device="cuda")
    forms = {0: "one acc", 1: "two accs", 2: "no MMA"}
    for tile in ((32, 256, 6, 3), (32, 256, 4, 4), (32, 256, 8, 2), (32, 128, 16, 3), (32, 128, 12, 4)):
        for form, chunked in ((0, False), (1, False), (0, True), (1, True)):
            def run(tile=tile, form=form, chunked=chunked):
                return persistent_chain(xs, w, flags, tile, chunked, False, True, True, False, form)
            xs[1:].fill_(float("nan"))
            try:
                run()
                torch.cuda.synchronize()
            except Exception as e:  # a ring that does not fit in shared memory
                print(f"chain WS {tile}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            err = max(((xs[i].float() - ref[i].float()).norm() / ref[i].float().norm()).item() for i in (1, layers))
            n_k = D // tile[1]
            counts = flags.view(-1)[:layers * n_k] if chunked else flags.view(-1)[:layers]
            counts_ok = bool((counts == (tile[1] // tile[0] if chunked else D // tile[0])).all())
            t = graph_median_us(run, layers)
            print(f"chain WS {tile} {forms[form]}{', per-chunk counts' if chunked else ''}: {t:.2f} us per layer "
                  f"({D * D * 2 / 1e6 / t:.2f} TB/s), rel. error {err:.1e}" + ("" if err < 5e-3 else " WRONG")
                  + ("" if counts_ok else " COUNTS WRONG"), flush=True)
    # bounds with no dependency: x_0 read at every layer (hot in L2), or no x traffic after one tile
    cases = [(t, "hot", f, False) for t in ((32, 256, 6, 3), (32, 256, 4, 4), (32, 256, 8, 2)) for f in (0, 1, 2)]
    cases += [((32, 256, 6, 1), "off", f, i) for f, i in ((0, False), (1, False), (2, False))]
    for tile, x_mode, form, inflight in cases:
        try:
            t = graph_median_us(lambda: persistent_chain(xs, w, flags, tile, False, inflight, True, False,
                                                         x_mode == "off", form, x_mode == "hot"), layers)
        except Exception as e:  # a ring that does not fit in shared memory
            print(f"WS {tile} x {x_mode}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            continue
        print(f"WS {tile} (BN, BK, w slots, x slots) waits off, x {x_mode}, {forms[form]}"
              f"{', in flight' if inflight else ''}: {t:.2f} us per layer ({D * D * 2 / 1e6 / t:.2f} TB/s of weights)",
              flush=True)


def main(layers: int):
    from voltllm.kernels import pdl
    from voltllm.kernels.batch_gemm import CONFIGS, TMA_CONFIGS, batch_gemm

    pdl.configure(True)
    w, xs, ref = _chain_problem(layers)
    ws = w.view(layers, D, D)
    mb = D * D * 2 / 1e6

    def separate(cfg):
        def step():
            for layer in range(layers):
                if cfg == "cublas":
                    torch.matmul(xs[layer], ws[layer].t(), out=xs[layer + 1])
                else:
                    batch_gemm(xs[layer], ws[layer], config=cfg, out=xs[layer + 1])
        return step

    def check(what, flags=None, tile=None):
        err = max(((xs[i].float() - ref[i].float()).norm() / ref[i].float().norm()).item() for i in (1, layers))
        if not err < 5e-3:
            raise AssertionError(f"{what}: relative error {err:.2e}")
        if flags is not None:  # each count has one increment per program that feeds it
            per_chunk = tile[4]
            n_k = D // tile[1]
            counts = flags.view(-1)[:layers * n_k] if per_chunk else flags.view(-1)[:layers]
            if not bool((counts == (tile[1] // tile[0] if per_chunk else D // tile[0])).all()):
                raise AssertionError(f"{what}: ready counts {counts.unique().tolist()}")

    best = (float("inf"), None)
    for cfg in ("cublas", *CONFIGS, *TMA_CONFIGS):
        xs[1:].fill_(float("nan"))
        separate(cfg)()
        check(f"separate {cfg}")
        t = graph_median_us(separate(cfg), layers)
        best = min(best, (t, cfg), key=lambda b: b[0])
    print(f"{layers} layers, 4096x4096, 64 rows: separate launches (PDL) {best[0]:.2f} us per layer "
          f"({mb / best[0]:.2f} TB/s) {best[1]}", flush=True)
    flags = torch.zeros(layers, D // 16, dtype=torch.int32, device="cuda")
    results = []
    # (tile, per-chunk counts, async MMA)
    # (tile, per-chunk counts, async MMA, warp-specialized)
    for tile in [(*t, False, False, ws) for t in TILES for ws in (False, True)]:
        xs[1:].fill_(float("nan"))
        try:
            persistent_chain(xs, w, flags, tile[:4], *tile[4:])
            torch.cuda.synchronize()
        except Exception as e:  # a tile that does not launch (shared memory) is reported and skipped
            print(f"persistent {tile}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        check(f"persistent {tile}", flags, tile)
        t = graph_median_us(lambda tile=tile: persistent_chain(xs, w, flags, tile[:4], *tile[4:]), layers)
        results.append((t, tile))
        print(f"persistent {tile} (BN, BK, weight stages, x stages, per-chunk counts, async MMA, warp-specialized): "
              f"{t:.2f} us per layer ({mb / t:.2f} TB/s)", flush=True)
    t, tile = min(results)
    print(f"summary: {layers} x 4096x4096 at 64 rows: separate {best[0]:.2f} us per layer {best[1]} | persistent "
          f"{t:.2f} {tile} | {best[0] / t:.3f}x")


if __name__ == "__main__":
    # --no-wait: the warp-specialized chain with and without its count waits (timings only)
    # --pair: two programs per 64-feature tile (K halves), against the warp-specialized form
    # --x-off: the warp-specialized chain with its x traffic cut after one tile (timings only)
    modes = {"--no-wait": main_no_wait, "--pair": main_pair, "--x-off": main_x_off}
    args = [a for a in sys.argv[1:] if a not in modes]
    fn = next((modes[a] for a in sys.argv[1:] if a in modes), main)
    fn(int(args[0]) if args else 36)
