"""Gated DeltaNet layer (the linear-attention layer of Qwen3-Next / Qwen3.5), over per-request state slots.

    [q k v z b a] = x W_in                     one merged GEMM; q, k: Hk heads of Dk; v, z: Hv heads of Dv
    q, k, v       = silu(causal_conv1d([q k v]))   depthwise, kernel K, state = the last K-1 inputs
    beta          = sigmoid(b)
    g             = -exp(A_log) * softplus(a + dt_bias)        (log decay, <= 0)
    o             = gated_delta_rule(l2norm(q) / sqrt(Dk), l2norm(k), v, g, beta)   fp32 state [Hv, Dk, Dv]
    y             = (rmsnorm(o) * w_norm * act(z)) W_out        (per value head; act: silu, or sigmoid for a
                                                            Qwen4-Exp output_gate_type "sigmoid": torch form)

Checkpoint layouts: Qwen3.5 stores in_proj_qkv / in_proj_z / in_proj_b / in_proj_a (flat, [q|k|v]);
Qwen3-Next stores in_proj_qkvz / in_proj_ba grouped by key head ([q_g k_g v_g z_g] for each key head g,
then [b_g a_g]); both are loaded into the same flat merged weight here.

State: ctx.extra["state_cache"] (voltllm.model.state_cache.StateCache) and ctx.extra["state_slots"]
(one slot per request, batch order: a host list, or a device tensor for CUDA graphs); see HybridBatch.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from voltllm.distributed.sharding import even_split, take_cols, take_rows
from voltllm.host_to_device import to_device
from voltllm.kernels import gdn_ref
from voltllm.model.forward_context import ForwardContext
from voltllm.model.layers.linear import Linear, LinearMethod
from voltllm.model.layers.quantized_linear import split_rows

# tokens: with exact fp32 ("ieee") products, a step whose every request computes at least this many runs the
# torch chunked form (GatedDeltaNet._triton_prefill_fits)
LONG_PREFILL_TOKENS = 256
# devices where the Triton chunk kernels found no tile that fits their shared memory (GatedDeltaNet._chunk_kernels)
_CHUNK_UNFIT_DEVICES: set = set()
logger = logging.getLogger("voltllm")


@dataclass
class HybridBatch:
    """What every GDN layer needs about the step's batch, built once per forward."""
    state_cache: Any  # StateCache
    slots: torch.Tensor  # long [num_seqs], device
    has_initial_state: torch.Tensor  # bool [num_seqs], device: tokens were computed before this step
    query_start_loc: list[int]
    decode_only: bool  # every request has exactly one query row
    chunk_meta: Any = field(default=None, repr=False)  # Triton chunked prefill's chunk table, built once a step
    conv_plan: Any = field(default=None, repr=False)  # gdn_ref.ConvPlan of a non-decode step, built once a step
    conv_tiles: Any = field(default=None, repr=False)  # gdn_conv.ConvTiles (Triton prefill conv), built once a step
    # a mixed step's one-row requests vs the rest (RowSplit, built once a step; False: nothing to split)
    row_split: Any = field(default=None, repr=False)
    # a speculative verification step (ctx.extra["state_drafts"]): each request's draft count, its slot and
    # whether it resumes a state (host), and the layers' split of the batch (gdn_verify.VerifyRows, built once)
    drafts: Optional[list] = field(default=None, repr=False)
    host_rows: Any = field(default=None, repr=False)
    verify: Any = field(default=None, repr=False)
    # a verification replayed as decode rows (CUDA graphs: ctx.extra["state_walks"]): per row, the start and end
    # (int32, device) of the rows its walk runs, empty but on each request's first row; and the same step regrouped
    # by request for the torch path (regrouped(), the CPU's stand-in of such a graph)
    walks: Any = field(default=None, repr=False)
    regroup: Any = field(default=None, repr=False)

    def regrouped(self) -> "HybridBatch":
        """This walks step as an eager verification step: one request per non-empty walk (host reads: not for a
        graph capture; the Triton path runs the walks as they are)."""
        if self.regroup is None:
            starts, ends = (w.tolist() for w in self.walks)
            firsts = [i for i in range(len(starts)) if ends[i] > starts[i]]
            qsl = [0]
            for i in firsts:
                if starts[i] != qsl[-1]:
                    raise RuntimeError("the walks of a verification step must cover its rows in order")
                qsl.append(ends[i])
            idx = to_device(firsts, torch.long, self.slots.device)
            slots, init = self.slots.index_select(0, idx), self.has_initial_state.index_select(0, idx)
            batch = HybridBatch(self.state_cache, slots, init, qsl, decode_only=len(firsts) == qsl[-1])
            drafts = [ends[i] - starts[i] - 1 for i in firsts]
            if any(drafts):
                batch.drafts, batch.host_rows = drafts, (slots.tolist(), init.tolist())
            self.regroup = batch
        return self.regroup

    def verify_rows(self, kernel: int) -> Any:
        """The step's gdn_verify.VerifyRows (None: not a verification step)."""
        if self.drafts is None:
            return None
        if self.verify is None:
            from voltllm.model.layers.gdn_verify import VerifyRows

            self.verify = VerifyRows.build(self, self.drafts, *self.host_rows, kernel)
        return self.verify

    def split_rows(self) -> Optional["RowSplit"]:
        """The step's requests of one query row (decode rows, one-token prompt chunks) apart from the others,
        when it has both; None otherwise."""
        if self.row_split is None:
            self.row_split = RowSplit.of(self) or False
        return self.row_split or None

    @classmethod
    def from_context(cls, ctx: ForwardContext, spec: Any = None) -> "HybridBatch":
        """ctx.extra["state_slots"]: one slot per request of the metadata (-1 = padding row);
        ctx.extra["state_drafts"] (a speculative verification step): each request's draft count (its last rows).
        Without ctx.extra["state_cache"] (memory profiling, warm-up) every request must start at token 0:
        a throwaway cache is made from `spec` (the model's state_spec).
        A long tensor on the cache's device instead of a list (CUDA graphs) is used as is: its rows are
        resolved slots (padding rows = cache.pad_slot), and the caller does the host-side checks and
        bookkeeping (cache.note_step) itself, since a graph replay runs none of this Python."""
        meta = ctx.meta
        qsl = list(meta.query_start_loc_cpu)
        n = meta.num_seqs
        slots = ctx.extra.get("state_slots")
        drafts = ctx.extra.get("state_drafts")
        if isinstance(slots, torch.Tensor) and "state_cache" in ctx.extra:
            if drafts is not None:
                raise RuntimeError("a hybrid's verification in a CUDA graph comes as walks (state_walks)")
            batch = cls._from_device_slots(ctx.extra["state_cache"], slots, meta, qsl)
            batch.walks = ctx.extra.get("state_walks")
            return batch
        ends = list(meta.seq_lens_cpu)
        starts = [ends[i] - (qsl[i + 1] - qsl[i]) for i in range(n)]
        cache = ctx.extra.get("state_cache")
        if cache is None:
            if any(starts) or spec is None:
                raise RuntimeError("hybrid model: ForwardContext.extra needs 'state_cache' (a StateCache) and "
                                   "'state_slots' (one slot per request in batch order)")
            from voltllm.model.state_cache import StateCache

            device = ctx.kv_caches[0].device if ctx.kv_caches else torch.device("cpu")
            cache = StateCache.from_spec(spec, max(n, 1), device)
            slots = list(range(n))
        else:
            if slots is None:
                raise RuntimeError("hybrid model: ForwardContext.extra['state_slots'] is missing")
            slots = [int(x) for x in slots]
        if len(slots) != n:
            raise ValueError(f"state_slots has {len(slots)} entries for {n} requests")
        cache.note_step(slots, starts, ends)
        device = cache.ssm[0].device if cache.ssm else torch.device("cpu")
        init = [starts[i] > 0 and slots[i] >= 0 for i in range(n)]
        rows = [x if x >= 0 else cache.pad_slot for x in slots]
        batch = cls(state_cache=cache, slots=to_device(rows, torch.long, device),
                    has_initial_state=to_device(init, torch.bool, device),
                    query_start_loc=qsl, decode_only=all(qsl[i + 1] - qsl[i] == 1 for i in range(n)))
        if drafts is not None and any(drafts):
            batch.drafts, batch.host_rows = list(drafts), (rows, init)
        return batch

    @classmethod
    def _from_device_slots(cls, cache: Any, slots: torch.Tensor, meta: Any, qsl: list[int]) -> "HybridBatch":
        """Device ops only (no host sync, no shape from device data), so a CUDA graph can capture it."""
        if slots.shape[0] != meta.num_seqs:
            raise ValueError(f"state_slots has {slots.shape[0]} entries for {meta.num_seqs} requests")
        # a request has a state to resume iff tokens were computed before this step; padding rows
        # (seq_len 1, one query row) do not
        q_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
        init = (meta.seq_lens - q_lens) > 0
        return cls(state_cache=cache, slots=slots, has_initial_state=init, query_start_loc=qsl,
                   decode_only=all(qsl[i + 1] - qsl[i] == 1 for i in range(len(qsl) - 1)))


@dataclass
class RowSplit:
    """A mixed step cut in two for the delta rule: its one-row requests run the decode kernel (one recurrent step
    each) and the rest the chunked form, instead of one 64-row chunk (workspace, inverse, products) per decode
    row. Token and request indices on the device, uploaded once; `rest` is the HybridBatch of the other requests
    (their tokens packed in order), shared by every GDN layer of the step."""
    one_tokens: torch.Tensor  # long [m]: the one-row requests' tokens
    one_requests: torch.Tensor  # long [m]: their request indices
    rest_tokens: torch.Tensor  # long [T']: the other requests' tokens, in order
    rest: "HybridBatch"

    @classmethod
    def of(cls, batch: "HybridBatch") -> Optional["RowSplit"]:
        qsl = batch.query_start_loc
        n = len(qsl) - 1
        one = [i for i in range(n) if qsl[i + 1] - qsl[i] == 1]
        if not one or len(one) == n:
            return None
        others = [i for i in range(n) if qsl[i + 1] - qsl[i] != 1]
        rest_tokens, rest_qsl = [], [0]
        for i in others:
            rest_tokens.extend(range(qsl[i], qsl[i + 1]))
            rest_qsl.append(len(rest_tokens))
        one_tokens = [qsl[i] for i in one]
        m, r = len(one), len(rest_tokens)
        flat = to_device(one_tokens + one + rest_tokens + others, torch.long, batch.slots.device)
        rest_req = flat[2 * m + r:]
        rest = HybridBatch(state_cache=batch.state_cache, slots=batch.slots.index_select(0, rest_req),
                           has_initial_state=batch.has_initial_state.index_select(0, rest_req),
                           query_start_loc=rest_qsl, decode_only=False)
        return cls(flat[:m], flat[m:2 * m], flat[2 * m:2 * m + r], rest)


def gate_activation(cfg: Any) -> str:
    """The GDN output gate's activation: Qwen4-Exp's output_gate_type, else hidden_act (silu / swish)."""
    act = getattr(cfg, "output_gate_type", None) or getattr(cfg, "hidden_act", "silu")
    act = "silu" if act == "swish" else act
    if act not in ("silu", "sigmoid"):
        raise ValueError(f"Gated DeltaNet output gate activation {act!r} is not supported (silu or sigmoid)")
    return act


def set_chunk_precision(model: nn.Module, precision: str) -> int:
    """Set every GDN layer's chunk-kernel dot precision; returns how many layers there are."""
    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    for m in layers:
        m.chunk_precision = precision
    return len(layers)


def in_proj_pieces(module: str, nk: int, nv: int, dk: int, dv: int) -> list[tuple[int, Optional[torch.Tensor]]]:
    """Where the rows of a checkpoint's in_proj_* projection (`module`, the transformers name) land in our merged
    in_proj: [(shard, its rows of the module in the shard's order; None: all of them)], [] for another name. The
    checkpoint loader and LoRA (lora/adapter.py: B's rows follow the weight's) both go by it. Shards: 0 q, 1 k, 2 v,
    3 z (Hk x Dk, Hk x Dk, Hv x Dv, Hv x Dv), 4 b, 5 a (one row per value head)."""
    kd, vd, r = nk * dk, nv * dv, nv // nk
    if module == "in_proj_qkv":  # Qwen3.5: flat [q | k | v]
        return list(zip((0, 1, 2), torch.arange(2 * kd + vd).split([kd, kd, vd])))
    if module in ("in_proj_z", "in_proj_b", "in_proj_a"):
        return [({"in_proj_z": 3, "in_proj_b": 4, "in_proj_a": 5}[module], None)]
    if module == "in_proj_qkvz":  # Qwen3-Next: per key head g, [q_g k_g v_g z_g]
        grouped = torch.arange(nk * (2 * dk + 2 * r * dv)).reshape(nk, -1)
        return [(i, part.reshape(-1)) for i, part in enumerate(grouped.split([dk, dk, r * dv, r * dv], dim=1))]
    if module == "in_proj_ba":  # Qwen3-Next: per key head g, [b_g a_g]
        b, a = torch.arange(2 * nv).reshape(nk, 2 * r).split([r, r], dim=1)
        return [(4, b.reshape(-1)), (5, a.reshape(-1))]
    return []


class GatedDeltaNet(nn.Module):
    # Decode batches (one row per request, CUDA-graph padding rows included) use the Triton kernels of
    # voltllm/kernels/gdn_decode.py: None = on CUDA tensors only (tests set True to run them interpreted).
    triton_decode: bool | None = None
    # Other batches' causal conv1d through voltllm/kernels/gdn_conv.py: None = on CUDA tensors; True / False force it.
    triton_conv: bool | None = None
    # The gated output norm through voltllm.kernels.fused.gated_rms_norm_heads: None = on CUDA tensors.
    triton_norm: bool | None = None
    # Other batches (prefill chunks, mixed prefill + decode) run the delta rule through the chunked Triton
    # kernels of voltllm/kernels/gdn_chunk.py: None = on CUDA tensors, except, with "ieee" products, a step of
    # long prompts only (_triton_prefill_fits); True / False force it.
    triton_prefill: bool | None = None
    # The chunk kernels' dot precision ("ieee", "tf32x3" or "tf32", gdn_chunk.precision_for): the runner sets it
    # per layer for its route (set_chunk_precision); "ieee", exact fp32 FMA products, unless told otherwise.
    chunk_precision: str = "ieee"

    def __init__(self, cfg: Any, state_index: int, dtype: torch.dtype, layout: str = "split",
                 linear_method: Optional[LinearMethod] = None, tp=None):
        """linear_method: how in_proj / out_proj hold their weights (quantized checkpoints kept quantized); None:
        dense. tp (a voltllm.distributed.group.TPGroup): this rank holds key heads [k_start, k_start + nk) and the
        value heads that read them, [v_start, v_start + nv) (value head h reads key head h // (Hv / Hk), so an even
        split of both keeps each rank's heads together); nk / nv and every shape below are the local ones, and
        out_proj's partial product is summed over the ranks by the caller (HybridDecoderLayer)."""
        super().__init__()
        if layout not in ("split", "qkvz"):
            raise ValueError(f"unknown GDN checkpoint layout {layout!r}")
        self.state_index = state_index
        self.layout = layout
        self.full_nk = cfg.linear_num_key_heads
        self.full_nv = cfg.linear_num_value_heads
        self.dk = cfg.linear_key_head_dim
        self.dv = cfg.linear_value_head_dim
        if self.full_nv % self.full_nk:
            raise ValueError(f"linear_num_value_heads {self.full_nv} must be a multiple of linear_num_key_heads "
                             f"{self.full_nk}")
        self.tp = tp
        rank, size = (tp.rank, tp.size) if tp is not None else (0, 1)
        if self.full_nk % size:
            raise ValueError(f"{self.full_nk} Gated DeltaNet key heads do not divide by {size} tensor-parallel ranks")
        self.k_start, self.nk = even_split(self.full_nk, rank, size)
        self.v_start, self.nv = even_split(self.full_nv, rank, size)
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        act = getattr(cfg, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"GDN conv activation {act!r} is not supported")
        h = cfg.hidden_size
        self.in_proj = Linear(h, [self.key_dim, self.key_dim, self.value_dim, self.value_dim, self.nv, self.nv],
                              dtype=dtype, method=linear_method)
        self.conv_weight = nn.Parameter(torch.zeros(self.conv_dim, self.kernel, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.nv, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.ones(self.nv, dtype=torch.float32), requires_grad=False)
        self.norm_weight = nn.Parameter(torch.ones(self.dv, dtype=torch.float32), requires_grad=False)
        self.eps = cfg.rms_norm_eps
        self.out_proj = Linear(self.value_dim, h, dtype=dtype, method=linear_method)
        # the output gate's activation: silu (Qwen3-Next / Qwen3.5); Qwen4-Exp may say sigmoid (output_gate_type)
        self.gate_act = gate_activation(cfg)

    # -- state shapes (for the StateCache) -------------------------------------------------------
    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.kernel - 1, self.conv_dim)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return (self.nv, self.dk, self.dv)

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, batch: HybridBatch) -> torch.Tensor:
        t = x.shape[0]
        proj = self.in_proj(x)
        mixed = proj[:, : self.conv_dim]
        z = proj[:, self.conv_dim: self.conv_dim + self.value_dim]
        b = proj[:, self.conv_dim + self.value_dim: self.conv_dim + self.value_dim + self.nv]
        a = proj[:, self.conv_dim + self.value_dim + self.nv:]

        cache = batch.state_cache
        conv_states = cache.conv[self.state_index]
        ssm_states = cache.ssm[self.state_index]
        use_triton = x.is_cuda if self.triton_decode is None else self.triton_decode
        if batch.walks is not None:  # a verification as decode rows (a CUDA graph's form)
            if use_triton and batch.decode_only and t == len(batch.query_start_loc) - 1:
                return self._walks(x, mixed, z, a, b, batch)
            batch = batch.regrouped()  # (the torch path: by request)
        fast = use_triton and batch.decode_only and t == len(batch.query_start_loc) - 1
        verify = batch.verify_rows(self.kernel)  # a speculative verification step (None: not one)
        if verify is not None:  # the drafting requests' conv states per position, before the conv moves on
            verify.save_conv_checkpoints(mixed, conv_states, cache.conv_rows[self.state_index])
        if fast:  # Triton decode kernels (voltllm/kernels/gdn_decode.py)
            from voltllm.kernels import gdn_decode
            mixed = gdn_decode.causal_conv1d_decode(mixed, self.conv_weight, None, conv_states, batch.slots,
                                                    batch.has_initial_state, "silu")
        elif not batch.decode_only and (x.is_cuda if self.triton_conv is None else self.triton_conv):
            from voltllm.kernels import gdn_conv
            if batch.conv_tiles is None:
                batch.conv_tiles = gdn_conv.conv_tiles(batch.query_start_loc, batch.has_initial_state)
            mixed = gdn_conv.causal_conv1d_prefill(mixed, self.conv_weight, None, conv_states, batch.slots,
                                                   batch.query_start_loc, batch.has_initial_state, "silu",
                                                   tiles=batch.conv_tiles)
        else:
            if batch.conv_plan is None and not batch.decode_only:
                batch.conv_plan = gdn_ref.conv_plan(batch.query_start_loc, self.kernel, mixed.device)
            mixed = gdn_ref.causal_conv1d_varlen(mixed, self.conv_weight, None, conv_states, batch.slots,
                                                 batch.query_start_loc, batch.has_initial_state, "silu",
                                                 batch.decode_only, plan=batch.conv_plan)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(t, self.nk, self.dk)
        k = k.reshape(t, self.nk, self.dk)
        v = v.reshape(t, self.nv, self.dv)
        if fast:  # the kernel computes g and beta from a and b itself (no elementwise launches per step)
            o = gdn_decode.gated_delta_rule_decode(q, k, v, a, b, ssm_states, batch.slots, batch.has_initial_state,
                                                   gate_params=(self.A_log, self.dt_bias))
            return self.out_proj(self._gated_norm(o, z.reshape(t, self.nv, self.dv)).reshape(t, self.value_dim))
        beta = torch.sigmoid(b.float())
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        split = batch.split_rows() if use_triton and not batch.decode_only and verify is None else None
        if verify is not None:  # decode rows and drafting requests token by token, prompt chunks chunked
            o = torch.zeros(t, self.nv, self.dv, dtype=v.dtype, device=v.device)
            o.index_copy_(0, verify.walk_tokens, verify.delta_rule(q, k, v, g, beta, cache, self.state_index,
                                                                   use_triton))
            if verify.rest is not None:
                rt = verify.rest_tokens
                o.index_copy_(0, rt, self._delta_rule(
                    x, q.index_select(0, rt), k.index_select(0, rt), v.index_select(0, rt), g.index_select(0, rt),
                    beta.index_select(0, rt), ssm_states, verify.rest))
        elif split is not None:  # decode rows through the decode kernel, the other requests through the chunked form
            from voltllm.kernels import gdn_decode
            o = torch.zeros(t, self.nv, self.dv, dtype=v.dtype, device=v.device)  # (padding tokens stay zero)
            ot, orq, rt = split.one_tokens, split.one_requests, split.rest_tokens
            # raw a / b with the gate parameters, as the decode graphs' steps: the kernel variant they compiled
            # (fp32 g / beta here compiled another inside the first mixed step), and the same gate arithmetic
            o.index_copy_(0, ot, gdn_decode.gated_delta_rule_decode(
                q.index_select(0, ot), k.index_select(0, ot), v.index_select(0, ot), a.index_select(0, ot),
                b.index_select(0, ot), ssm_states, batch.slots.index_select(0, orq),
                batch.has_initial_state.index_select(0, orq), gate_params=(self.A_log, self.dt_bias)))
            o.index_copy_(0, rt, self._delta_rule(
                x, q.index_select(0, rt), k.index_select(0, rt), v.index_select(0, rt), g.index_select(0, rt),
                beta.index_select(0, rt), ssm_states, split.rest))
        else:
            o = self._delta_rule(x, q, k, v, g, beta, ssm_states, batch)
        o = self._gated_norm(o, z.reshape(t, self.nv, self.dv))
        return self.out_proj(o.reshape(t, self.value_dim))

    def _walks(self, x, mixed, z, a, b, batch: HybridBatch) -> torch.Tensor:
        """The conv and delta rule of a verification step in walks (device data only: CUDA-graph safe): each
        request's rows in order from its state, the states after each row kept (voltllm.model.layers.gdn_verify)."""
        from voltllm.kernels import gdn_decode
        t = x.shape[0]
        cache, i = batch.state_cache, self.state_index
        starts, ends = batch.walks
        ckpt = (cache.checkpoint_base, cache.checkpoints)
        mixed = gdn_decode.causal_conv1d_verify(mixed, self.conv_weight, cache.conv_rows[i], batch.slots, starts,
                                                ends, batch.has_initial_state, *ckpt)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta = torch.sigmoid(b.float())
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        o = gdn_decode.gated_delta_rule_verify(q.reshape(t, self.nk, self.dk), k.reshape(t, self.nk, self.dk),
                                               v.reshape(t, self.nv, self.dv), g, beta, cache.ssm_rows[i],
                                               batch.slots, starts, ends, batch.has_initial_state, *ckpt)
        return self.out_proj(self._gated_norm(o, z.reshape(t, self.nv, self.dv)).reshape(t, self.value_dim))

    def _delta_rule(self, x, q, k, v, g, beta, ssm_states, batch: HybridBatch) -> torch.Tensor:
        """A non-fast batch's delta rule: the Triton chunk kernels where they apply, else the torch form."""
        o = None
        if (self._triton_prefill_fits(batch, self.chunk_precision) if self.triton_prefill is None and x.is_cuda
              else bool(self.triton_prefill)) and not batch.decode_only and x.device not in _CHUNK_UNFIT_DEVICES:
            o = self._chunk_kernels(q, k, v, g, beta, ssm_states, batch)
        if o is None:
            o = gdn_ref.gated_delta_rule_varlen(q, k, v, g, beta, ssm_states, batch.slots, batch.query_start_loc,
                                                batch.has_initial_state, batch.decode_only)
        return o

    def _chunk_kernels(self, q, k, v, g, beta, ssm_states, batch: HybridBatch) -> Optional[torch.Tensor]:
        """The chunked delta rule on the Triton kernels; None (and the torch form from then on, for this device)
        when no tile fits its shared memory (less than a T4's 64 KB per block: gdn_chunk.ChunkKernelsDoNotFit,
        raised before anything is written)."""
        from voltllm.kernels import gdn_chunk
        if batch.chunk_meta is None:
            batch.chunk_meta = gdn_chunk.chunk_meta(batch.query_start_loc, batch.has_initial_state)
        try:
            return gdn_chunk.gated_delta_rule_chunked(q, k, v, g, beta, ssm_states, batch.slots,
                                                      batch.query_start_loc, batch.has_initial_state,
                                                      meta=batch.chunk_meta, precision=self.chunk_precision)
        except gdn_chunk.ChunkKernelsDoNotFit as e:
            _CHUNK_UNFIT_DEVICES.add(q.device)
            logger.warning("%s; Gated DeltaNet prompts run the torch chunked form on this device", e)
            return None

    @staticmethod
    def _triton_prefill_fits(batch: HybridBatch, precision: str = "ieee") -> bool:
        """With tensor-core products ("tf32x3", "tf32") the Triton chunk kernels win every batch timed (H200,
        qwen3.5-27b-shape heads, tf32x3: 1 x 8192 tokens 7.3 vs 28 ms in the torch chunked form, 4 x 2048 6.6 vs
        38, 16 x 512 6.7 vs 56). With exact fp32 FMA products ("ieee": the compat route, fp32 models) they cost
        60-100 ms per 8K tokens however the tokens are split (session 22 tile: 1 x 8192 103 ms, 4 x 2048 61, 64 x
        128 61 on the H200), while the torch form, fp32 matmuls per request, costs ~27 ms per 8K tokens of long
        prompts plus a few ms per request (1 x 8192 18-38, 4 x 2048 25-51, 16 x 512 37-77, 64 x 128 161): torch
        for a step whose every request computes >= LONG_PREFILL_TOKENS, the kernels when some request is short
        (short prompts: 64 x 128 would pay the torch form's per-request cost 64 times; a mixed step's decode rows
        run the decode kernel, RowSplit, and are not counted here). H200 FMAs for both; a V100 (no tensor cores for
        either path in fp32) was not timed."""
        if precision != "ieee":
            return True
        qsl = batch.query_start_loc
        return not all(qsl[i + 1] - qsl[i] >= LONG_PREFILL_TOKENS for i in range(len(qsl) - 1))

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        # one launch instead of ~10, same fp32 math; the kernel knows silu only: a sigmoid gate runs the torch form
        if (o.is_cuda if self.triton_norm is None else self.triton_norm) and self.gate_act == "silu":
            from voltllm.kernels import fused

            return fused.gated_rms_norm_heads(o, z, self.norm_weight, self.eps)
        of = o.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight.float()
        gate = F.silu(z.float()) if self.gate_act == "silu" else torch.sigmoid(z.float())
        return (of * gate).to(o.dtype)

    # -- weights ---------------------------------------------------------------------------------
    def expected_weight_keys(self, prefix: str) -> set[str]:
        keys = {f"{prefix}in_proj#{i}" for i in range(6)}
        return keys | {f"{prefix}{n}" for n in ("conv_weight", "A_log", "dt_bias", "norm_weight", "out_proj#0")}

    def load_hf_weight(self, name: str, tensor: Any, prefix: str = "") -> list[str]:
        """`name` is relative to the HF module (e.g. 'in_proj_qkvz.weight'); returns the keys it filled. Projection
        weights may be dense tensors or packed quantized ones (quantized_linear.PackedWeight): both are cut into the
        merged projection's shards by rows (split_rows). Under tensor parallelism each shard is then cut to this
        rank's heads (_local; packed ones lazily, distributed.sharding)."""
        nk, nv, dk, dv = self.full_nk, self.full_nv, self.dk, self.dv
        kd, vd = nk * dk, nv * dv
        pieces = in_proj_pieces(name.removesuffix(".weight"), nk, nv, dk, dv) if name.endswith(".weight") else []
        if pieces:
            if len(pieces) == 1 and pieces[0][1] is None:
                parts = [tensor]
            else:
                parts = split_rows(tensor, [rows for _, rows in pieces])
            for (shard, _), part in zip(pieces, parts):
                self.in_proj.load_weight(self._local(part, shard), shard)
            return [f"{prefix}in_proj#{shard}" for shard, _ in pieces]
        if name == "conv1d.weight":  # channels [q | k | v], each following its heads
            full = tensor.reshape(2 * kd + vd, self.kernel)
            if self.tp is not None:
                q, k, v = full.split([kd, kd, vd])
                full = torch.cat([self._local(q, 0), self._local(k, 1), self._local(v, 2)])
            self._copy(self.conv_weight, full, name)
            return [f"{prefix}conv_weight"]
        if name == "conv1d.bias":
            raise ValueError("GDN conv1d with a bias is not supported (Qwen hybrids have none)")
        if name in ("A_log", "dt_bias"):  # one per value head
            self._copy(getattr(self, name), self._local(tensor, 4), name)
            return [f"{prefix}{name}"]
        if name == "norm.weight":  # one weight of Dv shared by every head: whole on every rank
            self._copy(self.norm_weight, tensor, name)
            return [f"{prefix}norm_weight"]
        if name == "out_proj.weight":  # row-parallel: this rank's value heads' input columns
            if self.tp is not None:
                tensor = self.local_out_cols(tensor, prefix + "out_proj")
            self.out_proj.load_weight(tensor)
            return [f"{prefix}out_proj#0"]
        raise ValueError(f"unexpected GDN weight {name!r}")

    def local_out_cols(self, tensor: Any, name: str) -> Any:
        """This rank's value heads' input columns of out_proj (row-parallel) given the whole projection's."""
        return take_cols(tensor, self.v_start * self.dv, self.value_dim, name)

    def local_in_rows(self, part: Any, shard: int) -> Any:
        """_local for a caller outside the loader (LoRA's B rows of in_proj shard `shard`)."""
        return self._local(part, shard)

    def _local(self, part: Any, shard: int) -> Any:
        """This rank's rows of in_proj shard `shard` (0 q, 1 k: key heads; 2 v, 3 z: value heads; 4 b, 5 a: one row
        per value head) given the whole model's rows of that shard; the part itself without tensor parallelism."""
        if self.tp is None:
            return part
        if shard < 2:
            return take_rows(part, self.k_start * self.dk, self.key_dim)
        if shard < 4:
            return take_rows(part, self.v_start * self.dv, self.value_dim)
        return take_rows(part, self.v_start, self.nv)

    @staticmethod
    def _copy(param: nn.Parameter, tensor: torch.Tensor, name: str) -> None:
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(tensor)
