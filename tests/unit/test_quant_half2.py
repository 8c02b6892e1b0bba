"""The packed-fp16 4-bit GEMV's host side (kernels/quant_half2.py): which plane kinds it takes, and the start-up
tuner's candidates for it. The kernel itself runs on the GPU (tests/gpu/test_quant_half2_cuda.py; inline PTX has no
interpreter form) and passes the sm_70 / sm_75 gate with the other registered kernels."""
from voltllm.kernels.quant_half2 import HALF2, HALF2_ROWS, supports
from voltllm.kernels.registry import REGISTRY
from voltllm.model.layers.gguf_planes import FP8_KIND, KINDS, NVFP4_KIND, int4_kind
from voltllm.worker.quant_tuning import HALF2_CANDIDATES, TUNE_ROWS


def test_kinds():
    taken = {"Q4_0"}
    for name, kind in KINDS.items():
        assert supports(kind) == (name in taken), name
    for group in (16, 32, 64, 128):
        assert supports(int4_kind(group, True)) and supports(int4_kind(group, False))
    assert supports(NVFP4_KIND) and not supports(FP8_KIND)


def test_registered_and_tuned():
    for name in ("quant.half2_matmul", "quant.half2_rows_matmul"):
        entry = REGISTRY[name]
        assert entry.compat and {s.constexprs["FP4"] for s in entry.specs} == {True, False}
        assert not any(s.constexprs["PDL"] for s in entry.specs)  # the gate compiles the PDL-free form (sm_70/75)
    # the H200 sweeps' winners: the second tiling at one row, both compete at four
    assert {c[0] for c in HALF2_CANDIDATES[1]} == {HALF2_ROWS}
    assert {c[0] for c in HALF2_CANDIDATES[TUNE_ROWS[-1]]} == {HALF2, HALF2_ROWS}
    for rows in TUNE_ROWS:
        assert all(len(c) == 4 and (c[0] == HALF2 or c[1] in (1, 2)) for c in HALF2_CANDIDATES[rows])
