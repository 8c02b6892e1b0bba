"""`voltllm` with the paged-decode kernel's K / V load policy set first (an A/B entry for run_h200.sh s110):

    python3 benchmarks/micro/kv_eviction_entry.py POLICY bench ...

POLICY: evict_first (the default since issue #4's session 32), evict_last, or normal (no hint). The policy is a
module constant of paged_decode (its kernels read it when they compile), so each policy needs its own process.
"""
import sys

import triton.language as tl

from voltllm.cli import main
from voltllm.kernels.attention import paged_decode

if __name__ == "__main__":
    policy = sys.argv[1]
    if policy not in ("evict_first", "evict_last", "normal"):
        sys.exit(f"unknown policy {policy!r}: evict_first, evict_last or normal")
    paged_decode.KV_EVICTION = tl.constexpr("" if policy == "normal" else policy)
    sys.exit(main(sys.argv[2:]))
