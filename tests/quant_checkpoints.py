"""Tiny quantized checkpoints written at test time: a tiny random model's linear weights quantized
round-to-nearest per group and packed the way AutoAWQ (GEMM) and GPTQ (4- or 8-bit) write them (the loops below
follow the formats' definitions, independently of voltllm's vectorized unpacking), as FP8 (E4M3) with block-wise
`weight_scale_inv` (Qwen's FP8 releases) or per-channel `weight_scale` scales, or as NVFP4 (E2M1 codes in groups of 16
with E4M3 scales and a global scale) the way NVIDIA ModelOpt and compressed-tensors write it."""
from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np
import torch

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word holds column 8j + AWQ_PACK_ORDER[i]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the hybrids' Gated DeltaNet projections (Qwen3-Next: in_proj_qkvz / in_proj_ba; Qwen3.5: the four split ones)
GDN_LINEARS = ("in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


def quantize_rtn(w: torch.Tensor, group: int, symmetric: bool, g_idx: Optional[torch.Tensor] = None, bits: int = 4):
    """w [N, K] fp32 -> (codes uint8 [N, K], scales fp16 [N, G], zeros int [N, G], dequantized fp32 [N, K]) with
    `bits`-bit codes (4 or 8). g_idx [K]: each input's group (act order); default k // group."""
    n, k = w.shape
    top = (1 << bits) - 1  # the largest code
    g_idx = torch.arange(k) // group if g_idx is None else g_idx
    groups = int(g_idx.max()) + 1
    scales = torch.empty(n, groups, dtype=torch.float16)
    zeros = torch.empty(n, groups, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if symmetric:
            s = (cols.abs().amax(1) / (top / 2)).clamp_min(1e-6)
            z = torch.full((n,), (top + 1) // 2, dtype=torch.int64)
        else:
            lo, hi = cols.amin(1).clamp_max(0), cols.amax(1).clamp_min(0)
            s = ((hi - lo) / top).clamp_min(1e-6)
            # zero points 1..top: GPTQ's original format stores zero - 1 in `bits` bits, so it cannot hold 0
            z = torch.round(-lo / s.half().float()).clamp(1, top).to(torch.int64)
        scales[:, g], zeros[:, g] = s.half(), z
    s_full, z_full = scales.float()[:, g_idx], zeros[:, g_idx]
    codes = torch.round(w / s_full + z_full).clamp(0, top).to(torch.int64)
    deq = (codes - z_full).float() * s_full
    return codes.to(torch.uint8), scales, zeros, deq


def _words(values: np.ndarray) -> torch.Tensor:
    """uint64 words (< 2**32) -> int32, the bits kept (as the checkpoints store them)."""
    return torch.from_numpy(values.astype(np.uint32).view(np.int32).copy())


def pack_awq(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM layout from codes [N, K], zeros / scales [N, G]."""
    def pack_cols(m: np.ndarray) -> np.ndarray:  # [R, C] -> [R, C / 8]
        out = np.zeros((m.shape[0], m.shape[1] // 8), dtype=np.uint64)
        for col in range(m.shape[1] // 8):
            for i in range(8):
                out[:, col] |= m[:, col * 8 + AWQ_PACK_ORDER[i]].astype(np.uint64) << np.uint64(4 * i)
        return out

    return {"qweight": _words(pack_cols(codes.t().numpy())), "qzeros": _words(pack_cols(zeros.t().numpy())),
            "scales": scales.t().contiguous()}


def pack_gptq(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
              v2: bool = False, bits: int = 4) -> dict[str, torch.Tensor]:
    """GPTQ layout (v1 stores zero - 1) from `bits`-bit codes [N, K] (4 or 8: 32 / bits per int32 word, in order
    from the low bits), zeros / scales [N, G]."""
    per, mask = 32 // bits, np.uint64((1 << bits) - 1)
    intw = codes.t().numpy().astype(np.uint64)  # [K, N]
    qweight = np.zeros((intw.shape[0] // per, intw.shape[1]), dtype=np.uint64)
    for r in range(qweight.shape[0]):
        for i in range(per):
            qweight[r] |= intw[per * r + i] << np.uint64(bits * i)
    z = zeros.t().numpy().astype(np.int64) - (0 if v2 else 1)  # [G, N]
    qzeros = np.zeros((z.shape[0], z.shape[1] // per), dtype=np.uint64)
    for j in range(qzeros.shape[1]):
        for i in range(per):
            qzeros[:, j] |= (z[:, per * j + i].astype(np.uint64) & mask) << np.uint64(bits * i)
    return {"qweight": _words(qweight), "qzeros": _words(qzeros), "scales": scales.t().contiguous(),
            "g_idx": g_idx.to(torch.int32)}


def quantize_fp8(w: torch.Tensor, block: Optional[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (E4M3 weight, fp32 scales, dequantized fp32): one scale per block x block (`weight_scale_inv`
    [ceil(N / bn), ceil(K / bk)]), or per row when block is None (`weight_scale` [N, 1]); scale = amax / 448."""
    n, k = w.shape
    bn, bk = block if block is not None else (1, k)
    scales = torch.empty(-(-n // bn), -(-k // bk))
    deq = torch.empty(n, k)
    codes = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            s = float(tile.abs().max()) / 448.0 or 1.0
            q = (tile / s).to(torch.float8_e4m3fn)
            scales[i, j] = s
            codes[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = q
            deq[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = q.float() * torch.tensor(s, dtype=torch.float32)
    return codes, scales, deq


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # magnitudes of codes 0..7; bit 3 is the sign
NVFP4_METHODS = ("modelopt_fp4", "compressed-tensors")


def quantize_nvfp4(w: torch.Tensor, producer: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (4-bit codes uint8 [N, K], E4M3 scales [N, K / 16], the global scale as the checkpoint stores it
    (fp32 [1]), dequantized fp32 [N, K]), round to nearest. ModelOpt: global g = amax / (6 * 448) multiplies, a
    group's scale is its amax / 6 / g; compressed-tensors: global G = 6 * 448 / amax divides, a group's scale is its
    amax / 6 * G. The dequantized value is code * scale * multiplier computed in float64 (exact: at most 30 significant
    bits) and rounded once to fp32, the multiplier being g, or 1 / G rounded to fp32 (as vLLM and voltllm take it)."""
    n, k = w.shape
    amax = float(w.abs().max())
    stored = torch.tensor([amax / (6 * 448) if producer == "modelopt_fp4" else 6 * 448 / amax], dtype=torch.float32)
    mult = float(stored) if producer == "modelopt_fp4" else float(1 / stored)
    blocks = w.double().reshape(n, k // 16, 16)
    per = blocks.abs().amax(-1) / 6 / mult
    scales = per.clamp(2 ** -9, 448).to(torch.float8_e4m3fn)
    step = scales.double() * mult  # each group's scale in float64, exact
    codes = torch.empty(n, k // 16, 16, dtype=torch.uint8)
    deq = torch.empty(n, k // 16, 16, dtype=torch.float64)
    mags = torch.tensor(E2M1, dtype=torch.float64)
    for i in range(16):
        x = blocks[..., i] / step
        c = (x.abs()[..., None] - mags).abs().argmin(-1)  # nearest magnitude
        neg = (x < 0) & (c > 0)
        codes[..., i] = (c | (neg.to(torch.int64) << 3)).to(torch.uint8)
        deq[..., i] = torch.where(neg, -mags[c], mags[c]) * step
    return codes.reshape(n, k), scales, stored, deq.reshape(n, k).float()


def pack_nvfp4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] -> uint8 [N, K / 2]: byte j holds input 2j in its low nibble, 2j + 1 in its high one."""
    c = codes.numpy()
    out = np.zeros((c.shape[0], c.shape[1] // 2), dtype=np.uint8)
    for j in range(out.shape[1]):
        out[:, j] = c[:, 2 * j] | (c[:, 2 * j + 1] << 4)
    return torch.from_numpy(out)


def nvfp4_layer(w: torch.Tensor, producer: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the layer's tensors under the producer's names, with a static activation scale, dequantized fp32)."""
    codes, scales, stored, deq = quantize_nvfp4(w, producer)
    if producer == "modelopt_fp4":
        tensors = {"weight": pack_nvfp4(codes), "weight_scale": scales, "weight_scale_2": stored.reshape(()),
                   "input_scale": torch.tensor(0.01)}
    else:
        tensors = {"weight_packed": pack_nvfp4(codes), "weight_scale": scales, "weight_global_scale": stored,
                   "input_global_scale": torch.tensor([100.0])}
    return tensors, deq


def nvfp4_config(producer: str, ignore: list[str]) -> dict:
    """The quantization_config (config.json) of an NVFP4 checkpoint that leaves the `ignore` layers dense."""
    if producer == "modelopt_fp4":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": ignore,
                "producer": {"name": "modelopt", "version": "0.37.0"}}
    fp4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
           "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": fp4, "format": "nvfp4-pack-quantized",
                                          "input_activations": {**fp4, "dynamic": "local"}}},
            "ignore": ignore, "sparsity_config": {}, "kv_cache_scheme": None}


def quantize_checkpoint(path: str, method: str, group: int = 32, symmetric: bool = False, act_order: bool = False,
                        seed: int = 0, block: Optional[tuple[int, int]] = (128, 128), dense: tuple[str, ...] = (),
                        quant_file: bool = False, bits: int = 4,
                        extra: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Rewrite the HF checkpoint at `path` (a tiny_models.make_model directory) in place as an `method` (awq: 4-bit,
    gptq: `bits`-bit (4 or 8), in groups of `group`; fp8: E4M3 in blocks, or per channel with block None; modelopt_fp4 /
    compressed-tensors: NVFP4, leaving the layers named in `dense` unquantized and listed as ignored; ModelOpt's
    config in hf_quant_config.json with quant_file) checkpoint; returns the dequantized weights {name: [N, K] fp32}
    (what a reference model should hold). `extra`: more projection names (the last part of a layer's name) to quantize
    beside LINEARS and GDN_LINEARS."""
    from safetensors.torch import load_file, save_file

    if bits != 4 and method != "gptq":
        raise ValueError(f"{bits}-bit weights: GPTQ only")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    out, deq = {}, {}
    gen = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        prefix, _, part = name.rpartition(".")
        if part != "weight" or prefix.rpartition(".")[2] not in LINEARS + GDN_LINEARS + tuple(extra):
            out[name] = t
            continue
        if prefix.removeprefix("model.") in dense:
            out[name] = t
            continue
        if method in NVFP4_METHODS:
            tensors, deq[name] = nvfp4_layer(t.float(), method)
            out.update({f"{prefix}.{p}": v for p, v in tensors.items()})
            continue
        if method == "fp8":
            codes, scales, deq[name] = quantize_fp8(t.float(), block)
            out[name] = codes
            out[f"{prefix}.weight_scale_inv" if block else f"{prefix}.weight_scale"] = scales
            if block is None:
                out[f"{prefix}.input_scale"] = torch.tensor(1.0)  # a static activation scale (ignored)
            continue
        k = t.shape[1]
        g_idx = torch.arange(k) // group
        if act_order:
            g_idx = g_idx[torch.randperm(k, generator=gen)]
        codes, scales, zeros, w = quantize_rtn(t.float(), group, symmetric, g_idx, bits)
        packed = pack_awq(codes, zeros, scales) if method == "awq" else pack_gptq(codes, zeros, scales, g_idx,
                                                                                  bits=bits)
        out.update({f"{prefix}.{p}": v for p, v in packed.items()})
        deq[name] = w
    save_file(out, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    if method in NVFP4_METHODS:
        qc = nvfp4_config(method, ["lm_head", *(f"model.{d}" for d in dense)])
        if quant_file:  # ModelOpt's own file instead of config.json's quantization_config
            with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
                json.dump({"producer": qc["producer"], "quantization": {
                    "quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                    "exclude_modules": qc["ignore"]}}, f, indent=1)
            return deq
    elif method == "fp8":
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic" if block else "static"}
        if block:
            qc["weight_block_size"] = list(block)
    elif method == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    else:
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": symmetric, "desc_act": act_order,
              "checkpoint_format": "gptq"}
    cfg["quantization_config"] = qc
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return deq


def kept_and_dense(path: str):
    """The checkpoint built on the CPU twice, fp32: with its quantized layers kept quantized (as on a GPU) and
    dequantized at load."""
    from voltllm.model.layers.quantized_linear import QuantizedLinearMethod
    from voltllm.model.loader import iter_weights, load_hf_config, resolve_model
    from voltllm.model.models.registry import build_model

    src = resolve_model(path)
    cfg = load_hf_config(src)
    kept = build_model(cfg, torch.float32, 64, QuantizedLinearMethod())
    kept.load_weights(iter_weights(src, cfg, keep_quantized=True))
    dense = build_model(cfg, torch.float32, 64)
    dense.load_weights(iter_weights(src, cfg, keep_quantized=False))
    return kept, dense


def assert_kept_matches_dequantized(monkeypatch, path: str, kept_check) -> None:
    """On the GPU, fp32: the checkpoint kept quantized (KEEP_QUANTIZED=1, `kept_check(llm, True)`) and dequantized
    at load (`kept_check(llm, False)`): 6 prompts then 1, 12 greedy tokens each (prompt steps: dequantize + cuBLAS;
    1-4-row decode: the dequant-GEMM; 6-row batches; CUDA graphs); the same tokens and logprobs."""
    import voltllm.config
    from voltllm import LLM, SamplingParams

    prompts = [f"The quick brown fox {i} " * (1 + i) for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, logprobs=1)
    kw = dict(device="cuda", dtype="float32", max_model_len=512, gpu_memory_utilization=0.2)
    outs = {}
    for keep in (1, 0):
        monkeypatch.setattr(voltllm.config, "KEEP_QUANTIZED", keep)
        llm = LLM(path, **kw)
        kept_check(llm, bool(keep))
        outs[keep] = llm.generate(prompts, sp) + llm.generate(prompts[:1], sp)
        llm.engine.check_integrity()
        del llm
    for a, b in zip(outs[1], outs[0]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            tok = next(iter(lb))
            assert abs(la[tok].logprob - lb[tok].logprob) < 1e-3


# tiny hybrids whose every projection the planes can hold: hidden 128 and value heads of 8 x 16 make every input a
# multiple of 128 (FP8 planes) and every output a multiple of 8 (AWQ packs 8 outputs per word; in_proj_b / _a: 8 rows)
HYBRID_QUANT_SHAPE = dict(hidden_size=128, linear_num_value_heads=8, linear_value_head_dim=16, intermediate_size=256)
HYBRID_QUANT_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                        shared_expert_intermediate_size=128)


def quantized_hybrid(path: str, kind: str, quant: dict, tokenizer: bool = False, **overrides) -> Optional[str]:
    """A tiny random qwen3_5 / qwen3_next / qwen3_5_moe checkpoint (tiny_models.make_tiny_hybrid at
    HYBRID_QUANT_SHAPE + overrides) quantized in place by quantize_checkpoint(**quant); with `tokenizer` a tiny BPE
    tokenizer beside it (text prompts). None when this transformers lacks the architecture."""
    from tiny_models import HYBRID_VOCAB, make_tiny_hybrid, make_tokenizer

    if tokenizer:  # (a byte-level BPE has at least 259 tokens: the vocabulary grows to hold them)
        overrides.setdefault("vocab_size", max(HYBRID_VOCAB, len(make_tokenizer(path, HYBRID_VOCAB))))
    if make_tiny_hybrid(path, kind, 0, 1, **{**HYBRID_QUANT_SHAPE, **overrides}) is None:
        return None
    quantize_checkpoint(path, **quant)
    return path


def kept_linears(path: str) -> list:
    """(name, Linear kept quantized, its dequantized twin) for every projection of the checkpoint at `path` but the LM
    head (kept_and_dense)."""
    from voltllm.model.layers.linear import Linear

    kept, dense = kept_and_dense(path)
    dense_linears = dict(dense.named_modules())
    return [(name, mod, dense_linears[name]) for name, mod in kept.named_modules()
            if isinstance(mod, Linear) and name != "lm_head"]


def assert_multiplies_alike(kept, dense, seed: int = 0) -> None:
    """A kept-quantized Linear gives its dequantized twin's outputs on random inputs."""
    x = torch.randn(3, kept.in_features, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(kept(x), dense(x), rtol=1e-5, atol=1e-5)


def quantized_qwen4_exp(path: str, quant: dict, **overrides) -> Optional[str]:
    """A tiny random qwen4_exp_text checkpoint (tiny_models.make_tiny_qwen4_exp at the quantizable hybrid shape:
    hidden 128, GDN value heads of 8 x 16, experts and shared expert of 128 rows; + overrides) quantized in place by
    quantize_checkpoint(**quant). None when this transformers lacks Qwen4-Exp."""
    from tiny_models import make_tiny_qwen4_exp

    shape = {k: v for k, v in HYBRID_QUANT_SHAPE.items() if k != "intermediate_size"}
    if make_tiny_qwen4_exp(path, 3, **{**shape, **HYBRID_QUANT_MOE, **overrides}) is None:
        return None
    quantize_checkpoint(path, **quant)
    return path
