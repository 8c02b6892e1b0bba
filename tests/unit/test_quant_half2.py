"""The packed-fp16 4-bit GEMV's host side (kernels/quant_half2.py): which plane kinds it takes, and the start-up
tuner's candidates for it. The kernel itself runs on the GPU (tests/gpu/test_quant_half2_cuda.py; inline PTX has no
interpreter form) and passes the sm_70 / sm_75 gate with the other registered kernels."""
from voltllm.kernels.quant_half2 import DOT, HALF2, HALF2_ROWS, MMA, supports
from voltllm.kernels.registry import REGISTRY
from voltllm.model.layers.gguf_planes import FP8_KIND, KINDS, NVFP4_KIND, bnb_kind, int4_kind, int8_kind
from voltllm.model.layers.quantized_linear import FMA_MAX_ROWS, MMA_MAX_ROWS, MMA_ROW_CLASSES, row_class
from voltllm.worker.quant_tuning import CANDIDATES, HALF2_CANDIDATES, MMA_CANDIDATES, TUNE_ROWS


def test_kinds():
    taken = {"Q4_0"}
    for name, kind in KINDS.items():
        assert supports(kind) == (name in taken), name
    for group in (16, 32, 64, 128):
        assert supports(int4_kind(group, True)) and supports(int4_kind(group, False))
    assert supports(NVFP4_KIND) and not supports(FP8_KIND)
    # 8-bit GPTQ's codes have high bits: the FMA / tiled kernels take them (few_row_matmul falls back to quant_matmul)
    assert not supports(int8_kind(128, True)) and not supports(int8_kind(128, False))
    # bitsandbytes' codes index a table of floats (so do IQ4's, of integers): the FMA / tiled kernels look them up
    assert not any(supports(bnb_kind(t, b)) for t in ("nf4", "fp4") for b in (64, 128))


def test_registered_and_tuned():
    for name in ("quant.half2_matmul", "quant.half2_rows_matmul"):
        entry = REGISTRY[name]
        assert entry.compat and {s.constexprs["FP4"] for s in entry.specs} == {True, False}
        assert not any(s.constexprs["PDL"] for s in entry.specs)  # the gate compiles the PDL-free form (sm_70/75)
    # the H200 sweeps' winners: the second tiling at one row, both compete at four
    assert {c[0] for c in HALF2_CANDIDATES[1]} == {HALF2_ROWS}
    assert {c[0] for c in HALF2_CANDIDATES[FMA_MAX_ROWS]} == {HALF2, HALF2_ROWS}
    for rows in TUNE_ROWS:
        assert all(len(c) == 4 and (c[0] == HALF2 or c[1] in (1, 2)) for c in HALF2_CANDIDATES[rows])


def test_row_classes_and_tensor_core_candidates():
    """Rows 1 / 2-4 / 5-8 / 9-16 fall in the tuner's four classes; the tensor-core form (s104 sweep: never fastest
    at one row) competes from four rows on, and the 5-16-row classes' default stays quant_dot (the route taken when
    nothing is timed)."""
    assert MMA_ROW_CLASSES == (8, 16) and MMA_MAX_ROWS == 16
    assert [row_class(r) for r in range(1, 17)] == [1] + [FMA_MAX_ROWS] * 3 + [8] * 4 + [16] * 8
    assert TUNE_ROWS == (1, FMA_MAX_ROWS, 8, 16)
    assert MMA_CANDIDATES[1] == []
    for rows in MMA_ROW_CLASSES:
        assert CANDIDATES[rows] == [(DOT,)] and HALF2_CANDIDATES[rows] == []
    for rows in (FMA_MAX_ROWS, *MMA_ROW_CLASSES):
        cands = MMA_CANDIDATES[rows]
        assert cands and all(c[0] == MMA and len(c) == 3 and c[2] <= c[1] for c in cands)
    import voltllm.kernels.quant_mma  # noqa: F401 - registers it

    entry = REGISTRY["quant.mma_matmul"]
    assert not entry.compat  # sm_80+ only: never compiled for, nor launched on, the compat route
