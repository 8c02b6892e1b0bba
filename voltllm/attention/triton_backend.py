"""Triton attention backend over the paged KV cache (see voltllm.attention.backend for the contract).

forward() = kv_write (one launch for K and V; skipped with kv_written=True: for float caches on CUDA,
cache_write_for hands the model a CacheWrite and its RoPE launch stores K and V, one kernel less per
layer) -> paged decode (pure-decode steps, split-KV when the grid
would not fill the GPU) or paged prefill (everything else: chunked prefill, prefix hits, mixed batches; a mixed
step's decode rows with DECODE_ROWS_SPLIT_CONTEXT tokens of context or more go through paged decode first, with
split-KV, and the prefill kernel skips them).

KV cache dtypes (voltllm.attention.kv_spec): fp16/bf16/fp32, or fp8 (E4M3/E5M2) stored as uint8 with the
layer's k_scale/v_scale: the write encodes in software (voltllm.kernels.kv_fp8), decode and prefill kernels
decode the codes in registers (integer ops, no fp8 types: the same kernels on sm_70 and sm_90).

Two routes:
  native (tensor cores, sm_80+): decode with tl.dot; prefill with the paged Triton prefill kernel.
  compat (use_tensor_cores=False: sm_70/75 or `--compat`): decode on CUDA-core FMA; prefill rows of a
    request with more than one query row through torch SDPA's efficient-attention kernel (SM70 tensor
    cores) after bridging its pages into a reused fp16 workspace (voltllm.attention.compat_backend);
    decode rows of mixed batches through the FMA decode kernel.

No host syncs: grids come from host ints (q.shape, len(seq_lens), meta.max_query_len, meta.max_seq_len).
Decode is CUDA-graph capturable: for a fixed batch size and a fixed meta.max_seq_len bound the grid is
fixed, and each program sizes its split-KV slice from the actual seq_len on the device, so shorter
contexts only leave trailing partitions empty (they contribute weight 0 to the reduction).
Per call it allocates only the output; the split-KV scratch is kept and grown on demand (call
`reserve()` before CUDA-graph capture so that capture never has to grow it).
"""
from __future__ import annotations

from typing import Optional

import torch

from voltllm.attention.backend import AttentionBackend, AttentionMetadata, CacheWrite, DecodeRope
from voltllm.attention.compat_backend import SDPAPrefill
from voltllm.attention.kv_spec import FP8_KV_DTYPES, unit_scale
from voltllm.kernels.attention import (choose_num_splits, decode_scratch_numel, kv_write, paged_decode,
                                       paged_prefill)
from voltllm.kernels.attention.paged_decode import FMA_LANES_DEFAULT
from voltllm.kernels.fp8_codec import FP8_E4M3, FP8_E4M3_HW

_SUPPORTED_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.uint8)
# Pure-decode steps on CUDA may run QK-norm + RoPE + the KV store inside the decode kernel (DecodeRope) instead of a
# RoPE launch before it: one kernel less per layer. Off: on the H200 it was slower everywhere it was measured, in the
# same call as the separate launch (benchmarks/results/*-277ea2b.json, *-a23fe44.json): 64 concurrent x 128 / 128
# 9,443 vs 9,528 output tok/s, 8B batch 1 228.8 vs 230.2 tok/s, SmolLM2's shape at batch 1 1,317 vs 1,708. The
# decode kernel then waits for q and the new K before its first tile's dot, where the RoPE launch overlaps its
# predecessor's tail under PDL. Measured again in session 41, after the kernel's K / V loads were pipelined and with
# its first tile loaded before the PDL wait (benchmarks/results/session41/fused-rope-bc08d6a/): 64 x 128/128 9,140 /
# 9,039 fused vs 9,143 / 9,092 separate, batch 1 8B 226.3 vs 225.6, SmolLM2's shape 1,551 vs 1,755: still off.
# Session 74, with the 64-row qkv projection a Triton PDL kernel (H100, results/session74/s174a-13a9b14a/): TPOT 6.573
# fused vs 6.558 / 6.567 separate, no gain. When on, only below FUSED_DECODE_ROPE_MAX_PROGRAMS sequences x kv heads.
FUSED_DECODE_ROPE = False
FUSED_DECODE_ROPE_MAX_PROGRAMS = 128
# fp8 caches on CUDA: the RoPE launch may encode K / V into the cache (CacheWrite.fmt) instead of a separate write
# launch (voltllm.kernels.kv_fp8.write_kv_fp8). Off: slower on the H200 in the same call (8B, 64 x 128 / 128,
# fp8_e4m3 KV, benchmarks/results/*-kv-fp8_e4m3-store{1,0}-b51912c.json): 9,013 vs 9,137 output tok/s; the RoPE
# launch took 277 us per step with the encode against 100 + 93 for RoPE + the write kernel. docs/kernels.md, "Session 11".
FUSED_FP8_STORE = False
# Mixed steps: decode rows (one query row) with at least this much context are attended by the decode kernel with
# split-KV, and the prefill kernel leaves them alone; below it the prefill kernel takes them with the rest (one
# program per sequence and kv head walks the whole context there: a long-context decode row in a step with a prompt
# chunk would otherwise take one SM through, e.g., 51 MB of a 100K-token context per kv head and layer).
DECODE_ROWS_SPLIT_CONTEXT = 2048


class TritonAttentionBackend(AttentionBackend):
    name = "TRITON_ATTN"

    def __init__(self, use_tensor_cores: Optional[bool] = None, num_sms: Optional[int] = None,
                 max_splits: Optional[int] = None, fma_lanes: Optional[bool] = None,
                 kv_cache_dtype: str = "auto", max_context: Optional[int] = None,
                 compat_prefill: Optional[bool] = None,
                 decode_rows_split_context: int = DECODE_ROWS_SPLIT_CONTEXT) -> None:
        """use_tensor_cores: decode inner products with tl.dot (None: yes on sm_80+, no on sm_70/75 and
        on the CPU interpreter; False forces the FMA route, as `--compat sm70` does on any GPU).
        num_sms: SM count for the split-KV heuristic (None: read from the device).
        max_splits: cap on split-KV partitions (None: the kernel module's default).
        fma_lanes: FMA-route decode variant (None: FMA_LANES_DEFAULT; see paged_decode.py).
        kv_cache_dtype: the --kv-cache-dtype value; names the fp8 format of a uint8 cache.
        max_context: longest context (--max-model-len), sizes the compat prefill workspace once.
        compat_prefill: prefill through bridge + SDPA (None: when use_tensor_cores is False or the GPU is
        sm_70/75; the CPU interpreter keeps the Triton prefill kernel unless use_tensor_cores=False).
        decode_rows_split_context: a mixed step's decode rows with this much context or more go through the
        decode kernel with split-KV (DECODE_ROWS_SPLIT_CONTEXT)."""
        self.use_tensor_cores = use_tensor_cores
        self.num_sms = num_sms
        self.max_splits = max_splits
        self.fma_lanes = FMA_LANES_DEFAULT if fma_lanes is None else fma_lanes
        self.kv_cache_dtype = kv_cache_dtype
        fmt = FP8_KV_DTYPES.get((kv_cache_dtype or "auto").lower())
        self.kv_fmt = -1 if fmt is None else (0 if fmt == "e4m3" else 1)
        self.compat_prefill = compat_prefill
        self.decode_rows_split_context = decode_rows_split_context
        self.sdpa_prefill = SDPAPrefill(max_context)
        self._dev_info: dict[str, tuple[Optional[tuple[int, int]], int]] = {}
        self._scratch: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # scratch outgrown by a larger reservation: a CUDA graph captured before still reads and writes it on replay
        # (freed, its memory could go to anything, or back to the driver: an illegal address)
        self._retired_scratch: list[tuple[torch.Tensor, torch.Tensor]] = []

    def limit_context(self, max_context: int) -> None:
        self.sdpa_prefill.limit_context(max_context)

    def workspace_bytes(self) -> int:
        return self.sdpa_prefill.workspace_bytes()

    # --- device facts and scratch -------------------------------------------------------------
    def _device_info(self, device: torch.device) -> tuple[Optional[tuple[int, int]], int]:
        key = str(device)
        info = self._dev_info.get(key)
        if info is None:
            if device.type == "cuda":
                props = torch.cuda.get_device_properties(device)
                info = ((props.major, props.minor), props.multi_processor_count)
            else:
                info = (None, 1)
            self._dev_info[key] = info
        return info

    def _get_scratch(self, device: torch.device, numel_o: int, numel_l: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = str(device)
        cur = self._scratch.get(key)
        if cur is None or cur[0].numel() < numel_o or cur[1].numel() < numel_l:
            old_o = cur[0].numel() if cur else 0
            old_l = cur[1].numel() if cur else 0
            if cur is not None:
                self._retired_scratch.append(cur)
            cur = (torch.empty(max(numel_o, old_o), dtype=torch.float32, device=device),
                   torch.empty(max(numel_l, old_l), dtype=torch.float32, device=device))
            self._scratch[key] = cur
        return cur

    def num_splits_for(self, num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
        _, sms = self._device_info(device)
        splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, self.num_sms or sms)
        if self.max_splits is not None:
            splits = max(1, min(splits, self.max_splits))
        return splits

    def reserve(self, max_num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
                device: torch.device) -> None:
        """Allocate split-KV scratch for every decode batch size up to max_num_seqs (before graph capture)."""
        need_o = need_l = 0
        for b in range(1, max_num_seqs + 1):
            splits = self.num_splits_for(b, num_kv_heads, max_seq_len, device)
            if splits > 1:
                o, l = decode_scratch_numel(b, num_heads, splits, head_dim)
                need_o, need_l = max(need_o, o), max(need_l, l)
        if need_o:
            self._get_scratch(device, need_o, need_l)

    def _use_dot(self, device: torch.device) -> bool:
        if self.use_tensor_cores is not None:
            return self.use_tensor_cores
        cap, _ = self._device_info(device)
        return cap is not None and cap >= (8, 0)

    def _kernel_fmt(self, fmt: int, device: torch.device) -> int:
        """The format the attention kernels read an fp8 cache with and the RoPE launch's store encodes it with: E4M3
        through the GPU's own conversions where the native route runs on sm_89+ (the software decode's integer ops
        cost more than the bytes fp8 saves there: benchmarks/results/attn-decode-fma-fp8-6bd4389.txt), else the
        software codec. The same codes and values either way."""
        if fmt != FP8_E4M3 or not self._use_dot(device):  # (the compat route asks no device facts)
            return fmt
        cap, _ = self._device_info(device)
        return FP8_E4M3_HW if cap is not None and cap >= (8, 9) else fmt

    def _use_sdpa_prefill(self, device: torch.device) -> bool:
        if self.compat_prefill is not None:
            return self.compat_prefill
        if self.use_tensor_cores is not None:
            return not self.use_tensor_cores
        cap, _ = self._device_info(device)
        return cap is not None and cap < (8, 0)  # the CPU interpreter keeps the Triton prefill kernel

    def routes(self, device: torch.device) -> dict[str, str]:
        """Which kernels this backend runs on `device` (for reports and tests)."""
        dot = self._use_dot(device)
        kv = "fp16/bf16/fp32" if self.kv_fmt < 0 else ("fp8_e4m3" if self.kv_fmt == 0 else "fp8_e5m2")
        if self.kv_fmt >= 0:
            hw = self._kernel_fmt(self.kv_fmt, device) == FP8_E4M3_HW
            kv += " (uint8 pages; " + ("hardware" if hw else "software") + " codec)"
        return {
            "kv_cache": kv,
            "decode": "triton paged decode, " + ("tl.dot (tensor cores)" if dot else "CUDA-core FMA"),
            "prefill": ("bridge to fp16 workspace + torch SDPA efficient attention (requests joined, varlen)"
                        if self._use_sdpa_prefill(device) else "triton paged prefill (tl.dot)"),
        }

    # --- forward ---------------------------------------------------------------------------------
    def cache_write_for(self, v, kv_cache, meta: AttentionMetadata, k_scale: Optional[torch.Tensor] = None,
                        v_scale: Optional[torch.Tensor] = None) -> Optional[CacheWrite]:
        """Caches on CUDA: K/V are stored by the RoPE launch (fp8: encoded there with the layer's scales, as the
        codec's write kernel would)."""
        if not kv_cache.is_cuda:
            return None
        if kv_cache.dtype in (torch.float16, torch.bfloat16, torch.float32):
            return CacheWrite(v, kv_cache, meta.slot_mapping)
        if kv_cache.dtype == torch.uint8 and self.kv_fmt >= 0 and FUSED_FP8_STORE:
            one = unit_scale(kv_cache.device)
            return CacheWrite(v, kv_cache, meta.slot_mapping, self._kernel_fmt(self.kv_fmt, kv_cache.device),
                              one if k_scale is None else k_scale, one if v_scale is None else v_scale)
        return None

    def fuses_decode_rope(self, q, kv_cache, meta: AttentionMetadata, rotary_dim: int) -> bool:
        d = q.shape[-1]
        return (FUSED_DECODE_ROPE and q.is_cuda and meta.is_pure_decode and rotary_dim == d and d & (d - 1) == 0
                and meta.seq_lens.shape[0] * kv_cache.shape[3] < FUSED_DECODE_ROPE_MAX_PROGRAMS
                and q.dtype in (torch.float16, torch.bfloat16) and kv_cache.dtype in (q.dtype, torch.uint8))

    def _cache_format(self, kv_cache, k_scale, v_scale, device):
        """(fp8 format or -1, k_scale, v_scale): fp8 caches get persistent fp32 scalars (the layer's buffers, or a
        cached 1.0), so launches stay graph-capture safe."""
        if kv_cache.dtype not in _SUPPORTED_CACHE_DTYPES:
            raise NotImplementedError(f"{self.name}: KV cache dtype {kv_cache.dtype} is not supported")
        if kv_cache.dtype != torch.uint8:
            return -1, k_scale, v_scale
        if self.kv_fmt < 0:
            raise ValueError(f"{self.name}: a uint8 (fp8) KV cache needs kv_cache_dtype fp8_e4m3 or "
                             f"fp8_e5m2, got {self.kv_cache_dtype!r}")
        return (self.kv_fmt, unit_scale(device) if k_scale is None else k_scale,
                unit_scale(device) if v_scale is None else v_scale)

    def write_kv(self, k, v, kv_cache, meta: AttentionMetadata, k_scale: Optional[torch.Tensor] = None,
                 v_scale: Optional[torch.Tensor] = None) -> None:
        """Store this step's K / V rows at meta.slot_mapping (fp8 caches: encoded with the layer's scales)."""
        fmt, k_scale, v_scale = self._cache_format(kv_cache, k_scale, v_scale, k.device)
        n = min(k.shape[0], meta.slot_mapping.shape[0])
        if fmt >= 0:
            from voltllm.kernels.kv_fp8 import write_kv_fp8

            write_kv_fp8(k[:n], v[:n], kv_cache, meta.slot_mapping, k_scale, v_scale, fmt, use_triton=True)
        else:
            kv_write(k[:n], v[:n], kv_cache, meta.slot_mapping)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float,
                k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
                kv_written: bool = False, rope: Optional[DecodeRope] = None, out: Optional[torch.Tensor] = None,
                window: int = 0, query_positions: Optional[torch.Tensor] = None):
        """The contract's forward; `out` (q's shape and dtype, contiguous): write the result there (prompt graphs'
        static buffer) instead of a new tensor."""
        fmt, k_scale, v_scale = self._cache_format(kv_cache, k_scale, v_scale, q.device)
        t = q.shape[0]
        if rope is not None and not meta.is_pure_decode:
            raise ValueError(f"{self.name}: a DecodeRope is for pure-decode steps only")
        if not kv_written and rope is None:  # (else the model's RoPE launch or the decode kernel stores them)
            self.write_kv(k, v, kv_cache, meta, k_scale, v_scale)

        if q.stride(-1) != 1:
            q = q.contiguous()
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
            raise ValueError(f"{self.name}: out must be a contiguous {tuple(q.shape)} {q.dtype} tensor, got "
                             f"{tuple(out.shape)} {out.dtype}")
        num_seqs = meta.seq_lens.shape[0]
        use_dot = self._use_dot(q.device)
        num_sms = self.num_sms or self._device_info(q.device)[1]
        read_fmt = self._kernel_fmt(fmt, q.device)
        win = (window, query_positions)
        if num_seqs > 0 and meta.is_pure_decode:
            self._decode_rows(q, kv_cache, meta, scale, out, use_dot, read_fmt, k_scale, v_scale, num_sms, rope, win)
        elif num_seqs > 0 and self._use_sdpa_prefill(q.device):
            if meta.longest_one_row_context >= 0:
                # decode rows of a mixed batch: the FMA decode kernel writes every sequence's last row;
                # rows of multi-row sequences are then overwritten by SDPA
                self._decode_rows(q, kv_cache, meta, scale, out, use_dot, read_fmt, k_scale, v_scale, num_sms,
                                  win=win)
            self.sdpa_prefill.forward(q, kv_cache, meta, scale, out, k_scale, v_scale, fmt, window=window)
        elif num_seqs > 0:
            cap, _ = self._device_info(q.device)
            # one-row sequences whose rows see past their own position (query_positions) go through the decode
            # kernel, which reads those positions; so do long-context decode rows (they get split-KV there); the
            # prefill kernel then skips one-row sequences
            decode_first = (meta.longest_one_row_context >= self.decode_rows_split_context
                            or (window > 0 and query_positions is not None and meta.longest_one_row_context >= 0))
            if decode_first:
                self._decode_rows(q, kv_cache, meta, scale, out, use_dot, read_fmt, k_scale, v_scale, num_sms,
                                  win=win)
            paged_prefill(q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, out,
                          max_query_len=meta.max_query_len, capability=cap, kv_fmt=read_fmt, k_scale=k_scale,
                          v_scale=v_scale, min_query_len=2 if decode_first else 1, window=window)
        if meta.num_tokens < t:
            out[meta.num_tokens:].zero_()
        return out

    def _decode_rows(self, q, kv_cache, meta: AttentionMetadata, scale, out, use_dot, read_fmt, k_scale, v_scale,
                     num_sms, rope: Optional[DecodeRope] = None, win: tuple = (0, None)) -> None:
        """Every sequence's last query row through the decode kernel, with split-KV when the grid would not fill the
        GPU: a pure-decode step (with its DecodeRope, if any), or a mixed step's decode rows (its rows of multi-row
        sequences are overwritten by the prefill that follows)."""
        num_seqs = meta.seq_lens.shape[0]
        splits = self.num_splits_for(num_seqs, kv_cache.shape[3], meta.max_seq_len, q.device)
        part_o = part_lse = None
        if splits > 1:
            need_o, need_l = decode_scratch_numel(num_seqs, q.shape[1], splits, q.shape[2])
            part_o, part_lse = self._get_scratch(q.device, need_o, need_l)
        paged_decode(q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, out,
                     num_splits=splits, part_o=part_o, part_lse=part_lse, use_dot=use_dot,
                     fma_lanes=self.fma_lanes and not use_dot, kv_fmt=read_fmt, k_scale=k_scale, v_scale=v_scale,
                     rope=rope, slot_mapping=meta.slot_mapping, num_sms=num_sms, window=win[0],
                     query_positions=win[1])
