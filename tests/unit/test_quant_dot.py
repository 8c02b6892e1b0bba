"""The tiled dequant-GEMM (kernels/quant_dot.py) under the Triton interpreter against the torch reference (every
plane kind, split K, the MoE sorted form), and its row limits by GPU generation."""
from pathlib import Path

from interp_util import check_names, run_interp_checks

CHECK_SCRIPT = Path(__file__).parent / "_quant_dot_interp_check.py"


def test_kernel_under_interpreter():
    results = run_interp_checks(CHECK_SCRIPT, timeout=300)
    assert set(results) == set(check_names(CHECK_SCRIPT))
    failed = {k: v for k, v in results.items() if not v.startswith("ok")}
    assert not failed, failed


def test_row_limits_and_tiles():
    from voltllm.kernels.quant_dot import (DOT_CONFIGS, DOT_CONFIGS_SM90, MOE_CONFIGS_SM90, dot_max_rows, dot_table,
                                           grouped_max_rows, moe_table, pick_config, split_k)

    assert dot_max_rows(None) == 0
    assert 4 < dot_max_rows((7, 0)) == dot_max_rows((7, 5)) < dot_max_rows((8, 0)) == dot_max_rows((9, 0))

    assert grouped_max_rows(None) == 0
    assert grouped_max_rows((7, 0)) == grouped_max_rows((7, 5)) < grouped_max_rows((8, 0)) == grouped_max_rows((9, 0))
    assert split_k(10, 128, 4, __import__("torch").device("cpu")) == 1  # no multiprocessors to fill off the GPU
    assert pick_config(5)[0] == 16 and pick_config(17)[0] == 32
    assert pick_config(10_000) == DOT_CONFIGS[max(DOT_CONFIGS)]
    # sm_90 takes its own table (the transposed form); other GPUs and the CPU the measured default
    assert dot_table((9, 0)) is DOT_CONFIGS_SM90
    assert dot_table((8, 6)) is dot_table((7, 0)) is dot_table((10, 0)) is dot_table((12, 0)) is dot_table(None) \
        is DOT_CONFIGS
    assert pick_config(17, DOT_CONFIGS_SM90) == DOT_CONFIGS_SM90[32] and pick_config(17) == DOT_CONFIGS[32]
    assert pick_config(10_000, DOT_CONFIGS_SM90) == DOT_CONFIGS_SM90[max(DOT_CONFIGS_SM90)]
    assert sorted(DOT_CONFIGS_SM90) == sorted(DOT_CONFIGS)
    # the grouped MoE kernel: its own sm_90 table, the same row blocks per class (moe_align sorts by block_m)
    assert moe_table((9, 0)) is MOE_CONFIGS_SM90
    assert moe_table((8, 0)) is moe_table((7, 0)) is moe_table((10, 0)) is moe_table(None) is DOT_CONFIGS
    assert {r: c[0] for r, c in MOE_CONFIGS_SM90.items()} == {r: c[0] for r, c in DOT_CONFIGS.items()}
    for rows, cfg in DOT_CONFIGS_SM90.items():
        assert cfg[0] <= rows and (len(cfg) == 5 or cfg[1] >= 64)  # W_FIRST with a 32-wide weight tile: slower
    for rows, (block_m, block_n, units, warps, stages) in DOT_CONFIGS.items():
        assert block_m >= 16 and block_n >= 16 and units >= 1  # tl.dot's smallest tile
