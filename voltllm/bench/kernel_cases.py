"""The cases of `voltllm bench --scenario kernels`: each Triton kernel of the hybrid (Gated DeltaNet) and MoE
layers beside its plain-PyTorch reference, on one set of random inputs at a model's real layer shapes.

  gdn_chunk    voltllm.kernels.gdn_chunk.gated_delta_rule_chunked   vs gdn_ref.gated_delta_rule_varlen
               (prefill: 1 x 8192 tokens, 4 x 2048; odd requests start from a state, as a later chunk does)
  gdn_decode   voltllm.kernels.gdn_decode.gated_delta_rule_decode   vs gdn_ref.gated_delta_rule_varlen(decode_only)
  conv_decode  voltllm.kernels.gdn_decode.causal_conv1d_decode      vs gdn_ref.causal_conv1d_varlen(decode_only)
  conv_prefill voltllm.kernels.gdn_conv.causal_conv1d_prefill       vs gdn_ref.causal_conv1d_varlen
               (the prefill sizes of gdn_chunk)
  moe          the expert kernels SparseMoE runs for the batch:        vs voltllm.model.layers.moe.fused_experts_ref
               voltllm.kernels.moe_decode.fused_experts_small (unsorted GEMVs) up to SMALL_MAX_PAIRS
               (token, expert) pairs,
               voltllm.kernels.moe.fused_experts (grouped GEMM) above

An input set is a dict; the calls take it and return named outputs. Inputs the call updates in place (state
pools) are listed in `mutable`: the kernel and the reference each get their own copy of the same values.
`bytes_moved` is the traffic the call cannot avoid (each state / weight byte once); `flops` counts matmul
FLOPs. Both are per call, from the input set.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

CHUNK = 64  # voltllm.kernels.gdn_chunk.CHUNK (not imported here: that module needs triton)
KERNELS = ("gdn_chunk", "gdn_decode", "conv_decode", "conv_prefill", "moe")

Inputs = dict[str, Any]


@dataclass
class KernelCase:
    kernel: str  # one of KERNELS
    label: str  # "1x8192", "b16", "t4096"
    make: Callable[[torch.Generator], Inputs]  # one input set on the device
    triton: Callable[[Inputs], dict[str, torch.Tensor]]
    ref: Callable[[Inputs], dict[str, torch.Tensor]]
    mutable: tuple[str, ...] = ()
    bytes_moved: Optional[Callable[[Inputs], float]] = None
    flops: Optional[Callable[[Inputs], float]] = None
    tensor_cores: bool = False  # the kernel's FLOPs run on tensor cores (compare them with the matmul rate)
    memory_bound: bool = False


@dataclass(frozen=True)
class Sizes:
    prefill: tuple[tuple[int, ...], ...] = ((8192,), (2048, 2048, 2048, 2048))  # request lengths per call
    decode: tuple[int, ...] = (1, 16, 64)  # requests per decode step
    moe_tokens: tuple[int, ...] = (1, 16, 64, 4096)  # tokens per call (decode batches, one prefill chunk)


@dataclass(frozen=True)
class LayerShapes:
    """The widths of one GDN layer and one MoE layer of a model (None: the model has no such layer)."""
    hidden: int
    gdn: Optional[tuple[int, int, int, int, int]] = None  # key heads, value heads, key dim, value dim, conv width
    moe: Optional[tuple[int, int, int, bool]] = None  # experts, top-k, expert intermediate size, renormalize

    @classmethod
    def from_config(cls, hf_config: Any) -> "LayerShapes":
        cfg = getattr(hf_config, "text_config", None) or hf_config
        gdn = moe = None
        if getattr(cfg, "linear_num_value_heads", None) and "linear_attention" in (getattr(cfg, "layer_types", None)
                                                                                   or ["linear_attention"]):
            gdn = (int(cfg.linear_num_key_heads), int(cfg.linear_num_value_heads), int(cfg.linear_key_head_dim),
                   int(cfg.linear_value_head_dim), int(getattr(cfg, "linear_conv_kernel_dim", 4)))
        if getattr(cfg, "num_experts", None) and getattr(cfg, "moe_intermediate_size", None):
            mt = str(getattr(cfg, "model_type", ""))
            renorm = True if mt.startswith("qwen3_5_moe") else bool(getattr(cfg, "norm_topk_prob", True))
            moe = (int(cfg.num_experts), int(cfg.num_experts_per_tok), int(cfg.moe_intermediate_size), renorm)
        return cls(hidden=int(cfg.hidden_size), gdn=gdn, moe=moe)

    def to_json(self) -> dict:
        out: dict[str, Any] = {"hidden": self.hidden}
        if self.gdn:
            out["gdn"] = dict(zip(("key_heads", "value_heads", "key_dim", "value_dim", "conv_kernel"), self.gdn))
        if self.moe:
            out["moe"] = dict(zip(("experts", "top_k", "intermediate", "renormalize"), self.moe))
        return out


def _qsl(lens: tuple[int, ...]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


# -- Gated DeltaNet ---------------------------------------------------------------------------------
def _delta_inputs(gen: torch.Generator, t: int, n: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype,
                  device: torch.device) -> Inputs:
    def rn(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=device, dtype=dt)

    return dict(q=rn(t, hk, dk), k=rn(t, hk, dk), v=rn(t, hv, dv),
                g=-torch.rand(t, hv, generator=gen, device=device) * 0.5,  # log decay <= 0
                beta=torch.sigmoid(rn(t, hv, dt=torch.float32)),
                pool=rn(n, hv, dk, dv, dt=torch.float32) * 0.1, slots=torch.arange(n, device=device))


def gdn_chunk_case(shapes: LayerShapes, lens: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                   use_triton: bool = True) -> KernelCase:
    hk, hv, dk, dv, _ = shapes.gdn
    qsl = _qsl(lens)

    def make(gen):
        d = _delta_inputs(gen, qsl[-1], len(lens), hk, hv, dk, dv, dtype, device)
        d["qsl"] = qsl
        d["init"] = torch.tensor([i % 2 == 1 for i in range(len(lens))], device=device)
        if use_triton:  # the step's chunk table, built once per forward for every GDN layer (as the model does)
            from voltllm.kernels.gdn_chunk import chunk_meta

            d["meta"] = chunk_meta(qsl, d["init"])
        return d

    def triton_call(d):
        from voltllm.kernels.gdn_chunk import gated_delta_rule_chunked

        out = gated_delta_rule_chunked(d["q"], d["k"], d["v"], d["g"], d["beta"], d["pool"], d["slots"], d["qsl"],
                                       d["init"], meta=d["meta"])
        return {"out": out, "state": d["pool"]}

    def ref_call(d):
        from voltllm.kernels import gdn_ref

        out = gdn_ref.gated_delta_rule_varlen(d["q"], d["k"], d["v"], d["g"], d["beta"], d["pool"], d["slots"],
                                              d["qsl"], d["init"])
        return {"out": out, "state": d["pool"]}

    def flops(d):  # per token and value head: S products (k S, q S, kd^T U) + the chunk's C x C products
        return qsl[-1] * hv * (6 * dk * dv + 4 * CHUNK * dv + 4 * CHUNK * dk)

    label = f"{len(lens)}x{lens[0]}" if len(set(lens)) == 1 else "+".join(str(n) for n in lens)
    return KernelCase("gdn_chunk", label, make, triton_call if use_triton else ref_call, ref_call,
                      mutable=("pool",), flops=flops)


def gdn_decode_case(shapes: LayerShapes, batch: int, dtype: torch.dtype, device: torch.device,
                    use_triton: bool = True) -> KernelCase:
    hk, hv, dk, dv, _ = shapes.gdn
    esize = torch.empty((), dtype=dtype).element_size()

    def make(gen):
        d = _delta_inputs(gen, batch, batch, hk, hv, dk, dv, dtype, device)
        d["init"] = torch.ones(batch, dtype=torch.bool, device=device)
        return d

    def triton_call(d):
        from voltllm.kernels.gdn_decode import gated_delta_rule_decode

        out = gated_delta_rule_decode(d["q"], d["k"], d["v"], d["g"], d["beta"], d["pool"], d["slots"], d["init"])
        return {"out": out, "state": d["pool"]}

    def ref_call(d):
        from voltllm.kernels import gdn_ref

        out = gdn_ref.gated_delta_rule_varlen(d["q"], d["k"], d["v"], d["g"], d["beta"], d["pool"], d["slots"],
                                              list(range(batch + 1)), d["init"], decode_only=True)
        return {"out": out, "state": d["pool"]}

    def moved(d):  # fp32 state read + written; q, k, v read, out written; g, beta (fp32) read
        return batch * (hv * dk * dv * 4 * 2 + (2 * hk * dk + 2 * hv * dv) * esize + hv * 4 * 2)

    return KernelCase("gdn_decode", f"b{batch}", make, triton_call if use_triton else ref_call, ref_call,
                      mutable=("pool",), bytes_moved=moved, memory_bound=True)


def conv_decode_case(shapes: LayerShapes, batch: int, dtype: torch.dtype, device: torch.device,
                     use_triton: bool = True) -> KernelCase:
    hk, hv, dk, dv, kw = shapes.gdn
    c = 2 * hk * dk + hv * dv
    esize = torch.empty((), dtype=dtype).element_size()

    def make(gen):
        return dict(x=torch.randn(batch, c, generator=gen, device=device, dtype=dtype),
                    w=torch.randn(c, kw, generator=gen, device=device, dtype=dtype) * 0.5,
                    pool=torch.randn(batch, kw - 1, c, generator=gen, device=device, dtype=dtype),
                    slots=torch.arange(batch, device=device), init=torch.ones(batch, dtype=torch.bool, device=device))

    def triton_call(d):
        from voltllm.kernels.gdn_decode import causal_conv1d_decode

        out = causal_conv1d_decode(d["x"], d["w"], None, d["pool"], d["slots"], d["init"], "silu")
        return {"out": out, "state": d["pool"]}

    def ref_call(d):
        from voltllm.kernels import gdn_ref

        out = gdn_ref.causal_conv1d_varlen(d["x"], d["w"], None, d["pool"], d["slots"], list(range(batch + 1)),
                                           d["init"], "silu", decode_only=True)
        return {"out": out, "state": d["pool"]}

    def moved(d):  # weights once; per request x in, out, and the K-1 state rows read and written
        return c * kw * esize + batch * c * esize * (2 + 2 * (kw - 1))

    return KernelCase("conv_decode", f"b{batch}", make, triton_call if use_triton else ref_call, ref_call,
                      mutable=("pool",), bytes_moved=moved, memory_bound=True)


def conv_prefill_case(shapes: LayerShapes, lens: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                      use_triton: bool = True) -> KernelCase:
    hk, hv, dk, dv, kw = shapes.gdn
    c = 2 * hk * dk + hv * dv
    qsl = _qsl(lens)
    n = len(lens)
    esize = torch.empty((), dtype=dtype).element_size()

    def make(gen):
        d = dict(x=torch.randn(qsl[-1], c, generator=gen, device=device, dtype=dtype),
                 w=torch.randn(c, kw, generator=gen, device=device, dtype=dtype) * 0.5,
                 pool=torch.randn(n, kw - 1, c, generator=gen, device=device, dtype=dtype),
                 slots=torch.arange(n, device=device),
                 init=torch.tensor([i % 2 == 1 for i in range(n)], device=device))
        if use_triton:  # the step's tile table, built once per forward for every GDN layer (as the model does)
            from voltllm.kernels.gdn_conv import conv_tiles

            d["tiles"] = conv_tiles(qsl, d["init"])
        else:
            from voltllm.kernels import gdn_ref

            d["plan"] = gdn_ref.conv_plan(qsl, kw, device)
        return d

    def triton_call(d):
        from voltllm.kernels.gdn_conv import causal_conv1d_prefill

        out = causal_conv1d_prefill(d["x"], d["w"], None, d["pool"], d["slots"], qsl, d["init"], "silu",
                                    tiles=d["tiles"])
        return {"out": out, "state": d["pool"]}

    def ref_call(d):
        from voltllm.kernels import gdn_ref

        out = gdn_ref.causal_conv1d_varlen(d["x"], d["w"], None, d["pool"], d["slots"], qsl, d["init"], "silu",
                                           plan=d.get("plan"))
        return {"out": out, "state": d["pool"]}

    def moved(d):  # weights once; x in, out; per request the K-1 state rows read and written
        return c * kw * esize + 2 * qsl[-1] * c * esize + n * 2 * (kw - 1) * c * esize

    label = f"{n}x{lens[0]}" if len(set(lens)) == 1 else "+".join(str(v) for v in lens)
    return KernelCase("conv_prefill", label, make, triton_call if use_triton else ref_call, ref_call,
                      mutable=("pool",), bytes_moved=moved, memory_bound=True)


# -- MoE ----------------------------------------------------------------------------------------------
class ExpertWeights:
    """One MoE layer's stacked expert weights, made once and shared by every MoE case (they are large)."""

    def __init__(self, shapes: LayerShapes, dtype: torch.dtype, device: torch.device):
        self.shapes, self.dtype, self.device = shapes, dtype, device
        self._w: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def get(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        if self._w is None:
            e, _, inter, _ = self.shapes.moe
            h = self.shapes.hidden
            w13 = torch.randn(e, 2 * inter, h, generator=gen, device=self.device, dtype=self.dtype).mul_(h ** -0.5)
            w2 = torch.randn(e, h, inter, generator=gen, device=self.device, dtype=self.dtype).mul_(inter ** -0.5)
            self._w = (w13, w2)
        return self._w

    def release(self) -> None:
        self._w = None


def moe_case(shapes: LayerShapes, tokens: int, dtype: torch.dtype, device: torch.device, weights: ExpertWeights,
             use_triton: bool = True) -> KernelCase:
    e, top_k, inter, renorm = shapes.moe
    h = shapes.hidden
    esize = torch.empty((), dtype=dtype).element_size()

    def make(gen):
        from voltllm.model.layers.moe import route

        w13, w2 = weights.get(gen)
        x = torch.randn(tokens, h, generator=gen, device=device, dtype=dtype)
        tw, ids = route(torch.randn(tokens, e, generator=gen, device=device), top_k, renorm)
        return dict(x=x, w13=w13, w2=w2, tw=tw, ids=ids)

    def triton_call(d):  # what SparseMoE runs for this batch (the routed experts; no shared expert here)
        from voltllm.kernels.moe import fused_experts
        from voltllm.kernels.moe_decode import SMALL_MAX_PAIRS, fused_experts_small

        run = fused_experts_small if tokens * top_k <= SMALL_MAX_PAIRS else fused_experts
        return {"out": run(d["x"], d["w13"], d["w2"], d["tw"], d["ids"])}

    def ref_call(d):
        from voltllm.model.layers.moe import fused_experts_ref

        return {"out": fused_experts_ref(d["x"], d["w13"], d["w2"], d["tw"], d["ids"])}

    def moved(d):  # every active expert's gate, up and down rows once; x in, out
        active = int(torch.unique(d["ids"]).numel())
        return active * 3 * inter * h * esize + 2 * tokens * h * esize

    def flops(d):
        return 2 * tokens * top_k * 3 * inter * h

    return KernelCase("moe", f"t{tokens}", make, triton_call if use_triton else ref_call, ref_call,
                      bytes_moved=moved, flops=flops, tensor_cores=dtype in (torch.float16, torch.bfloat16),
                      memory_bound=tokens * top_k <= 2 * e)


def build_cases(shapes: LayerShapes, dtype: torch.dtype, device: torch.device, sizes: Sizes = Sizes(),
                only: Optional[list[str]] = None, use_triton: bool = True) -> tuple[list[KernelCase], list]:
    """-> (cases in run order, objects holding shared memory to release afterwards). `use_triton=False` runs
    the reference on both sides (CPU tests of the harness)."""
    want = set(only or KERNELS)
    unknown = want - set(KERNELS)
    if unknown:
        raise ValueError(f"--kernels: unknown {', '.join(sorted(unknown))}; choose from {', '.join(KERNELS)}")
    cases: list[KernelCase] = []
    shared: list = []
    if shapes.gdn:
        if "gdn_chunk" in want:
            cases += [gdn_chunk_case(shapes, lens, dtype, device, use_triton) for lens in sizes.prefill]
        if "gdn_decode" in want:
            cases += [gdn_decode_case(shapes, b, dtype, device, use_triton) for b in sizes.decode]
        if "conv_decode" in want:
            cases += [conv_decode_case(shapes, b, dtype, device, use_triton) for b in sizes.decode]
        if "conv_prefill" in want:
            cases += [conv_prefill_case(shapes, lens, dtype, device, use_triton) for lens in sizes.prefill]
    if shapes.moe and "moe" in want:
        weights = ExpertWeights(shapes, dtype, device)
        shared.append(weights)
        cases += [moe_case(shapes, t, dtype, device, weights, use_triton) for t in sizes.moe_tokens]
    return cases, shared
