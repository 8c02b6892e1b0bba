"""Kernel arguments that change from step to step stay out of Triton's specialisation.

Triton compiles a variant per class of each argument (an integer == 1 or divisible by 16, a pointer 16-byte aligned
or not). Where an argument's class follows the step (the longest context, a slice of the block table, the rows of a
per-step table uploaded as one tensor and sliced, whose alignment depends on the counts before them) and the kernel
gains nothing from it (a bound, scalars read once per program), each new class or combination compiled a variant
inside the step that first met it (session 43: micro/bench_compiles.py, +90 ms in a warm bench run)."""
import importlib

import pytest

# (module, kernel): (do_not_specialize, do_not_specialize_on_alignment), in parameter order
EXPECTED = {
    ("voltllm.kernels.kv_fp8", "kv_fp8_gather_kernel"): (
        ["ctx_len", "stride_bt"], ["block_table_ptr", "seq_ptr", "ctx_ptr", "start_ptr"]),
    ("voltllm.kernels.attention.paged_decode", "_paged_decode_kernel"): (["num_splits"], ["SeqLens", "QueryStartLoc"]),
    ("voltllm.kernels.attention.paged_decode", "_decode_reduce_kernel"): (["num_splits"], []),
    ("voltllm.kernels.attention.paged_prefill", "_paged_prefill_kernel"): (
        ["min_q_len", "stride_bt"], ["BlockTables", "SeqLens", "QueryStartLoc"]),
    ("voltllm.kernels.moe", "_moe_gate_up_kernel"): (["num_pairs"], []),
    ("voltllm.kernels.moe", "_moe_down_kernel"): (["num_pairs"], []),
    ("voltllm.kernels.moe", "_moe_align_kernel"): (["n", "num_slots", "num_blocks", "block_m"], []),
    ("voltllm.kernels.moe", "_moe_align_sort_kernel"): (["n", "num_slots", "num_blocks"], []),
    ("voltllm.kernels.gdn_chunk", "_gdn_chunk_prep_kernel"): ([], ["ChunkStart", "ChunkLen"]),
    ("voltllm.kernels.gdn_chunk", "_gdn_chunk_hoist_kernel"): ([], ["ChunkStart", "ChunkLen"]),
    ("voltllm.kernels.gdn_chunk", "_gdn_chunk_fwd_kernel"): ([], ["Slots", "HasInit", "SeqStart", "SeqChunk"]),
    ("voltllm.kernels.gdn_conv", "_conv_prefill_kernel"): ([], ["Slots", "HasInit", "TileReq", "TileStart", "Qsl"]),
    # the decode-batch GEMM's row count: a start-up choice timed at 48 rows also serves eager batches of 33-47
    ("voltllm.kernels.batch_gemm", "_batch_gemm_kernel"): (["M"], []),
    ("voltllm.kernels.batch_gemm", "_batch_gemm_tma_kernel"): (["M"], []),
}


@pytest.mark.parametrize("module,kernel", list(EXPECTED))
def test_step_varying_arguments_are_not_specialised(module, kernel):
    fn = getattr(importlib.import_module(module), kernel)
    values, alignment = EXPECTED[(module, kernel)]
    assert [p.name for p in fn.params if p.do_not_specialize] == values
    assert [p.name for p in fn.params if p.do_not_specialize_on_alignment] == alignment


def test_sliced_step_tables_are_what_the_kernels_leave_unaligned():
    """The per-step tables really are slices at offsets that follow the counts (so their alignment varies)."""
    import torch

    from voltllm.kernels.gdn_chunk import chunk_meta
    from voltllm.kernels.gdn_conv import conv_tiles

    init = torch.tensor([True, False, True])
    byte_offsets = set()
    for qsl in ([0, 5, 70, 71], [0, 64, 65, 200], [0, 1, 2, 3]):
        meta = chunk_meta(qsl, init)
        tiles = conv_tiles(qsl, init)
        for t in (meta.chunk_len, meta.seq_chunk, meta.seq_start, tiles.start, tiles.qsl):
            byte_offsets.add(t.storage_offset() * t.element_size() % 16)
    assert len(byte_offsets) > 1  # aligned in some steps, not in others
