"""RMSNorms folded into the decode-batch GEMMs of dense Llama-family layers (fp16 / bf16 weights, TMA GPUs).

An unfused decoder layer at a decode batch runs eight kernels: add + RMSNorm, qkv, RoPE + KV store, attention,
o_proj, add + RMSNorm, gated gate_up, down. At 64 rows on an 8B model every kernel boundary costs ~2-4 us of a
~140 us layer (docs/kernels.md, session 38), and the two norm launches carry no weight traffic at all. Folded:

- each RMSNorm's weight g is multiplied into the columns of the GEMM that consumes it (qkv, gate_up) once, when
  the plan is made (`fold_norm_weights`), and the norm module keeps a unit weight, so every other path (prefill,
  one-row decode) computes the same function with the folded weight;
- o_proj and down add their product to the residual stream in their epilogue (fp32 for fp16 models, bf16 for bf16
  ones: `llama.residual_stream`), write the sum (fp16: times X_SCALE) rounded to the model's dtype (the next GEMM's
  input) and each output tile's per-row sum of squares of it (`NormFoldPlan.sumsq`);
- qkv and gate_up read those rows as they are and scale their accumulators by rsqrt(mean(x^2) + eps), summing the
  producer's per-tile partials (loaded before their K loop); the first layer computes the sums from its x.

`voltllm.worker.norm_fold_tuning` times the layer stack both ways at each decode row count at start-up and makes a
plan only where the folded stack is faster. The rounding differs from the unfused path by the rounding of W * g to
the model's dtype and, for fp16, of the residual the GEMM reads (the fp32 residual stream itself is unchanged; a bf16
stream is rounded as the unfused add + RMSNorm rounds it, from the fp32 sum). X_SCALE keeps fp16 residual values up to
~1e6 inside fp16 (some fp16 checkpoints' residual streams pass fp16's 65504, which is why the stream is fp32); the
RMSNorm does not see it (x / rms(x) is scale-free, and eps is scaled with it). bf16 has fp32's range: no scale.
"""
from __future__ import annotations

from typing import Optional

import torch

# The tiles of the four roles (BLOCK_N, BLOCK_K, warps, stages, split-K, TMA): the fastest of the TMA candidates for
# the 8B shapes at 64 rows in the folded forms (H100, benchmarks/results/session71/norm-fold-chain-*.txt).
FOLD_CONFIGS = {"qkv": (64, 128, 4, 6, 1, True), "o": (32, 256, 4, 4, 1, True),
                "gate_up": (64, 128, 4, 6, 1, True), "down": (32, 256, 4, 4, 1, True)}
# The rounded residual the folded GEMMs of an fp16 model read is residual * X_SCALE (a power of two: exact scaling).
X_SCALE = 2.0 ** -4
# Whether a folded decode batch takes its embeddings, residual stream and first input from one kernel
# (NormFoldStep.embed_first) instead of four.
EMBED_ROWS = True
MIN_ROWS = 16  # below, the decode-batch tiles are mostly masked rows (and cuBLAS often wins the projections)
# Only layers whose projection weights are at least this big are timed for it. Measured end to end at 64 x 128/128 on
# the H100 (benchmarks/results/session71/): the 8B's shape (386 MB per layer) 2.2-2.4% faster per decode step, but
# Qwen3-0.6B's (30 MB) 1.6% and SmolLM2-135M's (7 MB) 40% slower, although the start-up timing of their layer
# stacks had the folded form ahead (not understood); the sizes in between (Qwen3-1.7B / 4B) were not measured.
MIN_LAYER_WEIGHT_BYTES = 256 << 20
# bf16 models too (a bf16 residual stream, no scale). Checked on the GPU only (tests/gpu/test_norm_fold_gpu.py: the
# Triton interpreter's bf16 dots are unusable). Measured on the H100 (benchmarks/results/session72/), the 8B's shape in
# bf16 at 64 x 128/128, fold off / on in one call: TPOT 6.831 / 6.676 ms, window 9,362 / 9,580 tok/s.
FOLD_BF16 = True


def ineligible(model) -> Optional[str]:
    """Why `model` cannot run norm-folded decode batches (None when it can)."""
    from voltllm.host_memory import in_host_memory
    from voltllm.kernels.batch_gemm import tma_supported
    from voltllm.model.layers.linear import UnquantizedLinearMethod
    from voltllm.model.models.llama import LlamaForCausalLM

    if type(model) is not LlamaForCausalLM:
        return f"{type(model).__name__} is not a plain Llama-family decoder"
    if model.has_moe or model.tp is not None or model.pp is not None:
        return "MoE, tensor- or pipeline-parallel"
    if model.dtype != torch.float16 and not (FOLD_BF16 and model.dtype == torch.bfloat16):
        return f"{model.dtype} (fp16 models{' and bf16 ones' if FOLD_BF16 else ''} only)"
    for layer in model.layers:
        for p in layer.projections():
            if not isinstance(p.method, UnquantizedLinearMethod) or p.lora is not None:
                return "quantized or LoRA projections"
            if not p.weight.is_cuda or in_host_memory(p.weight) or not tma_supported(p.weight.device):
                return "weights not on a TMA GPU (or offloaded to host memory)"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if norm.weight.numel() != model.config.hidden_size:
                return "norm width differs from the hidden size"
    size = sum(p.weight.numel() * p.weight.element_size() for p in model.layers[0].projections())
    if size < MIN_LAYER_WEIGHT_BYTES:
        return f"layers of {size / 2**20:.0f} MiB (< {MIN_LAYER_WEIGHT_BYTES >> 20} MiB: measured slower end to end)"
    return None


@torch.no_grad()
def fold_norm_weights(model) -> None:
    """W[:, k] *= g[k] for qkv (input_layernorm) and gate_up (post_attention_layernorm) in every layer, and the norm
    weights become unit (weight + offset = 1). Idempotent: a second call multiplies by 1. Done in row blocks to bound
    the fp32 scratch. (A reload that brought back the norm weights but not the projections would fold those twice;
    the runner's reloads bring back both: ModelRunner.reload_weights.)"""
    for layer in model.layers:
        for norm, proj in ((layer.input_layernorm, layer.self_attn.qkv_proj),
                           (layer.post_attention_layernorm, layer.mlp.gate_up_proj)):
            g = norm.weight.float() + norm.offset
            w = proj.weight
            for r in range(0, w.shape[0], 1024):
                w[r:r + 1024].copy_((w[r:r + 1024].float() * g).to(w.dtype))
            norm.weight.fill_(1.0 - norm.offset)


class NormFoldPlan:
    """Which decode row counts run folded, with which tiles; the partial-sum buffer and the norm all layers share
    (one eps: the layers' norms are built from one config)."""

    def __init__(self, model, configs: dict[int, dict[str, tuple]]):
        from voltllm.kernels.batch_gemm import FoldedNorm

        hidden = model.config.hidden_size
        device = model.layers[0].self_attn.qkv_proj.weight.device
        self.configs = configs
        tiles = max(-(-hidden // c[role][0]) for c in configs.values() for role in ("o", "down"))
        self.sumsq = torch.zeros(tiles * 64, dtype=torch.float32, device=device)
        self.x_scale = X_SCALE if model.dtype == torch.float16 else 1.0
        # rms(s x) = s rms(x) with eps scaled by s^2: the norm of the scaled rows is the norm of the rows
        self.norm = FoldedNorm(torch.ones(hidden, device=device),
                               model.layers[0].input_layernorm.eps * self.x_scale ** 2)
        self.norm.in_weight = True  # fold_norm_weights put g into the weights

    def step(self, rows: int) -> Optional["NormFoldStep"]:
        configs = self.configs.get(rows)
        return NormFoldStep(self, configs) if configs is not None else None


class NormFoldStep:
    """One forward's state: the tiles for its row count and the partial sums the last residual-add GEMM left."""

    def __init__(self, plan: NormFoldPlan, configs: dict[str, tuple]):
        self.plan = plan
        self.configs = configs
        self.parts: Optional[tuple[torch.Tensor, int]] = None

    def first_input(self, residual: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The first layer's input: the residual stream (the embeddings) scaled and rounded as the epilogues do."""
        return (residual * self.plan.x_scale).to(dtype)

    def embed_first(self, embedding, ids: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(first layer's input, residual stream) for token ids straight from a plain embedding table in one launch
        (kernels/embed_rows.py): what the embedding, residual_stream and first_input give in four; None for other
        embeddings (quantized, vocabulary-parallel under TP)."""
        from voltllm.kernels.embed_rows import embed_rows

        table = getattr(embedding, "weight", None)
        if (type(embedding) is not torch.nn.Embedding or ids.dim() != 1 or table is None
                or table.dtype not in (torch.float16, torch.bfloat16) or not EMBED_ROWS):
            return None
        return embed_rows(table, ids, torch.float32 if table.dtype == torch.float16 else table.dtype,
                          self.plan.x_scale)

    def layer(self, layer, x: torch.Tensor, residual: torch.Tensor, attend) -> torch.Tensor:
        """One decoder layer (llama.DecoderLayer) folded: x is the residual scaled and rounded, `attend` maps the qkv
        projection's output to the attention output; adds the layer's output into `residual` in place and returns it
        scaled and rounded (the next layer's x). Four launches for the projections, norms and adds."""
        from voltllm.kernels.batch_gemm import batch_gemm

        attn, mlp, cfg, norm = layer.self_attn, layer.mlp, self.configs, self.plan.norm
        qkv = batch_gemm(x, attn.qkv_proj.weight, attn.qkv_proj.bias, config=cfg["qkv"], norm=norm,
                         sumsq_in=self.parts)
        x = self.add_to_residual(attn.o_proj, attend(qkv), residual, cfg["o"])
        act = batch_gemm(x, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, config=cfg["gate_up"], gated=True,
                         norm=norm, sumsq_in=self.parts)
        return self.add_to_residual(mlp.down_proj, act, residual, cfg["down"])

    def add_to_residual(self, proj, x: torch.Tensor, residual: torch.Tensor, config: tuple) -> torch.Tensor:
        """residual += proj(x) in place; returns the new residual scaled and rounded (the next folded GEMM's input),
        with this GEMM's per-tile sums of squares of it in `sumsq`."""
        from voltllm.kernels.batch_gemm import batch_gemm

        sumsq = self.plan.sumsq
        out = batch_gemm(x, proj.weight, proj.bias, config=config, residual=residual, sumsq_out=sumsq,
                         residual_out_scale=self.plan.x_scale)
        self.parts = (sumsq, -(-proj.weight.shape[0] // config[0]))
        return out
