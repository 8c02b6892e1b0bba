"""Hardware limits, measured on the device itself, and the roofline limits of a model on it.

- copy_GBps: device-to-device copy of a large buffer, bytes read + bytes written / time (median of N,
  timed with CUDA events). This is the rate at which a decode step can stream bytes; its read-only
  equivalent is taken to be the same figure (DESIGN.md: "bytes read per step / measured copy bandwidth").
- matmul_TFLOPs: dense n x n x n matmul (n = 8192 on a GPU) in the model's half dtype, random data,
  2 n^3 FLOPs / time (median of N).
- decode limit: bytes that must be read per step = every weight once (parameter bytes of the model that
  is actually loaded) + each request's KV over its context (2 * attention layers * kv heads * head dim *
  element size * context; a sliding-window layer's at most its window) + each request's recurrent state for hybrid
  models; limit tok/s = batch /
  (bytes / bandwidth). For batches, the roofline also caps it by FLOPs / matmul rate.
- prefill limit: FLOPs of one prompt = 2 * matmul params * L (embedding lookups are not matmuls; logits
  for the last position only) + causal attention 4 * attention layers * q heads * head dim * L^2 / 2 (a
  sliding-window layer of window W: W^2 / 2 + (L - W) * W past its window);
  limit tok/s = L / (FLOPs / matmul rate).
- images (--scenario random-mm): an image's vision-tower FLOPs (tower_flops, from the vision config and the patch
  grid the image processor makes of it) are added to the prefill FLOPs of the prompt, whose length counts the
  image's tokens (one per merged patch window): TTFT limit = (prefill FLOPs + tower FLOPs of its images) / matmul rate.

On the CPU the same code runs at tiny sizes (wall clock instead of CUDA events) so tests exercise it.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch


@dataclass
class DeviceLimits:
    device: str
    copy_GBps: float  # read + write bytes / s, / 1e9
    matmul_TFLOPs: float
    matmul_dtype: str
    copy_bytes: int  # size of the copied buffer (each of source and destination)
    matmul_n: int
    copy_samples_GBps: list[float] = field(default_factory=list)
    matmul_samples_TFLOPs: list[float] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def _time_op(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int) -> list[float]:
    """Seconds per call, one sample per call. CUDA: events around each call on the current stream."""
    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        with torch.cuda.device(device):  # events record on this device's current stream
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
            for s, e in zip(starts, ends):
                s.record()
                fn()
                e.record()
        torch.cuda.synchronize(device)  # every event has completed before elapsed_time is read
        samples = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return samples


def measure_copy_bandwidth(device: torch.device, nbytes: int, iters: int = 20, warmup: int = 3) -> list[float]:
    """GB/s samples (read + write) of dst.copy_(src) over nbytes-long buffers."""
    src = torch.full((nbytes,), 1, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    secs = _time_op(lambda: dst.copy_(src), device, iters, warmup)
    return [2 * nbytes / s / 1e9 for s in secs]


def measure_matmul_rate(device: torch.device, n: int, dtype: torch.dtype, iters: int = 20,
                        warmup: int = 3) -> list[float]:
    """TFLOP/s samples of an n x n @ n x n matmul on random data."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    c = torch.empty(n, n, device=device, dtype=dtype)
    secs = _time_op(lambda: torch.matmul(a, b, out=c), device, iters, warmup)
    return [2 * n ** 3 / s / 1e12 for s in secs]


def measure_device(device: torch.device, dtype: torch.dtype, copy_mib: Optional[int] = None,
                   matmul_n: Optional[int] = None, iters: Optional[int] = None) -> DeviceLimits:
    """Measure copy bandwidth and matmul rate; sizes default to GPU-sized (1 GiB, 8192) or CPU-sized."""
    cuda = device.type == "cuda"
    copy_mib = copy_mib or (1024 if cuda else 32)
    matmul_n = matmul_n or (8192 if cuda else 256)
    iters = iters or (20 if cuda else 5)
    mm_dtype = dtype if (cuda and dtype in (torch.float16, torch.bfloat16)) else (
        torch.float16 if cuda else torch.float32)
    if cuda:
        torch.cuda.synchronize(device)
    copy = measure_copy_bandwidth(device, copy_mib << 20, iters)
    mm = measure_matmul_rate(device, matmul_n, mm_dtype, iters)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return DeviceLimits(device=str(device), copy_GBps=statistics.median(copy), matmul_TFLOPs=statistics.median(mm),
                        matmul_dtype=str(mm_dtype).replace("torch.", ""), copy_bytes=copy_mib << 20,
                        matmul_n=matmul_n, copy_samples_GBps=copy, matmul_samples_TFLOPs=mm)


# -- the model's side of the roofline -----------------------------------------------------------
@dataclass
class ModelCost:
    """What one step of the model must read / compute, taken from the model that is actually loaded."""

    weight_bytes: int  # every parameter once (tied weights counted once)
    matmul_params: int  # parameters used as matmul weights per token (no embedding table, no lm_head)
    logits_params: int  # lm_head (or tied embedding) parameters: one matmul row per sampled position
    kv_bytes_per_token: int  # K and V of one token over all attention layers
    state_bytes_per_request: int  # recurrent state (hybrid GDN layers) read per step per request
    attention_layers: int
    q_heads: int
    head_dim: int
    # sparse MoE: the routed experts' share of the above (included in weight_bytes and matmul_params) and the
    # fraction of them one token uses (top_k / num_experts); 0 for dense models
    expert_bytes: int = 0
    expert_params: int = 0
    expert_fraction: float = 0.0
    layer_windows: tuple = ()  # each attention layer's sliding window (0: the whole context); empty: none has one

    def to_json(self) -> dict:
        return asdict(self)

    def experts_touched(self, tokens: float) -> float:
        """Expected fraction of the routed experts a step of `tokens` rows reads, routing uniform and independent
        per token: 1 - (1 - top_k / E)^tokens (random-weight models route about so; a trained model's skewed
        routing touches fewer experts, so for it this overstates the bytes)."""
        return 1.0 - (1.0 - self.expert_fraction) ** tokens if self.expert_params else 0.0

    def active_matmul_params(self) -> float:
        """Matmul weights one token multiplies by: every dense one, top_k / E of the routed experts."""
        return self.matmul_params - self.expert_params * (1.0 - self.expert_fraction)

    def attended(self, context_len: float) -> float:
        """Context positions one decode row attends to, averaged over the attention layers (a sliding-window layer
        reads at most its window)."""
        if not self.layer_windows:
            return context_len
        return sum(min(context_len, w) if w else context_len for w in self.layer_windows) / len(self.layer_windows)

    def decode_bytes_per_step(self, batch: int, context_len: float) -> float:
        weights = self.weight_bytes - self.expert_bytes * (1.0 - self.experts_touched(batch))
        return weights + batch * (self.kv_bytes_per_token * self.attended(context_len) + self.state_bytes_per_request)

    def decode_flops_per_step(self, batch: int, context_len: float) -> float:
        attn = 4 * self.attention_layers * self.q_heads * self.head_dim * self.attended(context_len)
        return batch * (2 * (self.active_matmul_params() + self.logits_params) + attn)

    def prefill_flops(self, prompt_len: int) -> float:
        def pairs(w: int) -> float:  # (query, key) pairs of a causal prompt, within a window of w keys
            if not w or prompt_len <= w:
                return prompt_len ** 2 / 2
            return w ** 2 / 2 + (prompt_len - w) * w

        per_layer = (sum(pairs(w) for w in self.layer_windows) / len(self.layer_windows) if self.layer_windows
                     else pairs(0))
        attn = 4 * self.attention_layers * self.q_heads * self.head_dim * per_layer
        return 2 * self.active_matmul_params() * prompt_len + 2 * self.logits_params + attn


def _routed_experts(model: torch.nn.Module, text: Any) -> tuple[int, int, float]:
    """(bytes, parameters) of a sparse MoE model's routed experts and top_k / num_experts (0, 0, 0 for a dense
    one). voltllm's SparseMoE keeps them as w13 / w2 ([E, ...]) or quantized (qexperts); transformers' MoE blocks
    under `experts.` (the shared expert is `shared_expert.`, dense)."""
    found: dict[int, torch.Tensor] = {}
    held = [0, 0]
    for mod in model.modules():
        experts = getattr(mod, "qexperts", None)
        if experts is not None and experts.ready:
            held[0] += experts.nbytes
            held[1] += 3 * experts.num_experts * experts.inter * experts.hidden
        elif hasattr(mod, "num_experts") and isinstance(getattr(mod, "w13", None), torch.Tensor):
            found.update({id(p): p for p in (mod.w13, mod.w2)})
    if not found and not held[1]:
        found = {id(p): p for name, p in model.named_parameters() if ".experts." in f".{name}"}
    num = int(getattr(text, "num_experts", 0) or 0)
    top_k = int(getattr(text, "num_experts_per_tok", 0) or 0)
    if (not found and not held[1]) or not num or not top_k:
        return 0, 0, 0.0
    return (held[0] + sum(p.numel() * p.element_size() for p in found.values()),
            held[1] + sum(p.numel() for p in found.values()), top_k / num)


def model_cost(model: torch.nn.Module, hf_config: Any, kv_dtype: Optional[torch.dtype] = None) -> ModelCost:
    """ModelCost of a voltllm model (or any nn.Module with an Embedding and an optional lm_head)."""
    params = list(model.parameters())  # deduplicated: a tied weight appears once
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    embed_ids = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = getattr(model, "lm_head", None)
    head_w = getattr(head, "weight", None) if head is not None else None
    head_ids = {id(head_w)} if isinstance(head_w, torch.Tensor) else set()
    total = sum(p.numel() for p in params)
    embed_n = sum(p.numel() for p in params if id(p) in embed_ids)
    head_n = sum(p.numel() for p in params if id(p) in head_ids and id(p) not in embed_ids)
    from voltllm.model.layers.quantized_linear import QuantEmbedding, held_matrix

    for mod in model.modules():  # GGUF matrices kept quantized live outside the parameters
        held = held_matrix(mod)
        if held is not None:
            weight_bytes += held[0]
            total += held[1]
            if isinstance(mod, QuantEmbedding):
                embed_n += held[1]
            elif mod is head:
                head_n += held[1]
    text = getattr(hf_config, "text_config", None) or hf_config
    vocab = int(getattr(text, "vocab_size"))
    hidden = int(getattr(text, "hidden_size"))
    logits_params = vocab * hidden
    if hasattr(model, "kv_heads_and_dim"):
        kv_heads, head_dim = model.kv_heads_and_dim
        layers = int(model.num_attention_layers)
    else:  # a transformers model
        layer_types = getattr(text, "layer_types", None)
        layers = (sum(1 for t in layer_types if t == "full_attention") if layer_types
                  else int(text.num_hidden_layers))
        kv_heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
        head_dim = int(getattr(text, "head_dim", None) or hidden // text.num_attention_heads)
    if kv_dtype is None:  # the model's compute dtype (a GGUF model kept quantized has only norms as parameters)
        kv_dtype = getattr(model, "dtype", None) or (params[0].dtype if params else torch.float16)
    elem = torch.tensor([], dtype=kv_dtype).element_size()
    state = 0
    spec = getattr(model, "state_spec", None) if getattr(model, "is_hybrid", False) else None
    if spec:
        from voltllm.model.state_cache import StateCache

        state = StateCache.bytes_per_slot(spec)
    expert_bytes, expert_params, fraction = _routed_experts(model, text)
    windows = tuple(int(getattr(getattr(layer, "self_attn", None), "sliding_window", 0) or 0)
                    for layer in getattr(model, "layers", None) or ())
    return ModelCost(weight_bytes=weight_bytes, matmul_params=total - embed_n - head_n, logits_params=logits_params,
                     kv_bytes_per_token=2 * layers * kv_heads * head_dim * elem, state_bytes_per_request=state,
                     attention_layers=layers, q_heads=int(text.num_attention_heads), head_dim=head_dim,
                     expert_bytes=expert_bytes, expert_params=expert_params, expert_fraction=fraction,
                     layer_windows=windows if any(windows) and len(windows) == layers else ())


def meta_model_cost(hf_config: Any, dtype: torch.dtype) -> ModelCost:
    """ModelCost without weights in memory (client mode): the voltllm model built on the meta device,
    else the transformers model."""
    try:
        from voltllm.model.models.registry import build_model

        with torch.device("meta"):
            model = build_model(hf_config, dtype, 1)
    except Exception:  # noqa: BLE001 - an architecture voltllm does not build: count transformers' model
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    return model_cost(model, hf_config, dtype)


def decode_limit_tok_s(cost: ModelCost, dev: DeviceLimits, batch: int, context_len: float,
                       roofline: bool = False) -> float:
    """batch / (bytes per step / copy bandwidth); with roofline, the step also takes >= FLOPs / matmul rate."""
    step = cost.decode_bytes_per_step(batch, context_len) / (dev.copy_GBps * 1e9)
    if roofline:
        step = max(step, cost.decode_flops_per_step(batch, context_len) / (dev.matmul_TFLOPs * 1e12))
    return batch / step


def prefill_limit_tok_s(cost: ModelCost, dev: DeviceLimits, prompt_len: int) -> float:
    return prompt_len / (cost.prefill_flops(prompt_len) / (dev.matmul_TFLOPs * 1e12))


def tower_flops(vision_config: Any, grid: tuple[int, int, int]) -> float:
    """FLOPs of the vision tower (multimodal/vision_tower.py, qwen2_vision_tower.py) on one image of patch grid (t, h,
    w): N = t * h * w patches of width H through the patch embedding (patch_dim x H), `depth` blocks of qkv (3 H^2),
    proj (H^2), MLP (2 H I; Qwen2.5-VL's gated one 3 H I) and non-causal attention (4 L^2 H per span of L patches: a
    frame, or for Qwen2.5-VL's windowed blocks each window), then the merger and each deepstack merger (Qwen3-VL) on
    N / m^2 squares of W = H m^2 (W^2 + W x out). 2 FLOPs a multiply-add; norms, rotary, activations and the position
    table's resampling are not matmuls and are not counted."""
    from voltllm.multimodal.qwen2_vision_tower import qwen2_vision_dims, qwen2_vision_family, window_layout

    def f(name: str, default: Any = None) -> Any:
        return vision_config.get(name, default) if isinstance(vision_config, dict) else getattr(
            vision_config, name, default)

    t, h, w = (int(v) for v in grid)
    depth, merge = int(f("depth")), int(f("spatial_merge_size", 2))
    patch_dim = int(f("in_channels", 3)) * int(f("temporal_patch_size", 2)) * int(f("patch_size")) ** 2
    frame_attention = t * 4 * (h * w) ** 2
    if qwen2_vision_family(vision_config) is not None:
        dims = qwen2_vision_dims(vision_config)
        hidden, inter, out = dims["hidden"], dims["intermediate"], dims["out"]
        mlp_mats, mergers = (3 if dims["gated"] else 2), 1
        windows = window_layout([(t, h, w)], merge, dims["window_units"])[1]
        window_attention = 4 * sum(n * n for n in windows)
        attention = sum(frame_attention if i in dims["full_blocks"] else window_attention for i in range(depth))
    else:
        hidden, inter, out = int(f("hidden_size")), int(f("intermediate_size")), int(f("out_hidden_size"))
        mlp_mats, mergers = 2, 1 + len(f("deepstack_visual_indexes", None) or ())
        attention = depth * frame_attention
    n = t * h * w
    square = hidden * merge * merge
    per_patch = patch_dim * hidden + depth * (4 * hidden * hidden + mlp_mats * hidden * inter)
    return 2.0 * n * per_patch + attention * hidden + 2.0 * (n // (merge * merge)) * mergers * (
        square * square + square * out)
