"""Triton attention kernels over the paged KV cache: kv_write, paged_decode (split-KV), paged_prefill."""
from voltllm.kernels.attention.kv_write import kv_write
from voltllm.kernels.attention.paged_decode import (choose_num_splits, decode_scratch_numel, paged_decode)
from voltllm.kernels.attention.paged_prefill import paged_prefill, prefill_config

__all__ = ["kv_write", "paged_decode", "paged_prefill", "choose_num_splits", "decode_scratch_numel",
           "prefill_config"]
