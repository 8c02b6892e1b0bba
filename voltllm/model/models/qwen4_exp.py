"""Qwen4-Exp text model (qwen4_exp_text; of a qwen4_exp multimodal checkpoint, the `model.language_model.*` weights:
`model.visual.*`, Qwen3.5-MoE's vision tower, is the runner's (worker/image_step.py), `mtp.*` skipped).

The residual stream is hc = hc_count copies of the hidden state side by side, [T, hc * H] (hyper-connections):

  h          = repeat(embed(ids), hc)
  layer i:   h += PLE_i(h)                              (layers in ple_layer_ids only: qwen4_exp_ple.py)
             m, w = gate(h);  h += mixer(m) (x) w       gate: a GatedResidual, per layer and sub-block
             m, w = gate'(h); h += moe(m) (x) w
  out        = mixer_gate(h) -> [T, H]; logits = lm_head(out)      (no final norm)

  GatedResidual(h):  n = zero-centred RMSNorm of each H-wide stream (weight hc * H)
                     a = sigmoid(W_up silu(W_down n / hc))                  [T, hc, H] per-stream, per-channel mix
                     m = mean_c(a_c * n_c)                                  [T, H]: the block's input
                     w = 2 sigmoid(W_inject n / hc)                         [T, hc]: how much of the block's output
                                                                            each stream takes (h += out[:, None] w)
  mixer  = Gated DeltaNet ("linear_attention"; output gate silu or sigmoid: output_gate_type or hidden_act)
         | Qwen3.5 gated attention with a QSA indexer ("indexed_attention" / "full_attention": qwen4_exp_qsa.py;
           without indexer_* config fields, plain gated attention)
  moe    = Qwen3-Next sparse MoE with a sigmoid-gated shared expert, every layer.

Images / videos (a qwen4_exp checkpoint): as Qwen3.5-MoE's, the tower's rows replace the placeholder tokens'
embeddings (extra["image_embeds"]) and image tokens rotate by their M-RoPE rows (the runner's scratch rotary rows);
PLE hashes the real token ids, placeholders included (transformers' ple_input_ids = input_ids), never the rows.

Positions: M-RoPE as Qwen3.5; text tokens have every section at the token's position (ordinary RoPE).

Per-request state: the GDN layers' conv / SSM states in the StateCache, plus the StateCache extras "ple_ctx" (the
last ngram_size - 1 token ids) and "ple_conv" (every PLE layer's last dilated-conv inputs) when PLE layers exist;
QSA raw and pooled index keys in extra paged KV caches (IndexKeyStore).

Quantized checkpoints kept quantized (a QuantizedLinearMethod as `linear_method`), as the Qwen3.5-MoE hybrid: the
attention, GDN, shared-expert and untied LM-head projections hold planes, the routed experts quant_moe.QuantExperts.
The hyper-connection, router, shared-expert gate, PLE and QSA indexer linears are plain nn.Linear layers: dense, and
dequantized at load where a checkpoint quantized them.

Tensor parallelism (`tp`, a TPGroup), as qwen3_next.py: gated attention by heads, each GDN layer by key / value heads,
the MoE by every expert's intermediate rows (or whole experts under --enable-expert-parallel), the embedding and LM
head by vocabulary rows; the mixer's o_proj / out_proj partial products are summed here (Qwen4ExpDecoderLayer), the
MoE's in SparseMoE. The residual stream h, the hyper-connections and the QSA indexer are replicated (every rank
computes the same selection from the same raw keys, which each rank keeps beside its own KV heads). The PLE n-gram
tables are split by columns (each rank gathers its 1 / N of every head's embedding channels, and key_proj / value_proj
sum their partial products over the ranks): each rank's process holds 1 / N of the host-memory tables.
LoRA (--enable-lora, voltllm/lora/): the Linears take adapters as Qwen3.5-MoE's do (gated attention q / k / v / o,
the GDN in_proj_* / out_proj, the shared expert's); the routed experts through their SparseMoE (lora/experts.py);
under tp each rank's part cut by `tp_part`, the loader's own cuts. The hyper-connection, PLE, QSA indexer and router
linears take none (refused by name: lora/adapter.py).
Pipeline parallelism (`pp`, a PipelineStage): each stage builds its layers alone (local KV cache, GDN state, QSA
index-key and PLE state indices); the stages hand over h [T, hc * H] whole (PipelineStage.receive_stream /
pass_on_stream) and rank 0 applies the final mixer to the last stage's h. A stage with PLE layers keeps their
"ple_conv" rows and its own "ple_ctx" copy, advanced from the step's ids, which every rank gets (docs/hybrid.md).
Speculative decoding (ngram, suffix, draft_model): the GDN states as every hybrid's; the PLE extras keep the
window after each verified row in the slot's checkpoint rows (gdn_verify.WindowCheckpoints), so keep_accepted undoes
rejected drafts; verification steps run eagerly (supports_verify_graphs). Why QSA's keys need nothing: docs/hybrid.md.
Not built (refused at load): MTP / DFlash / EAGLE-3 speculation, pooling; LoRA or speculative decoding under
pipeline parallelism.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from voltllm.distributed.sharding import HeadShard, take_rows, vocab_rows
from voltllm.model.forward_context import ForwardContext
from voltllm.model.layer_placement import build_layer
from voltllm.model.layers.gdn import GatedDeltaNet, HybridBatch
from voltllm.model.layers.linear import Linear, LinearMethod
from voltllm.model.layers.moe import SparseMoE
from voltllm.model.layers.quantized_linear import dense_tensor
from voltllm.attention.kv_spec import kv_scale_target, load_checkpoint_kv_scale
from voltllm.model.layers.rotary import RotaryEmbedding
from voltllm.model.layers.vocab_parallel import VocabParallelEmbedding
from voltllm.model.models.qwen3_next import GatedAttention, _rotary_dim, text_config
from voltllm.model.models.qwen4_exp_ple import NGramContext, PLELayer, ZeroCentredRMSNorm
from voltllm.model.models.qwen4_exp_qsa import IndexKeyStore, QSAIndexer, rope_rows

_SKIP_PREFIXES = ("mtp.", "model.visual.", "visual.", "model.mtp.")
_SHARD = re.compile(r"ple\.ple_embedding\.ngram_embedding\.(?:shard_(\d+)\.)?weight$")
_PLE_BUFFERS = ("layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes")

NO_WALKS = ("Qwen4-Exp: a verification step as decode rows (the hybrid verification CUDA graphs, state_walks) is not "
            "built: its PLE n-gram windows need each request's earlier rows; verification steps run eagerly "
            "(supports_verify_graphs)")


def layer_kinds(cfg: Any) -> list[str]:
    """Each layer's mixer, "linear_attention" or "indexed_attention" (a config's "full_attention" is the same)."""
    kinds = getattr(cfg, "layer_types", None) or [
        "indexed_attention" if (i + 1) % getattr(cfg, "full_attention_interval", 4) == 0 else "linear_attention"
        for i in range(cfg.num_hidden_layers)]
    kinds = ["indexed_attention" if k == "full_attention" else k for k in kinds]
    bad = sorted(set(kinds) - {"linear_attention", "indexed_attention"})
    if bad:
        raise ValueError(f"Qwen4-Exp: unknown layer types {bad}")
    return kinds


def has_qsa(cfg: Any) -> bool:
    return getattr(cfg, "indexer_n_heads", None) is not None


class GatedResidual(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, combine: bool = True):
        super().__init__()
        self.hc, self.hidden = cfg.hc_count, cfg.hidden_size
        width = self.hc * self.hidden
        self.hc_norm = ZeroCentredRMSNorm(width, cfg.rms_norm_eps, self.hidden)
        self.input_mix_weight_down = nn.Linear(width, cfg.hc_lowrank, bias=False, dtype=dtype)
        self.input_mix_weight_up = nn.Linear(cfg.hc_lowrank, width, bias=False, dtype=dtype)
        self.block_inject_weight = nn.Linear(width, self.hc, bias=False, dtype=dtype) if combine else None

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """h [T, hc * H] -> (the block's input [T, H], injection weights [T, hc] or None for the final mixer)."""
        n = self.hc_norm(h)
        mix = torch.sigmoid(self.input_mix_weight_up(F.silu(self.input_mix_weight_down(n) / self.hc)))
        mixed = (mix.unflatten(-1, (self.hc, self.hidden)) * n.unflatten(-1, (self.hc, self.hidden))).mean(-2)
        if self.block_inject_weight is None:
            return mixed, None
        return mixed, 2 * torch.sigmoid(self.block_inject_weight(n) / self.hc)

    @staticmethod
    def inject(h: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return h + (out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)


class IndexedAttention(GatedAttention):
    """Qwen3.5 gated attention; with QSA, contexts past the budget attend to the indexer's selection only, through
    virtual block tables into the paged decode kernel (qwen4_exp_qsa_decode): a pure-decode step's rows CUDA-graph
    safe, a multi-row chunk's rows (prompt_selection) in an eager step."""

    def __init__(self, cfg: Any, kv_index: int, dtype: torch.dtype, rotary: RotaryEmbedding,
                 index_slot: Optional[tuple[tuple[int, int, int], tuple[int, int, int]]],
                 linear_method: Optional[LinearMethod] = None, tp=None):
        # (with tp: this rank's heads; the indexer, a few channels per token, is replicated)
        super().__init__(cfg, kv_index, dtype, rotary, linear_method, tp)
        self.indexer = QSAIndexer(cfg, dtype) if index_slot is not None else None
        self.index_slot = index_slot

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext,
                sparse: Sequence[int] = (), select_decode: bool = False) -> torch.Tensor:
        """sparse: the requests (batch indices) whose context is past the indexer's full-attention length in a step
        with multi-row chunks (_sparse_rows); select_decode: a pure-decode step whose every row attends to its
        selection (virtual block tables)."""
        if self.indexer is None:
            return super().forward(positions, x, ctx)
        from voltllm.model.models import qwen4_exp_qsa_decode as qsa

        t = x.shape[0]
        meta = ctx.meta
        q_idx, raw = self.indexer.project(x)
        keys, pooled = (IndexKeyStore.view(ctx.kv_caches[c], plane, off, self.indexer.dim, raw.dtype)
                        for c, plane, off in self.index_slot)
        bs = ctx.kv_caches[self.kv_index].shape[2]
        _store_rows(keys, raw, meta.slot_mapping[:t])
        # blocks are token ranges; under M-RoPE (images) a token's position is not its index
        token_pos = qsa.row_token_index(meta, t, x.device)
        qsl, rotations = meta.query_start_loc_cpu, ctx.extra.get("token_rotations") or {}
        start_rotary = {(qsl[i], qsl[i + 1]): _TokenRotary(*rot, self.rotary.rotary_dim)
                        for i, rot in rotations.items()}
        qsa.store_pooled_keys(self.indexer, self.rotary, keys, pooled, positions, meta.slot_mapping[:t],
                              meta.block_tables, qsa.row_sequences(meta, t, x.device), bs, token_pos, start_rotary)
        qg, k, v = self.qkv_proj(x).split(self.qkv_proj.shard_sizes, dim=-1)
        q, gate = qg.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = q.contiguous()
        q_raw = q.clone() if sparse else None  # (the paged path may rotate q in place)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        attn_ctx = ctx
        if select_decode:  # the same launch as the plain path, over each row's selected pages
            vmeta, page = qsa.decode_selection(self.indexer, self.rotary, q_idx, positions, pooled, meta, bs,
                                               token_pos=token_pos)
            caches = list(ctx.kv_caches)
            caches[self.kv_index] = qsa.paged_view(caches[self.kv_index], page)
            attn_ctx = dataclasses.replace(ctx, meta=vmeta, kv_caches=caches)
        out = self.rope_and_attend(positions, q, k, v, attn_ctx, self.q_norm, self.k_norm)  # also stores K / V
        out = out.reshape(t, self.num_heads, self.head_dim)
        if sparse:
            out = out.clone()
            self._sparse_rows(out, q_raw, k, v, q_idx, positions, pooled, ctx, sparse)
        out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))

    def _sparse_rows(self, out, q_raw, k, v, q_idx, positions, pooled, ctx: ForwardContext,
                     sparse: Sequence[int]) -> None:
        """The rows of requests past the budget that can leave tokens out: each attends to its own selection through
        the paged decode kernel (qwen4_exp_qsa_decode.prompt_selection); out holds the plain causal rows before."""
        from voltllm.model.models import qwen4_exp_qsa_decode as qsa

        meta = ctx.meta
        kv = ctx.kv_caches[self.kv_index]
        bs = kv.shape[2]
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        rotations = ctx.extra.get("token_rotations") or {}
        first = qsa.first_sparse_token(self.indexer)
        for i in sparse:
            start = lens[i] - (qsl[i + 1] - qsl[i])  # the token index of the request's first row here
            rotary = self.rotary
            if i in rotations:  # a request with images (M-RoPE positions): by token index, each token's rotation
                rotary = _TokenRotary(*rotations[i], self.rotary.rotary_dim)
            step = qsa.prompt_rows_per_chunk(self.indexer, lens[i] - 1, qsa.fused_chunk_scores(q_idx))
            for a in range(qsl[i] + max(0, first - start), qsl[i + 1], step):
                b = min(a + step, qsl[i + 1])
                tok = torch.arange(start + a - qsl[i], start + b - qsl[i], device=positions.device)
                pos = tok if i in rotations else positions[a:b]
                vmeta, page = qsa.prompt_selection(self.indexer, rotary, q_idx[a:b], pos, tok, start + b - 1 - qsl[i],
                                                   pooled, meta.block_tables[i], bs, meta.slot_mapping[a:b])
                q = rope_rows(self.q_norm(q_raw[a:b]), pos, rotary).contiguous()
                out[a:b] = ctx.backend.forward(q, k[a:b], v[a:b], qsa.paged_view(kv, page), vmeta, self.scale,
                                               k_scale=self.k_scale, v_scale=self.v_scale,
                                               kv_written=True)  # (K / V stored by rope_and_attend)


class _TokenRotary:
    """A rotary table by token index (cos / sin [context, half]: ImageStep.token_rotations), for QSA's sparse path."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int):
        self.cos, self.sin, self.rotary_dim = cos, sin, rotary_dim


def _store_rows(rows: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """rows[slot_mapping[t]] = values[t], skipping slot -1, without a host sync (CUDA-graph safe): padding rows
    repeat row 0's write (same slot, same value), so duplicates agree."""
    valid = slot_mapping >= 0
    first = slot_mapping[:1].clamp_min(0)
    idx = torch.where(valid, slot_mapping, first.expand_as(slot_mapping))
    vals = torch.where(valid[:, None], values, values[:1].expand_as(values))
    rows.index_copy_(0, idx, vals.to(rows.dtype))


class Qwen4ExpDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, idx: int, kind: str, mixer_index: int, ple_index: Optional[int],
                 index_slot: Optional[tuple[tuple[int, int, int], tuple[int, int, int]]], dtype: torch.dtype,
                 rotary: RotaryEmbedding,
                 linear_method: Optional[LinearMethod] = None, tp=None, ple_row: Optional[int] = None):
        """ple_index: the layer's among the model's PLE layers (its hash multipliers and table sizes); ple_row: its
        row of the "ple_conv" state among this rank's PLE layers (a pipeline stage's; default ple_index)."""
        super().__init__()
        self.kind = kind
        self.tp = tp
        self.ple_index = ple_index
        self.ple_row = ple_index if ple_row is None else ple_row
        self.ple = PLELayer(cfg, ple_index, dtype, tp) if ple_index is not None else None
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, mixer_index, dtype, "split", linear_method, tp)
        else:
            self.self_attn = IndexedAttention(cfg, mixer_index, dtype, rotary, index_slot, linear_method, tp)
        # kept quantized: the routed experts as quant_moe.QuantExperts, the shared expert's Linears as planes
        self.mlp = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                             cfg.shared_expert_intermediate_size, bool(getattr(cfg, "norm_topk_prob", True)), dtype,
                             quantized_experts=linear_method is not None, linear_method=linear_method, tp=tp)
        self.attn_hyper_connection = GatedResidual(cfg, dtype)
        self.mlp_hyper_connection = GatedResidual(cfg, dtype)

    def forward(self, positions, h, ctx: ForwardContext, batch: Optional[HybridBatch], step: "_Step"):
        if self.ple is not None:
            cache = batch.state_cache
            ckpt = None if step.conv_checkpoints is None else (step.conv_checkpoints,
                                                               cache.extra_rows["ple_conv"][:, self.ple_row])
            h = h + self.ple(h, step.windows, cache.extra["ple_conv"][:, self.ple_row], batch, ckpt)
        x, w = self.attn_hyper_connection(h)
        if self.kind == "linear_attention":
            x = self.linear_attn(x, batch)
        else:
            x = self.self_attn(positions, x, ctx, step.sparse, step.select_decode)
        if self.tp is not None:  # the ranks' heads' out_proj / o_proj partial products (the MoE sums its own)
            x = self.tp.all_reduce_(x)
        h = GatedResidual.inject(h, x, w)
        x, w = self.mlp_hyper_connection(h)
        return GatedResidual.inject(h, self.mlp(x), w)


class _Step:
    """What every layer of one forward shares: the PLE n-gram windows, the requests on QSA's multi-row path, whether
    QSA's decode rows attend through virtual block tables, and in a speculative verification step the PLE conv's
    checkpoint plan (gdn_verify.WindowCheckpoints; None otherwise)."""

    def __init__(self, windows: Optional[torch.Tensor], sparse: list[int], select_decode: bool = False,
                 conv_checkpoints: Any = None):
        self.windows = windows
        self.sparse = sparse
        self.select_decode = select_decode
        self.conv_checkpoints = conv_checkpoints


class Qwen4ExpForCausalLM(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, max_positions: int,
                 linear_method: Optional[LinearMethod] = None, tp: Any = None, pp: Any = None):
        """linear_method: how the attention, GDN, shared-expert and untied LM-head projections hold their weights
        (with a quantized one the routed experts stay quantized too); None: dense. tp: this rank's tensor-parallel
        group (module docstring); None: the whole model here. pp: this rank's pipeline stage
        (voltllm.distributed.pipeline): `layers` holds its decoder layers alone (local indices, and local KV cache,
        recurrent state, PLE state and index-key indices); the embedding, final mixer and LM head are rank 0's."""
        super().__init__()
        cfg = text_config(config)
        self.config = cfg
        self.dtype = dtype
        self.tp = tp
        self.pp = pp
        self.vocab_size = cfg.vocab_size
        if (getattr(cfg, "hidden_act", "silu") or "silu") not in ("silu", "swish"):
            raise ValueError(f"Qwen4-Exp: hidden_act {cfg.hidden_act!r} is not supported (silu)")
        if getattr(cfg, "hc_count", 0) < 2:
            raise ValueError("Qwen4-Exp needs hc_count >= 2")
        self.layer_types = layer_kinds(cfg)
        self.ple_ids = sorted(set(getattr(cfg, "ple_layer_ids", None) or []))
        for lid in self.ple_ids:
            if not 1 <= lid <= len(self.layer_types) or self.layer_types[lid - 1] != "linear_attention":
                raise ValueError(f"Qwen4-Exp: PLE layer id {lid} must be a linear_attention layer (1-indexed)")
        eos = getattr(cfg, "eos_token_id", None)
        self.eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
        if self.ple_ids and self.eos is None:
            raise ValueError("Qwen4-Exp: PLE layers need eos_token_id in the config")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rotary = RotaryEmbedding(cfg, head_dim, max(max_positions, 1), _rotary_dim(cfg, head_dim))
        owned = [i for i in range(len(self.layer_types)) if pp is None or pp.owns(i)]
        n_attn = sum(self.layer_types[i] == "indexed_attention" for i in owned)
        if n_attn == 0:
            raise ValueError("Qwen4-Exp: no attention layer in layer_types"
                             + ("" if pp is None else f" {pp.start}-{pp.end - 1} (this pipeline stage's)"))
        self.stage_ple_ids = [lid for lid in self.ple_ids if lid - 1 in owned]  # (PLE ids are 1-indexed)
        self.qsa = has_qsa(cfg)
        if self.qsa:
            if getattr(cfg, "indexer_kv_heads", 1) != 1 or cfg.indexer_budget % cfg.indexer_compress_ratio:
                raise ValueError("Qwen4-Exp QSA: indexer_kv_heads must be 1 and indexer_budget a multiple of "
                                 "indexer_compress_ratio")
            if rotary.rotary_dim > cfg.indexer_head_dim:
                raise ValueError("Qwen4-Exp QSA: the rotary dimensions must fit the indexer head")
        # each rank's KV cache rows hold its own KV heads: the raw keys are packed into rows of that width
        rank, size = (tp.rank, tp.size) if tp is not None else (0, 1)
        local_kv = HeadShard.of(cfg.num_attention_heads, cfg.num_key_value_heads, rank, size).num_kv_heads
        self._index_geometry = (n_attn, n_attn, local_kv, head_dim, cfg.indexer_head_dim)
        self.index_store = IndexKeyStore(*self._index_geometry) if self.qsa else None
        layers, a, g = [], 0, 0
        for i in owned:
            kind = self.layer_types[i]
            ple_index = self.ple_ids.index(i + 1) if i + 1 in self.ple_ids else None
            ple_row = self.stage_ple_ids.index(i + 1) if ple_index is not None else None
            if kind == "linear_attention":
                mixer_index, g = g, g + 1
                slot = None
            else:
                mixer_index, a = a, a + 1
                slot = self.index_store.place(mixer_index) if self.qsa else None
            layers.append(build_layer(Qwen4ExpDecoderLayer, cfg, i, kind, mixer_index, ple_index, slot, dtype,
                                      rotary, linear_method, tp, ple_row))
        self.layers = nn.ModuleList(layers)
        self._num_attn, self._num_gdn = a, g
        if g == 0:
            raise ValueError("Qwen4-Exp: no linear_attention layer (the recurrent state needs one)")
        self.tie = bool(getattr(config, "tie_word_embeddings", False) or getattr(cfg, "tie_word_embeddings", False))
        if pp is not None and not pp.first:  # a later pipeline stage starts from the previous one's streams h
            self.embed_tokens = self.hyper_connection_mixer = self.lm_head = None
        else:
            self.embed_tokens = (nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype) if tp is None else
                                 VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp))
            self.hyper_connection_mixer = GatedResidual(cfg, dtype, combine=False)
            head_rows = cfg.vocab_size if tp is None else vocab_rows(cfg.vocab_size, tp.size)
            self.lm_head = None if self.tie else Linear(cfg.hidden_size, head_rows, dtype=dtype,
                                                        method=linear_method)
        self.rotary = rotary
        self.hc = cfg.hc_count

    # -- what the runner needs ---------------------------------------------------------------------
    def set_kv_storage_dtype(self, storage: torch.dtype) -> None:
        """The KV cache's storage dtype (the runner's, before it sizes or allocates the caches): an fp8 cache (uint8)
        holds QSA's index keys as their model-dtype bytes, fewer per row, so more extra caches are needed and each
        indexed layer's keys move (IndexKeyStore)."""
        if self.index_store is None:
            return
        ratio = max(1, self.dtype.itemsize // storage.itemsize)
        self.index_store = IndexKeyStore(*self._index_geometry, row_bytes_per_value=ratio)
        for layer in self.layers:
            attn = getattr(layer, "self_attn", None)
            if isinstance(attn, IndexedAttention) and attn.indexer is not None:
                attn.index_slot = self.index_store.place(attn.kv_index)

    @property
    def num_attention_layers(self) -> int:
        """KV caches to allocate: the attention layers' own, then those holding QSA raw keys (IndexKeyStore)."""
        return self._num_attn + (self.index_store.num_caches if self.index_store is not None else 0)

    @property
    def kv_heads_and_dim(self) -> tuple[int, int]:
        a = next(layer.self_attn for layer in self.layers if layer.kind == "indexed_attention")
        return a.num_kv_heads, a.head_dim

    @property
    def is_hybrid(self) -> bool:
        return True

    @property
    def supports_verify_graphs(self) -> bool:
        """No: a speculative verification step runs eagerly (the runner captures no walks graphs: NO_WALKS)."""
        return False

    @property
    def supports_cuda_graphs(self) -> bool:
        """Yes: PLE's n-gram ids and table gathers are device work (qwen4_exp_ple.py's docstring). Asked before the
        runner captures, so the tables are made readable by the GPU here at the latest (not inside a capture)."""
        ends = self.embed_tokens if self.embed_tokens is not None else self.layers[0]  # (a later -pp stage: none)
        self.place_tables(next(ends.parameters()).device)
        return True

    def place_tables(self, device: torch.device) -> None:
        """Make the PLE layers' host-memory n-gram tables readable by `device`'s kernels (on a GPU: page-locked in
        place, read through CUDA views); idempotent."""
        for layer in self.layers:
            if layer.ple is not None:
                layer.ple.readable_table(device)

    def eager_step(self, context_lens: Sequence[int], query_lens: Optional[Sequence[int]] = None) -> bool:
        """Whether a step over requests of these context lengths (after the step) and query lengths must run eagerly:
        a request past QSA's budget with several query rows (host loops: _sparse_rows). Decode rows select on the
        device (CUDA graphs too). Without query_lens every request counts as several rows."""
        if not self.qsa:
            return False
        query_lens = query_lens if query_lens is not None else [2] * len(context_lens)
        return any(c >= self._full_context and q > 1 for c, q in zip(context_lens, query_lens))

    def needs_token_rotations(self, start: int, num_prompt_tokens: int) -> bool:
        """Whether a step of a request with images whose rows start at token `start` must have its tokens' M-RoPE
        rotations by token index (ImageStep.token_rotations; an eager step): a row in it may complete a QSA block
        that starts inside the prompt, whose first token may be an image token (pooled keys rotate at it)."""
        return self.qsa and start < num_prompt_tokens + self.config.indexer_compress_ratio - 1

    @property
    def _full_context(self) -> int:
        return self.config.indexer_budget + self.config.indexer_compress_ratio

    @property
    def state_spec(self) -> dict:
        g = next(layer.linear_attn for layer in self.layers if layer.kind == "linear_attention")
        spec = {"num_layers": self._num_gdn, "conv_shape": g.conv_state_shape, "conv_dtype": self.dtype,
                "ssm_shape": g.ssm_state_shape, "ssm_dtype": torch.float32}
        if self.stage_ple_ids:  # (under -pp, a stage with PLE layers: its own rows, and its own copy of the context)
            ple = next(layer.ple for layer in self.layers if layer.ple is not None)
            spec["extras"] = {
                "ple_ctx": ((self.config.ngram_size - 1,), torch.long),
                "ple_conv": ((len(self.stage_ple_ids), ple.conv_rows, self.hc * self.config.hidden_size),
                             self.dtype)}
        return spec

    # -- forward ---------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        batch = HybridBatch.from_context(ctx, self.state_spec)
        if batch.walks is not None:
            raise ValueError(NO_WALKS)
        windows = conv_checkpoints = None
        if self.stage_ple_ids:  # (every stage with PLE layers hashes the step's ids, which every rank has)
            self.place_tables(input_ids.device)  # (once; a capture finds them placed: supports_cuda_graphs)
            cache = batch.state_cache
            ngrams = NGramContext(input_ids, batch.query_start_loc, batch.slots, batch.has_initial_state,
                                  cache.extra["ple_ctx"], self.config.ngram_size, self.eos)
            windows = ngrams.windows
            if batch.drafts is not None:  # a verification: the PLE states after each draft's position, as GDN's
                conv_checkpoints = self._save_ple_context_checkpoints(input_ids, batch)
        meta = ctx.meta
        sparse, select_decode = [], False
        if self.qsa:
            # a CUDA graph (state slots on the device) is captured once for every context length: pure-decode steps
            # select on the device; eager steps only when a context is past the budget (multi-row chunks: host loops)
            graph = isinstance(ctx.extra.get("state_slots"), torch.Tensor)
            long = [] if graph else [i for i, n in enumerate(meta.seq_lens_cpu) if n >= self._full_context]
            select_decode = meta.is_pure_decode and (graph or bool(long))
            sparse = [] if select_decode else long
        step = _Step(windows, sparse, select_decode, conv_checkpoints)
        if self.embed_tokens is None:  # a later pipeline stage
            h = self.pp.receive_stream(input_ids, self.hc * self.config.hidden_size, self.dtype)
        else:
            x = self.embed_tokens(input_ids)
            images = ctx.extra.get("image_embeds")
            if images is not None:  # the vision tower's rows in place of the placeholders' (worker/image_step.py);
                x.index_copy_(0, images[0], images[1].to(x.dtype))  # PLE still hashes input_ids, placeholders too
            h = x.repeat(1, self.hc)
        for layer in self.layers:
            h = layer(positions, h, ctx, batch, step)
        if self.stage_ple_ids:
            ngrams.save(batch.state_cache.extra["ple_ctx"], batch.slots)
        if self.pp is not None:  # on to the next stage; rank 0 gets the last stage's streams back
            h = self.pp.pass_on_stream(h)
            if not self.pp.first:  # (its output is not used: rank 0 computes the logits)
                return h[:, :self.config.hidden_size]
        out, _ = self.hyper_connection_mixer(h)
        return out

    def _save_ple_context_checkpoints(self, input_ids: torch.Tensor, batch: HybridBatch) -> Any:
        """A verification step (batch.drafts): each drafting request's n-gram context after each of its positions
        but the last into its slot's checkpoint rows (StateCache.keep_accepted later keeps the last accepted one's,
        undoing the rejected drafts' tokens), before NGramContext.save moves the slots on. Returns the PLE dilated
        conv's plan (each PLE layer saves its rows the same way: PLELayer._dilated_conv)."""
        from voltllm.model.layers.gdn_verify import WindowCheckpoints

        cache = batch.state_cache
        ctx = WindowCheckpoints.build(batch, self.config.ngram_size - 1)
        if ctx is not None:
            ctx.save(input_ids.long()[:, None], cache.extra["ple_ctx"][..., None],
                     cache.extra_rows["ple_ctx"][..., None])
        ple = next(layer.ple for layer in self.layers if layer.ple is not None)
        return WindowCheckpoints.build(batch, ple.conv_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.tie and self.lm_head.weight is None:  # a head held by a quantized LinearMethod
            logits = self.lm_head(hidden)
        else:
            logits = F.linear(hidden, self.embed_tokens.weight if self.tie else self.lm_head.weight)
        if self.tp is None:
            return logits
        # every rank's vocabulary rows side by side (every rank calls this: the gather is a collective)
        logits = self.tp.all_gather_last(logits)
        return logits if logits.shape[-1] == self.vocab_size else logits[..., :self.vocab_size].contiguous()

    # -- weights ---------------------------------------------------------------------------------------
    def tp_part(self, module_name: str, kind: str, shard: int, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a LoRA-taking projection's whole weight ("layers.{i}.self_attn.qkv_proj", ...): the
        loader's cuts (gated attention by heads, Gated DeltaNet by key / value heads, the shared expert by the MoE
        layer's own cut). LoRA cuts its adapters with it (lora/sharding.py); the routed experts' adapters are cut by
        their layer (lora/experts.py)."""
        if self.tp is None:
            return tensor
        parts = module_name.split(".")
        if "layers" not in parts or kind != "weight":
            raise ValueError(f"{module_name} ({kind}): no tensor-parallel split is defined for it")
        layer = self.layers[int(parts[parts.index("layers") + 1])]
        leaf = parts[-1]
        if "shared_expert" in parts:
            return layer.mlp.shared_tp_part(leaf, tensor, module_name)
        if leaf == "qkv_proj" and layer.kind == "indexed_attention":
            return layer.self_attn.local_qkv_rows(tensor, shard)
        if leaf == "o_proj" and layer.kind == "indexed_attention":
            return layer.self_attn.local_o_cols(tensor, module_name)
        if leaf == "in_proj" and layer.kind == "linear_attention":
            return layer.linear_attn.local_in_rows(tensor, shard)
        if leaf == "out_proj" and layer.kind == "linear_attention":
            return layer.linear_attn.local_out_cols(tensor, module_name)
        raise ValueError(f"{module_name}: no tensor-parallel split is defined for it")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        shards: dict[int, set] = {}
        for name, tensor in weights:
            if name.startswith(_SKIP_PREFIXES) or "rotary_emb" in name:
                continue
            for prefix in ("model.language_model.", "language_model.", "model."):
                if name.startswith(prefix):
                    name = name[len(prefix):]
                    break
            if self.pp is not None:  # this stage's layers (local indices); the ends of the model on rank 0 alone
                if name.startswith("layers.") and int(name.split(".")[1]) >= len(self.layer_types):
                    raise ValueError(f"unexpected weight {name!r}: the config has {len(self.layer_types)} layers")
                name = self.pp.local(name)
                if name is None or (self.embed_tokens is None and name.startswith(
                        ("embed_tokens.", "lm_head.", "hyper_connection_mixer."))):
                    continue
            if name == "lm_head.weight":
                if not self.tie:
                    if self.tp is not None:  # this rank's vocabulary rows
                        rows = vocab_rows(self.vocab_size, self.tp.size)
                        tensor = take_rows(tensor, self.tp.rank * rows, rows)
                    self.lm_head.load_weight(tensor)
                    loaded.add("lm_head#0")
                continue
            if name == "embed_tokens.weight" and self.tp is not None:
                self.embed_tokens.load(dense_tensor(tensor))  # (held dense, as without TP)
                loaded.add(name)
                continue
            if not name.startswith("layers."):
                self._copy(params, name, tensor)
                loaded.add(name)
                continue
            idx, rest = name[len("layers."):].split(".", 1)
            if int(idx) >= len(self.layers):
                raise ValueError(f"unexpected weight {name!r}: the config has {len(self.layers)} layers")
            layer, p = self.layers[int(idx)], f"layers.{idx}."
            if rest.startswith("linear_attn.") and layer.kind == "linear_attention":
                loaded.update(layer.linear_attn.load_hf_weight(rest[len("linear_attn."):], tensor,
                                                               p + "linear_attn."))
            elif rest.startswith("mlp."):
                loaded.update(layer.mlp.load_hf_weight(rest[len("mlp."):], tensor, p + "mlp."))
            elif rest.startswith("self_attn.") and layer.kind == "indexed_attention":
                loaded.update(self._load_attention(layer.self_attn, p, rest[len("self_attn."):], tensor, params))
            elif rest.startswith("ple.") and layer.ple is not None:
                loaded.update(self._load_ple(layer.ple, p, rest, tensor, params, shards))
            else:
                self._copy(params, name, tensor)
                loaded.add(name)
        for i, layer in enumerate(self.layers):
            got = shards.get(i, set())
            if layer.ple is not None and (None in got or len(got) == layer.ple.num_shards):
                loaded.add(f"layers.{i}.ple.table")
        missing = sorted(self._expected_keys() - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights, e.g. {missing[:3]}")

    def _expected_keys(self) -> set[str]:
        """load_weights' names: parameters by name, the merged projections by shard ("qkv_proj#1"), n-gram tables."""
        keys = {n for n in dict(self.named_parameters()) if not (
            ".linear_attn." in n or ".mlp." in n or ".self_attn.qkv_proj." in n or ".self_attn.o_proj." in n
            or n.startswith("lm_head."))}
        if not self.tie and self.embed_tokens is not None:
            keys.add("lm_head#0")
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            if layer.kind == "linear_attention":
                keys |= layer.linear_attn.expected_weight_keys(p + "linear_attn.")
            else:
                keys |= {p + f"self_attn.qkv_proj#{s}" for s in range(3)} | {p + "self_attn.o_proj#0"}
            keys |= layer.mlp.expected_weight_keys(p + "mlp.")
            if layer.ple is not None:
                keys.add(p + "ple.table")
        return keys

    def _load_attention(self, attn: IndexedAttention, p: str, rest: str, tensor, params) -> list[str]:
        if (kv_scale := kv_scale_target(p + "self_attn." + rest)) is not None:  # fp8 KV cache scales
            for buf in kv_scale[1]:
                load_checkpoint_kv_scale(attn, buf, tensor, p + "self_attn." + rest)
            return []
        sub, _, kind = rest.rpartition(".")
        stacked = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
        if sub in stacked:
            shard = stacked[sub]
            if self.tp is not None:  # this rank's heads' rows: q_proj holds [q_h | gate_h] per head (2 D rows)
                tensor = attn.local_qkv_rows(tensor, shard)
            (attn.qkv_proj.load_weight if kind == "weight" else attn.qkv_proj.load_bias)(tensor, shard)
            return [p + f"self_attn.qkv_proj#{shard}"]
        if sub == "o_proj":
            if self.tp is not None:  # row-parallel: this rank's heads' input columns; the bias added by rank 0 only
                tensor = (attn.local_o_cols(tensor, p + "self_attn.o_proj") if kind == "weight" else
                          tensor if self.tp.rank == 0 else torch.zeros_like(tensor))
            (attn.o_proj.load_weight if kind == "weight" else attn.o_proj.load_bias)(tensor)
            return [p + "self_attn.o_proj#0"]
        if rest.startswith("indexer.") and attn.indexer is None:
            raise ValueError(f"{p}self_attn.{rest}: a QSA indexer weight, but the config sets no indexer_* fields")
        self._copy(params, p + "self_attn." + rest, tensor)
        return [p + "self_attn." + rest]

    def _load_ple(self, ple: PLELayer, p: str, rest: str, tensor, params, shards: dict) -> list[str]:
        m = _SHARD.match(rest)
        if m is not None:
            index = int(m.group(1)) if m.group(1) is not None else None
            ple.load_table_shard(index, tensor, p + rest)
            shards.setdefault(int(p.split(".")[1]), set()).add(index)
            return []
        buf = rest.rsplit(".", 1)[-1]
        if buf in _PLE_BUFFERS:  # derived from the config here; the checkpoint's must agree
            ours = {"layer_multipliers": torch.tensor(ple.multipliers), "ngram_heads_offsets": ple.offsets.cpu(),
                    "ngram_heads_vocab_sizes": ple.vocab_sizes.cpu()}[buf]
            if not torch.equal(ours, tensor.cpu().long()):
                raise ValueError(f"{p}{rest}: differs from what the config derives (seed, vocab sizes)")
            return []
        if rest == "ple.conv1d.weight":
            tensor = tensor.reshape(tensor.shape[0], -1)
            rest = "ple.conv_weight"
        elif rest in ("ple.key_proj.weight", "ple.value_proj.weight"):  # (with tp: this rank's table columns')
            tensor = ple.local_proj_cols(dense_tensor(tensor))
        self._copy(params, p + rest, tensor)
        return [p + rest]

    @staticmethod
    def _copy(params: dict, name: str, tensor: torch.Tensor) -> None:
        if name not in params:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        tensor = dense_tensor(tensor)  # (a parameter is always dense: a quantized hyper-connection / PLE / indexer
        # linear is dequantized here)
        if params[name].shape != tensor.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
        params[name].data.copy_(tensor)
