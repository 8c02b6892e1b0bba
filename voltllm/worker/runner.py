"""Model runner: loads the model, owns the KV cache, turns a scheduled step into one forward + sampling."""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np
import torch

from voltllm.attention.backend import AttentionBackend, AttentionMetadata, make_kv_cache
from voltllm.config import EngineConfig
from voltllm.distributed.step import LogitsRows, StepInputs
from voltllm.engine.scheduler import RunnerOutput, SchedulerOutput
from voltllm.engine.speculative import accept_drafts, accept_sampled
from voltllm.engine.types import PositionLogprobs
from voltllm.model.forward_context import ForwardContext
from voltllm.host_to_device import to_device, upload
from voltllm.sampling.bitmask import TokenBitmask, apply_token_bitmask_
from voltllm.sampling.sampler import (DraftVerdicts, Sampler, SamplerOutput, SamplingRow, SpecLogprobs, pinned_copy,
                                      position_logprobs, token_ranks, verified_position_logprobs)
from voltllm.worker.input_buffers import InputBuffers
from voltllm.worker.prompt_embeds_rows import apply_rows as apply_prompt_rows
from voltllm.worker.prompt_embeds_rows import gather_rows as gather_prompt_rows
from voltllm.worker.prompt_embeds_rows import needs_rows as needs_prompt_rows

logger = logging.getLogger("voltllm")


def select_attention_backend(config: EngineConfig) -> AttentionBackend:
    name = (config.device.attention_backend or "").upper()
    if config.device.device.type == "cpu" or name == "TORCH_REF":
        from voltllm.attention.torch_ref import TorchReferenceBackend

        return TorchReferenceBackend(kv_cache_dtype=config.cache.kv_cache_dtype)
    if name not in ("", "TRITON_ATTN"):
        raise ValueError(f"--attention-backend {name}: unknown (choose TRITON_ATTN or TORCH_REF)")
    from voltllm.attention.triton_backend import TritonAttentionBackend

    # the compat route (sm70/sm75) keeps decode attention off tensor cores (FMA), as those chips need, and
    # runs prefill through bridge + SDPA with a workspace sized once for --max-model-len
    return TritonAttentionBackend(use_tensor_cores=False if config.device.compat != "none" else None,
                                  kv_cache_dtype=config.cache.kv_cache_dtype, max_context=config.model.max_model_len)


_MEMORY_HINT = ("; raise --gpu-memory-utilization or --kv-cache-memory-bytes, or choose --kv-cache-dtype fp8 "
                "(half the bytes per token)")

# "auto" quantized weights stay quantized when their dequantized size exceeds this share of the usable GPU memory
AUTO_DENSE_FRACTION = 0.5


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int, device: Optional[torch.device] = None) -> None:
    """Random weights in place (speed depends on shapes, not values): N(0, 0.02), norms at 1. Drawn on `device` (the
    engine's; default: the first parameter's): decoder layers built in CPU memory for weight offloading get the
    values they would have got on the GPU."""
    device = device if device is not None else next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        elif p.device == device:
            p.normal_(0.0, 0.02, generator=gen)
        else:
            p.copy_(torch.empty(p.shape, dtype=p.dtype, device=device).normal_(0.0, 0.02, generator=gen))


@dataclass
class StepHandle:
    """A launched step: what collect() needs to turn it into host-side results."""

    sampler_out: Optional[SamplerOutput] = None
    sampled_ids: list[str] = field(default_factory=list)
    prompt_logprobs: dict = field(default_factory=dict)
    event: Optional[torch.cuda.Event] = None
    # speculation, per row after the known token and each draft: the model's argmax (all rows greedy) or the
    # sampled verdicts; and (request id, drafts) in row order
    spec_out: Optional[Union[SamplerOutput, DraftVerdicts]] = None
    spec_drafts: list[tuple[str, list[int]]] = field(default_factory=list)
    # a draft model's drafts per verification row (-1 after each request's last), on their way to the host: its
    # requests' spec_tokens are placeholders (the drafts were made on the device)
    spec_draft_ids: Optional[torch.Tensor] = None
    # the verification rows' logprobs of the requests that asked for them (sampler.SpecLogprobs)
    spec_lp: Optional[SpecLogprobs] = None
    # a hybrid target's verifying requests, whose state slots collect() settles (worker/hybrid_spec.py)
    spec_states: list = field(default_factory=list)
    # a pooling engine: the embeddings of the requests whose prompt ended in the step (voltllm/pooling/pooler.py)
    pooled: Optional[object] = None
    # the device results before their host copies (MTP's after_step reads them): sampled tokens, and the
    # verification's (tokens, accepted or None for greedy)
    sampled_device: Optional[torch.Tensor] = None
    spec_device: Optional[tuple] = None


@dataclass
class LaunchedForward:
    """A step whose forward is launched and whose sampling is not (ModelRunner.launch_forward): what
    launch_sampling needs."""

    sched: SchedulerOutput
    handle: StepHandle
    hidden: torch.Tensor
    meta: AttentionMetadata
    qsl: list[int]
    reqs: list  # the requests sampled in the step, in row order
    rows_idx: LogitsRows
    plp: list  # (row, scheduled request, rows) of the requests with prompt logprobs in the step


class ModelRunner:
    def __init__(self, config: EngineConfig, model: Optional[torch.nn.Module] = None, tp=None, send_step=None,
                 send_message=None):
        """tp: this rank's group of ranks (voltllm.distributed.group.TPGroup; None: one device): the tensor-parallel
        group, or with --pipeline-parallel-size every rank of the pipeline (then `pp` is this rank's stage, and
        `self.tp` its stage's tensor-parallel subgroup, or None without -tp). send_step (rank 0 of a group): hands
        each step's StepInputs to the other ranks, which run execute_follower; send_message: any other message to
        them (distributed/worker.py lists them)."""
        self.config = config
        self.device = config.device.device
        self.dtype = config.model.dtype
        self.block_size = config.cache.block_size
        self.group = tp  # the ranks' collectives (KV block count, the step's input ids, image rows)
        self.pp = None  # this rank's pipeline stage (voltllm.distributed.pipeline)
        if tp is not None and config.parallel.pipeline_parallel_size > 1:
            from voltllm.distributed.pipeline import PipelineStage
            from voltllm.model.models.llama import text_config

            tps = config.parallel.tensor_parallel_size
            self.pp = PipelineStage.of(int(text_config(config.model.hf_config).num_hidden_layers), tp, tps)
            # (every rank makes its own stage's subgroup, at the same point of start-up)
            tp = tp.subgroup(self.pp.members, f"stage{self.pp.rank}") if tps > 1 else None
        self.tp = tp  # the tensor-parallel group the model's layers are split over
        if tp is not None:  # how the model's layers split their MLP rows (distributed.sharding.intermediate_split)
            tp.intermediate_align = config.parallel.intermediate_align
            # and their routed experts: whole ones per rank (distributed/experts.py), else every expert's rows
            tp.expert_parallel = config.parallel.enable_expert_parallel
        self.send_step = send_step
        self.send_message = send_message
        if self.device.type == "cuda":  # before any allocation: the KV budget charges this engine what it took since
            from voltllm.platform import make_current
            from voltllm.worker.memory import free_bytes_at_start

            make_current(self.device)  # (cuda:1 and up: Triton and graph captures use the current device)
            props = torch.cuda.get_device_properties(self.device)
            logger.info("%s%s: %s, %.1f GiB, sm_%d%d", self.device,
                        f" ({'pipeline stage' if self.pp else 'tensor-parallel rank'} {self.group.rank})"
                        if self.group else "",
                        props.name, props.total_memory / 2**30, props.major, props.minor)
            self.free_at_start = free_bytes_at_start(self.device)
        self._step_inputs: Optional[StepInputs] = None  # rank 0 of a TP group: this step's, for send_step
        # ranks > 0: the last two steps' events; a step's host staging set is refilled two steps later (double
        # buffering), once the step that used it has run
        self._follower_events: list[torch.cuda.Event] = []
        self.weight_offload = None  # LayerStreamer: decoder layers kept in CPU memory (worker/weight_offload.py)
        self.model = model if model is not None else self._load_model()
        if hasattr(self.model, "set_kv_storage_dtype"):  # (Qwen4-Exp: QSA's index keys share the KV cache's rows)
            self.model.set_kv_storage_dtype(self.kv_dtype)
        # a Qwen3.5 checkpoint's vision tower and its steps' image rows (worker/image_step.py; None: text only)
        from voltllm.worker.image_step import image_step_for

        self.image_step = image_step_for(self)
        if self.group is not None:  # every rank has its weights before the first collective (host_barrier says why)
            self.group.host_barrier()
        # --enable-lora: the adapters' GPU slots in the model's projections (before KV sizing: they take memory)
        self.lora = None
        if config.lora is not None:
            from voltllm.lora.manager import LoRAManager, lora_token_capacity

            sc = config.scheduler
            # (under TP each rank's slots hold its cut of the adapters, cut as the model cuts its checkpoint; under PP
            # the adapters' matrices of its stage's layers)
            self.lora = LoRAManager(self.model, config.lora, config.model.hf_config,
                                    lora_token_capacity(sc.max_num_batched_tokens, sc.max_num_seqs), self.device,
                                    split=self.model.tp_part if tp is not None else None, stage=self.pp)
        # DraftRunner (voltllm.worker.draft_runner) or DFlashRunner (voltllm.worker.dflash_runner): the drafts' maker
        self.draft = None
        spec = config.speculative
        # MTP / DFlash / EAGLE-1 / EAGLE-3 borrow the target's embedding and LM head. Under TP alone they are split too
        # and every rank runs them (worker/mtp_runner.py, dflash_runner.py), with the target's own; under -pp, or with
        # draft_tensor_parallel_size 1, they run whole on rank 0, which keeps whole copies for them
        # (every rank joins the gathers, here at the same point of every rank's start-up)
        self.full_vocab = None
        split_drafter = spec is not None and spec.drafter_split(config.parallel)
        # (under -tp -pp stage 0's ranks alone: the later stages hold no embedding or LM head)
        if tp is not None and spec is not None and (spec.uses_mtp or spec.uses_dflash or spec.uses_eagle3
                                                    or spec.uses_eagle1) and (
                self.pp is None or self.pp.first) and not split_drafter:
            from voltllm.model.layers.full_vocab import gather_full_vocab

            self.full_vocab = gather_full_vocab(self.model, tp)
        if self.group is not None and self.group.rank > 0 and not split_drafter:  # the others run on rank 0
            spec = None
        if spec is not None and spec.uses_draft_model:
            from voltllm.worker.draft_runner import DraftRunner

            self.draft = DraftRunner(self, spec)
        elif spec is not None and spec.uses_dflash:
            from voltllm.worker.dflash_runner import DFlashRunner

            self.draft = DFlashRunner(self, spec)
        elif spec is not None and spec.uses_mtp:  # the target's own MTP module (voltllm.worker.mtp_runner)
            from voltllm.worker.mtp_runner import MTPRunner

            self.draft = MTPRunner(self, spec)
        elif spec is not None and spec.uses_eagle3:  # an EAGLE-3 head, chained as MTP (voltllm.worker.eagle3_runner)
            from voltllm.worker.eagle3_runner import Eagle3Runner

            self.draft = Eagle3Runner(self, spec)
        elif spec is not None and spec.uses_eagle1:  # an EAGLE-1 head, chained as MTP (voltllm.worker.eagle1_runner)
            from voltllm.worker.eagle1_runner import Eagle1Runner

            self.draft = Eagle1Runner(self, spec)
        # a later pipeline stage keeps its layers' share of what rank 0's DFlash drafter / EAGLE-3 head reads, and
        # hands it on with its hidden states (worker/aux_features.py)
        from voltllm.worker.aux_features import keep_stage_aux

        keep_stage_aux(self.model, config, self.pp)
        self._set_gdn_precision()
        self.backend = select_attention_backend(config)
        # programmatic dependent launch for the decode kernels: sm_90+, native route (voltllm/kernels/pdl.py).
        # The switch is process-wide, so each runner sets it again before it launches (two engines in one
        # process, e.g. native and --compat, must each run as configured)
        # Not under TP until it is validated with NCCL kernels between the PDL launches on a multi-GPU machine.
        self.use_pdl = (self.device.type == "cuda" and config.device.compat == "none" and self.group is None
                        and torch.cuda.get_device_capability(self.device) >= (9, 0))
        self._apply_pdl()
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.kv_offload = None  # the CPU tier's host slots (--kv-offloading-size; worker/kv_offload.py HostKVStore)
        self.sampler = Sampler()
        self.pooler = None  # a pooling engine's (--runner pooling): it pools hidden states instead of sampling
        if config.model.runner == "pooling":
            from voltllm.pooling.pooler import Pooler

            pc = config.model.pooler
            self.pooler = Pooler(pc.pooling_type, getattr(self.model, "score_weight", None),
                                 pc.classifier.activation if pc.classifier is not None else None)
        self.buffers: Optional[InputBuffers] = None
        self.graphs = None  # DecodeGraphs once captured
        self.verify_graphs = None  # a hybrid's verification steps as decode rows (worker/hybrid_spec.py)
        self.prompt_graphs = None  # PromptGraphs once captured (attention-only models)
        self._prev_tokens: Optional[torch.Tensor] = None  # device ids sampled by the last launched step
        self._prev_rows: dict[str, int] = {}
        self.state_cache = None  # StateCache for hybrid (Gated DeltaNet) models
        self.state_snapshots = None  # their prefix-cache state snapshots (voltllm.cache.state_snapshots)
        from voltllm.attention.kv_spec import kv_scales_to_calculate

        # --calculate-kv-scales: the first real step runs eagerly and sets the layers' k/v scales
        self.calc_kv_scales_pending = kv_scales_to_calculate(self.model, config.cache.calculate_kv_scales)
        if self.pp is not None:  # a stage whose layers lack checkpoint scales needs the step, whichever stage it is
            self.calc_kv_scales_pending = -self.group.min_int(-int(self.calc_kv_scales_pending)) > 0
        # --calculate-key-offsets: the same first real step sets the layers' key offsets (buffers made here, before
        # any CUDA graph capture reads them)
        self.calc_key_offsets_pending = bool(getattr(config.cache, "calculate_key_offsets", False))
        if self.calc_key_offsets_pending:
            from voltllm.attention.kv_spec import enable_key_offsets

            enable_key_offsets(self.model)

    # -- set-up ---------------------------------------------------------------------------------
    def _load_model(self) -> torch.nn.Module:
        from voltllm.model.layer_placement import host_layers
        from voltllm.model.models.registry import build_model

        t0 = time.monotonic()
        mc = self.config.model
        linear_method = None
        self.keep_quantized = self._keep_quantized()
        if self.keep_quantized:
            from voltllm.kernels.quant_dot import dot_max_rows, dot_table, grouped_max_rows, moe_table
            from voltllm.model.layers.quantized_linear import QuantizedLinearMethod
            from voltllm.platform import route_capability

            cap = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None
            # row limits and tiles of the route's chip: the compat route on an H200 dispatches as a V100 / T4 would
            cap = route_capability(cap, self.config.device.compat)
            linear_method = QuantizedLinearMethod(dot_max_rows(cap), dot_table(cap), moe_table(cap),
                                                  grouped_max_rows(cap))
        offload = self.config.weight_offload
        if offload is not None and mc.load_format != "dummy":
            from voltllm.worker.weight_offload import check_host_room

            check_host_room(str(mc.model))
        try:
            # with weight offloading the decoder layers are built (and loaded) in CPU memory: the offloader then
            # moves those that stay to the GPU (model/layer_placement.py)
            with host_layers(self.device if offload is not None else None), torch.device(self.device):
                model = build_model(mc.hf_config, self.dtype, mc.max_model_len, linear_method, tp=self.tp, pp=self.pp,
                                    headless=mc.runner == "pooling",
                                    classifier=mc.pooler.classifier if mc.runner == "pooling" else None)
            if mc.load_format == "dummy":
                init_dummy_weights(model, mc.seed, self.device)
                logger.info("random weights at the shapes of %s (--load-format dummy)", mc.model)
            else:
                # quantized weights are allocated while they load, not when the model is built; under expert
                # parallelism the other ranks' experts are not read
                model.load_weights(self._checkpoint_weights())
            if offload is not None:
                from voltllm.worker.weight_offload import describe, install_weight_offload

                self.weight_offload = install_weight_offload(model, offload, self.device)
                logger.info("weight offloading: %s", describe(self.weight_offload, len(model.layers)))
            if mc.load_format == "dummy":
                return model.eval()
        except torch.OutOfMemoryError:
            free, total = torch.cuda.mem_get_info(self.device) if self.device.type == "cuda" else (0, 0)
            raise RuntimeError(
                f"the model's weights do not fit on {self.device} ({total / 2**30:.1f} GiB, "
                f"{free / 2**30:.1f} GiB free) in {self.dtype}" + (" kept quantized" if self.keep_quantized else "")
                + ": use a smaller or quantized model") from None
        model.eval()
        logger.info("loaded %s (%s) in %.1f s", mc.model, mc.architecture, time.monotonic() - t0)
        if linear_method is not None:
            from voltllm.model.layers.quantized_linear import describe_quantized

            logger.info("%s weights kept quantized on the GPU: %s", mc.quantization, describe_quantized(model))
        return model

    def _checkpoint_weights(self):
        """The checkpoint's (name, tensor) pairs as load_weights takes them: floating tensors in the model's dtype;
        under expert parallelism the other ranks' experts are not read, under pipeline parallelism the other stages'
        layers."""
        from voltllm.distributed.experts import expert_shard, model_num_experts
        from voltllm.model.loader import iter_weights

        mc = self.config.model
        experts = expert_shard(model_num_experts(mc.hf_config), self.tp)
        return ((n, t.to(self.dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
                for n, t in iter_weights(mc.weights_source(), mc.hf_config, self.keep_quantized, mc.quantization,
                                         experts=experts, layers=self.pp.owns if self.pp is not None else None,
                                         # (one bar: the first rank's, under -tp / -pp)
                                         progress=mc.use_tqdm_on_load and (self.group is None or self.group.rank == 0)))

    @torch.no_grad()
    def reload_weights(self) -> None:
        """Load the weights again into the model's existing tensors (sleep level 2's wake-up: worker/sleep_mode.py);
        --load-format dummy draws the same seeded random values again."""
        from voltllm.worker.norm_fold_tuning import refold_after_reload

        if self.config.model.load_format == "dummy":
            init_dummy_weights(self.model, self.config.model.seed, self.device)
        else:
            self.model.load_weights(self._checkpoint_weights())
        refold_after_reload(self.model)

    def _keep_quantized(self) -> bool:
        """Resolve ModelConfig.quantized_weights. "auto" keeps the weights quantized when, dequantized, they would
        take more than AUTO_DENSE_FRACTION of the memory --gpu-memory-utilization gives: a model that fits runs the
        tuned dense kernels (faster on the H200: docs/models.md), one that would not (or would leave little KV cache)
        still runs."""
        mc = self.config.model
        if mc.quantized_weights != "auto":
            return mc.quantized_weights == "quantized"
        itemsize = torch.tensor([], dtype=self.dtype).element_size()
        if mc.quantization == "gguf":
            from voltllm.model.loader.gguf_loader import dense_bytes
        elif mc.quantization == "fp8":
            from voltllm.model.loader.fp8_checkpoint import dense_bytes
        elif mc.quantization == "modelopt_fp4":
            from voltllm.model.loader.nvfp4_checkpoint import dense_bytes
        elif mc.quantization == "compressed-tensors":  # (NVFP4 ones: nvfp4_checkpoint's count)
            from voltllm.model.loader.compressed_tensors_checkpoint import dense_bytes
        elif mc.quantization == "bitsandbytes":
            from voltllm.model.loader.bnb_checkpoint import dense_bytes
        else:
            from voltllm.model.loader.int4_checkpoint import dense_bytes
        # (under tensor or pipeline parallelism each rank holds ~1/N of it: the same rule per GPU as without)
        dense = dense_bytes(mc.model, itemsize) / self.config.parallel.world_size
        # every rank the same choice, that of the group's smallest card (a 16 GB V100 beside a 32 GB one): the ranks'
        # layers must agree (a drafter's dense copies of the vocabulary, the collectives' shapes)
        first = (self.device.index or 0) - (self.group.rank if self.group is not None else 0)  # the group's first card
        smallest = min(torch.cuda.get_device_properties(first + r).total_memory
                       for r in range(self.config.parallel.world_size))
        room = smallest * self.config.cache.gpu_memory_utilization
        keep = dense > AUTO_DENSE_FRACTION * room
        logger.info("%s weights: %.2f GiB dequantized (per GPU), %.2f GiB usable on the GPU -> %s (--quantization %s "
                    "keeps them quantized)", mc.quantization, dense / 2**30, room / 2**30,
                    "kept quantized" if keep else "dequantized at load", mc.quantization)
        return keep

    def _set_gdn_precision(self) -> None:
        """Gated DeltaNet prefill: tf32 tensor-core products on the native route of sm_80+ for half-precision
        models, exact fp32 ones otherwise (the compat route included; voltllm.kernels.gdn_chunk)."""
        if not self.is_hybrid:
            return
        from voltllm.kernels.gdn_chunk import auto_precision
        from voltllm.model.layers.gdn import set_chunk_precision

        precision = auto_precision(self.dtype, self.device, compat=self.config.device.compat != "none")
        if set_chunk_precision(self.model, precision):
            logger.info("Gated DeltaNet prefill: %s products in the chunk kernels", precision)

    def kv_block_bytes(self) -> int:
        heads, dim = self.model.kv_heads_and_dim
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        target = 2 * self.block_size * heads * dim * elem * self.model.num_attention_layers
        # a block holds the draft model's KV of its tokens too (the same block ids address both caches)
        return target + (self.draft.kv_block_bytes(self.block_size, self.kv_dtype) if self.draft is not None else 0)

    @property
    def kv_dtype(self) -> torch.dtype:
        """Storage dtype of the KV cache: the model dtype, or uint8 for fp8 (voltllm.attention.kv_spec)."""
        from voltllm.attention.kv_spec import kv_cache_spec

        return kv_cache_spec(self.config.cache.kv_cache_dtype, self.dtype).storage_dtype

    @property
    def max_decode_rows(self) -> int:
        """Rows a decode-form step (and its CUDA graph) may have (cuda_graphs.decode_graph_rows)."""
        from voltllm.worker.cuda_graphs import decode_graph_rows

        return decode_graph_rows(self.config)

    @property
    def is_hybrid(self) -> bool:
        return bool(getattr(self.model, "is_hybrid", False))

    def _fixed_draft_kv_bytes(self) -> int:
        """KV a drafter holds whatever the block count (a DFlash drafter's sliding-window rings)."""
        fixed = getattr(self.draft, "fixed_kv_bytes", None)
        return fixed(self.block_size, self.kv_dtype) if fixed is not None else 0

    def state_cache_bytes(self) -> int:
        if not self.is_hybrid:
            return 0
        from voltllm.model.state_cache import StateCache

        n = self.config.scheduler.max_num_seqs
        return StateCache.bytes_per_slot(self.model.state_spec) * (n + 1 + n * self._state_checkpoints)

    @property
    def _state_checkpoints(self) -> int:
        """Checkpoint rows per state slot: one per draft a verification may carry (worker/hybrid_spec.py)."""
        spec = self.config.speculative
        return spec.num_speculative_tokens if spec is not None else 0

    def determine_num_blocks(self) -> int:
        """KV blocks for this engine; under TP / PP the fewest any rank can hold (each rank holds its heads' or its
        layers' share of every block, so all ranks must agree on the count)."""
        num = self._local_num_blocks()
        return num if self.group is None else self.group.min_int(num)

    def _local_num_blocks(self) -> int:
        cc = self.config.cache
        if cc.num_gpu_blocks_override:
            return cc.num_gpu_blocks_override
        sc = self.config.scheduler
        need = -(-sc.max_model_len // self.block_size)  # one request of --max-model-len
        useful = sc.max_num_seqs * need + 1
        if self.device.type == "cpu":
            budget = (cc.kv_cache_memory_bytes or cc.cpu_kv_cache_bytes) - self.state_cache_bytes()
        else:
            from voltllm.worker.memory import kv_budget_bytes

            # (state slots are allocated already: the utilization share has them in use; a fixed size includes them)
            budget = kv_budget_bytes(self, cc.gpu_memory_utilization, cc.kv_cache_memory_bytes,
                                     self.state_cache_bytes())
        settle = getattr(self.draft, "settle_rings", None)  # (a DFlash drafter's sliding-window rings, or blocks)
        if settle is not None:
            settle(budget, self.kv_block_bytes() - self.draft.kv_block_bytes(self.block_size, self.kv_dtype), useful)
        per_block = self.kv_block_bytes()
        budget -= self._fixed_draft_kv_bytes()
        num = min(useful, max(budget, 0) // per_block)
        if self.device.type == "cpu" and cc.kv_cache_memory_bytes is None and not self.config.model.max_model_len_fit:
            return max(1, num)
        if self.config.model.max_model_len_fit and num < 1 or not self.config.model.max_model_len_fit and num < need:
            fixed = cc.kv_cache_memory_bytes
            room = (f"--kv-cache-memory-bytes {fixed / 2**20:.1f} MiB" if fixed is not None else
                    f"{max(budget, 0) / 2**30:.2f} GiB left after weights and activations")
            hint = ("; raise --kv-cache-memory-bytes" if self.device.type == "cpu" else _MEMORY_HINT)
            if self.config.model.max_model_len_fit:
                raise RuntimeError(f"not enough memory for any KV cache: {room} is less than one block of "
                                   f"{self.block_size} tokens ({per_block / 2**20:.2f} MiB){hint}")
            raise RuntimeError(f"not enough memory for the KV cache: {room} holds {num} blocks, fewer than one "
                               f"request of --max-model-len {sc.max_model_len} needs ({need}); lower --max-model-len "
                               f"(or pass auto){hint}")
        return int(num)

    def fit_max_model_len(self) -> None:
        """--max-model-len auto: the longest context one request can hold in the sized KV cache, up to the model's
        (vLLM's auto); every rank of a TP group has the same block count, so each comes to the same length."""
        from dataclasses import replace

        mc = self.config.model
        fitted = min(mc.max_model_len, self.num_blocks * self.block_size)
        self.config = replace(self.config, model=replace(mc, max_model_len=fitted),
                              scheduler=replace(self.config.scheduler, max_model_len=fitted))
        self.backend.limit_context(fitted)
        logger.info("--max-model-len auto: %d tokens (the KV cache holds %d; the model's maximum is %d)", fitted,
                    self.num_blocks * self.block_size, mc.max_model_len)

    def initialize_kv_cache(self) -> int:
        if self.is_hybrid:  # one recurrent-state slot per running request, before KV blocks are sized
            from voltllm.model.state_cache import StateCache

            try:
                self.state_cache = StateCache.for_model(self.model, self.config.scheduler.max_num_seqs, self.device,
                                                        self._state_checkpoints)
            except torch.OutOfMemoryError:
                raise RuntimeError(
                    f"the recurrent state of --max-num-seqs {self.config.scheduler.max_num_seqs} requests does not fit "
                    f"({self.state_cache_bytes() / 2**30:.1f} GiB" + (f", with {self._state_checkpoints} speculative "
                    "checkpoints per request" if self._state_checkpoints else "") + "): lower --max-num-seqs") from None
            logger.info("recurrent state: %d slots, %.2f GiB", self.config.scheduler.max_num_seqs,
                        self.state_cache_bytes() / 2**30)
        staging = None
        if self.config.cache.kv_offloading_size is not None:  # (taken before sizing: the KV budget is charged for it)
            from voltllm.worker.kv_offload import reserve_staging

            staging = reserve_staging(self)
        self.num_blocks = self.determine_num_blocks()
        if self.is_hybrid:  # prefix-cache snapshots of the recurrent state take the place of some KV blocks
            from voltllm.cache.state_snapshots import build_state_snapshots

            self.state_snapshots, self.num_blocks = build_state_snapshots(self, self.num_blocks)
        if self.config.model.max_model_len_fit:
            self.fit_max_model_len()
        heads, dim = self.model.kv_heads_and_dim
        self.kv_caches = make_kv_cache(self.model.num_attention_layers, self.num_blocks, self.block_size,
                                       heads, dim, self.kv_dtype, self.device)
        if self.draft is not None:
            self.draft.initialize_kv_cache(self.num_blocks, self.block_size, self.kv_dtype)
        gib = self.num_blocks * self.kv_block_bytes() / 2**30
        logger.info("KV cache: %d blocks of %d tokens = %d tokens, %.2f GiB (%s)", self.num_blocks,
                    self.block_size, self.num_blocks * self.block_size, gib, self.config.cache.kv_cache_dtype
                    if self.kv_dtype == torch.uint8 else self.kv_dtype)
        if staging is not None:  # (every TP rank here: the slot count is a minimum over them)
            from voltllm.worker.kv_offload import build_host_store

            self.kv_offload = build_host_store(self, staging)
        return self.num_blocks

    # -- one step -------------------------------------------------------------------------------
    def _ensure_buffers(self) -> InputBuffers:
        if self.buffers is None:
            sc = self.config.scheduler
            max_blocks = -(-self.config.model.max_model_len // self.block_size) + 1
            self.buffers = InputBuffers(max(sc.max_num_batched_tokens, sc.max_num_seqs) + 8,
                                        self.max_decode_rows, max_blocks, self.device)
        return self.buffers

    def prepare(self, sched: SchedulerOutput, pad_to: int = 0, state_slots: Optional[list[int]] = None,
                pad_tokens_to: int = 0, token_rows: bool = False):
        """Fill the input buffers for this step; returns (num_tokens, metadata). `pad_to`: a decode graph's rows
        (one dummy token per extra row); `pad_tokens_to`: a prompt graph's tokens (extra tokens in no sequence,
        writing nowhere; meta.slot_mapping covers them). `state_slots` (a hybrid model's CUDA-graph step): the
        requests' recurrent-state slots, uploaded to buffers.state_slots with the scratch slot on padding rows.
        `token_rows` (a speculative step, see _token_rows_step): every token its own decode row of its request."""
        buf = self._ensure_buffers()
        bs = self.block_size
        n_seqs = len(sched.scheduled)
        n_rows = sched.total_tokens if token_rows else n_seqs  # rows of the attention metadata
        assert not (pad_to and pad_tokens_to), "a step pads rows (decode graph) or tokens (prompt graph)"
        h = buf.host_set(max(sched.total_tokens + max(0, pad_to - n_rows), pad_tokens_to), max(n_rows, pad_to))
        width = max(len(s.block_ids) for s in sched.scheduled)
        table = h["block_tables"][: max(n_rows, pad_to) * width].reshape(-1, width)
        qsl, seq_lens = [0], []
        pending_dst, pending_src = [], []
        t = 0
        if token_rows:
            t, qsl, seq_lens = self._prepare_token_rows(sched.scheduled, table, h)
        elif sched.total_tokens == n_seqs:  # decode: one token per row, written as three bulk stores
            t, qsl, seq_lens = self._prepare_decode_rows(sched.scheduled, table, h, pending_dst, pending_src)
        else:
            ids_h, pos_h, slot_h = h["input_ids"], h["positions"], h["slot_mapping"]
            for i, s in enumerate(sched.scheduled):
                req, n, start = s.request, s.num_new_tokens, s.start
                bids = s.block_ids
                table[i, : len(bids)] = s.block_array
                if n == 1:  # decode row: plain ints are cheaper than numpy temporaries
                    if start < len(req.all_token_ids):
                        ids_h[t] = req.all_token_ids[start]
                    else:  # the token is still being sampled by the step in flight
                        pending_dst.append(t)
                        pending_src.append(self._prev_rows[req.request_id])
                    pos_h[t] = start if req.multi_modal is None else self._mm_position(req, start, t)
                    slot_h[t] = bids[start // bs] * bs + start % bs
                else:
                    known = req.all_token_ids[start:start + n]
                    ids_h[t:t + len(known)] = known
                    if s.spec_tokens:  # a speculative step: the known token, then the drafts to verify
                        assert len(known) + len(s.spec_tokens) == n, "drafts must follow every known token"
                        ids_h[t + len(known):t + n] = s.spec_tokens
                    elif len(known) < n:
                        pending_dst.append(t + n - 1)
                        pending_src.append(self._prev_rows[req.request_id])
                    p = np.arange(start, start + n)
                    pos_h[t:t + n] = p if req.multi_modal is None else self.image_step.positions(req, start, n, t)
                    slot_h[t:t + n] = np.asarray(bids, dtype=np.int64)[p // bs] * bs + p % bs
                t += n
                qsl.append(t)
                seq_lens.append(start + n)
        num_tokens = t
        max_q = 1 if num_tokens == n_rows else max(s.num_new_tokens for s in sched.scheduled)
        rows = max(n_rows, pad_to)
        if pad_to > n_rows:  # CUDA-graph padding: one dummy token per extra row, writing nowhere
            extra = pad_to - n_rows
            h["input_ids"][t:t + extra] = 0
            h["positions"][t:t + extra] = 0
            h["slot_mapping"][t:t + extra] = -1
            table[n_rows:pad_to] = 0
            qsl.extend(range(t + 1, t + extra + 1))
            seq_lens.extend([1] * extra)
            t += extra
        if pad_tokens_to > t:  # prompt-graph padding: tokens in no sequence, stored nowhere
            h["input_ids"][t:pad_tokens_to] = 0
            h["positions"][t:pad_tokens_to] = 0
            h["slot_mapping"][t:pad_tokens_to] = -1
            t = pad_tokens_to
        h["query_start_loc"][: rows + 1] = qsl
        h["seq_lens"][:rows] = seq_lens
        if state_slots is not None and token_rows:  # a hybrid's verification as decode rows: walks
            from voltllm.worker.hybrid_spec import fill_walks

            fill_walks(sched.scheduled, state_slots, h, rows, self.state_cache.pad_slot, buf.max_seqs)
        elif state_slots is not None:
            h["state_slots"][:n_seqs] = state_slots
            h["state_slots"][n_seqs:rows] = self.state_cache.pad_slot
        buf.upload(t, n_rows, width, rows, state_slots=state_slots is not None)
        lora_step = None
        if self.lora is not None:  # each token's adapter (padding: none), for the forward or the graph it replays
            lora_step = self.lora.prepare_step(sched.scheduled, t)
        if pending_dst:
            self._fill_pending(buf, pending_dst, pending_src)
        if self.send_step is not None:  # the other TP ranks upload the same host arrays (ids: broadcast later)
            self._step_inputs = StepInputs(
                num_tokens=num_tokens, padded_tokens=t, num_seqs=n_rows, rows=rows, table_width=width,
                positions=h["positions"][:t].copy(), slot_mapping=h["slot_mapping"][:t].copy(),
                block_tables=h["block_tables"][:rows * width].copy(), query_start_loc=qsl, seq_lens=seq_lens,
                max_query_len=max_q, lora=lora_step)
            if state_slots is not None and token_rows:  # the walks graph's state rows, as fill_walks laid them
                self._step_inputs.state_walks = (h["state_slots"][:rows].tolist(), h["state_walks"][:rows].tolist(),
                                                 h["state_walks"][buf.max_seqs:buf.max_seqs + rows].tolist())
        return t, self._metadata(buf, num_tokens, t, rows, max_q, qsl, seq_lens)

    @staticmethod
    def _metadata(buf: InputBuffers, num_tokens: int, t: int, rows: int, max_q: int, qsl: list[int],
                  seq_lens: list[int]) -> AttentionMetadata:
        return AttentionMetadata(
            num_tokens=num_tokens, query_start_loc=buf.query_start_loc[: rows + 1], seq_lens=buf.seq_lens[:rows],
            block_tables=buf.block_tables[:rows], slot_mapping=buf.slot_mapping[:t],
            max_query_len=max_q, max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)

    def _mm_position(self, req, start: int, t: int) -> int:
        """The rope position of token `start` of a request with images, at step row t (a decode row, or a prompt's
        one-token chunk)."""
        if start >= req.num_prompt_tokens:
            return start + req.multi_modal.rope_delta
        return int(self.image_step.positions(req, start, 1, t)[0])

    def _prepare_decode_rows(self, scheduled: list, table: np.ndarray, h: dict, pending_dst: list[int],
                             pending_src: list[int]) -> tuple[int, list[int], list[int]]:
        """prepare's loop for a step of one-token rows: per row only list appends and the block-table row, then one
        store per input array (numpy scalar stores cost ~0.2 us each on a slow host CPU, three per row)."""
        bs = self.block_size
        prev_rows = self._prev_rows
        ids, pos, slots = [], [], []
        for i, s in enumerate(scheduled):
            req, start, bids = s.request, s.start, s.block_ids
            table[i, : len(bids)] = s.block_array
            known = req.all_token_ids
            if start < len(known):
                ids.append(known[start])
            else:  # the token is still being sampled by the step in flight
                ids.append(0)
                pending_dst.append(i)
                pending_src.append(prev_rows[req.request_id])
            pos.append(start if req.multi_modal is None else self._mm_position(req, start, i))
            slots.append(bids[start // bs] * bs + start % bs)
        n = len(ids)
        h["input_ids"][:n] = ids
        h["positions"][:n] = pos
        h["slot_mapping"][:n] = slots
        if self.image_step is not None:  # (positions may be shifted or scratch rows: the lengths come from starts)
            return n, list(range(n + 1)), [s.start + 1 for s in scheduled]
        return n, list(range(n + 1)), [p + 1 for p in pos]

    def _prepare_token_rows(self, scheduled: list, table: np.ndarray, h: dict) -> tuple[int, list[int], list[int]]:
        """prepare's loop for a speculative step run as decode rows: each request's known token and drafts become
        consecutive rows with the request's block table, each attending to its own position's prefix (the step's
        K / V are stored before any attention reads them, so row j sees the drafts before it)."""
        bs = self.block_size
        ids, pos, slots, lens = [], [], [], []
        r = 0
        for s in scheduled:
            bids, start = s.block_ids, s.start
            toks = [s.request.all_token_ids[start], *s.spec_tokens]
            table[r:r + len(toks), : len(bids)] = s.block_array
            delta = 0 if s.request.multi_modal is None else s.request.multi_modal.rope_delta  # (decoding: 1-D)
            for j, tok in enumerate(toks):
                p = start + j
                ids.append(tok)
                pos.append(p + delta)
                lens.append(p + 1)
                slots.append(bids[p // bs] * bs + p % bs)
            r += len(toks)
        h["input_ids"][:r] = ids
        h["positions"][:r] = pos
        h["slot_mapping"][:r] = slots
        return r, list(range(r + 1)), lens

    @staticmethod
    def _token_rows_step(sched: SchedulerOutput) -> bool:
        """A speculative step that can run as decode rows: every request decodes (its one known token is the last
        one on the host) with or without drafts, and some have drafts. Its tokens then become decode rows (the
        drafts' rows attend like the plain decode steps they stand for) instead of an eager or piecewise prompt
        step, whose per-layer host work costs more than the drafts save on a small model."""
        return any(s.spec_tokens for s in sched.scheduled) and all(
            s.samples and s.num_new_tokens == 1 + len(s.spec_tokens) and s.start == len(s.request.all_token_ids) - 1
            for s in sched.scheduled)

    def _fill_pending(self, buf: InputBuffers, dst: list[int], src: list[int]) -> None:
        """Input ids still being sampled by the step in flight: token rows `dst` take that step's sampled rows
        `src`, on the device. In steady decoding both are one run (0..k-1 in the same request order): one slice
        copy, no host -> device upload of the indices."""
        k = len(dst)
        d0, s0 = dst[0], src[0]
        if dst[-1] - d0 == k - 1 and src[-1] - s0 == k - 1 and dst == list(range(d0, d0 + k)) \
                and src == list(range(s0, s0 + k)):
            buf.input_ids[d0:d0 + k].copy_(self._prev_tokens[s0:s0 + k])
            return
        idx = to_device(dst + src, torch.long, self.device)
        buf.input_ids.index_copy_(0, idx[:k], self._prev_tokens.index_select(0, idx[k:]))

    def release(self, request_ids: list[str]) -> None:
        """Drop per-request runner state (recurrent-state slots, draft catch-ups) of finished/preempted requests."""
        if self.draft is not None:
            self.draft.forget(request_ids)
        if self.image_step is not None:
            self.image_step.forget(request_ids)
        if self.state_cache is not None:
            for rid in request_ids:
                self.state_cache.free(rid)

    def _state_slots(self, sched: SchedulerOutput) -> list[int]:
        """Hybrid models: give each scheduled request its slot (batch order; gone requests' slots were freed by
        launch_forward's release) and restore prefix-cache snapshots into the slots of requests that start at a
        hit."""
        slots = [self.state_cache.allocate(s.request.request_id) for s in sched.scheduled]
        self._state_restores = []
        if self.state_snapshots is not None:
            self._state_restores = self.state_snapshots.before_forward(sched.scheduled, slots)
        return slots

    def needs_host_history(self, sched: SchedulerOutput) -> bool:
        """True when sampling this step needs every earlier token on the host (no async overlap)."""
        return any(s.request.needs_host_history for s in sched.scheduled)

    def _apply_pdl(self) -> None:
        from voltllm.kernels import pdl

        pdl.configure(self.use_pdl)

    @torch.inference_mode()
    def execute_async(self, sched: SchedulerOutput) -> StepHandle:
        """Launch the step's forward and sampling; returns before the GPU finishes."""
        return self.launch_sampling(self.launch_forward(sched))

    @torch.inference_mode()
    def launch_forward(self, sched: SchedulerOutput) -> LaunchedForward:
        """Launch the step's forward (and a speculative step's verification), not its sampling: launch_sampling
        does that, and reads sched.grammar_masks then (structured outputs: the engine core fills them in between,
        once the step in flight has returned the tokens the masks depend on, while the GPU runs this forward).
        The two halves run back to back, in this order, before any other step is launched."""
        self._apply_pdl()
        if sched.released_ids:  # finished / preempted requests' state first (their slots and rings are reused now)
            self.release(sched.released_ids)
        if sched.kv_transfers is not None:  # CPU-tier saves and loads, before anything reads or writes the blocks
            self.kv_offload.apply(sched.kv_transfers)
        if self.draft is not None:  # the draft model's tokens into the draft slots the scheduler reserved
            self.draft.propose(sched)
        n_seqs = len(sched.scheduled)
        graph = prompt_graph = None
        # (a step with image tokens in its prompts runs eagerly too: the tower's rows replace their embeddings)
        # (and one whose tokens use an adapter with MoE expert weights: their terms sort the pairs on the host,
        # lora/experts.py)
        calibrating = self.calc_kv_scales_pending or self.calc_key_offsets_pending or (
            self.image_step is not None and any(s.request.multi_modal is not None
                                                and s.start < s.request.num_prompt_tokens for s in sched.scheduled)) \
            or (self.lora is not None and self.lora.needs_eager(sched.scheduled)) \
            or (self.config.model.enable_prompt_embeds and needs_prompt_rows(sched.scheduled))
        # a model whose step has host-side work no graph replays (Qwen4-Exp's QSA prompt rows past its budget) runs it
        # eagerly
        calibrating = calibrating or (hasattr(self.model, "eager_step") and self.model.eager_step(
            [s.start + s.num_new_tokens for s in sched.scheduled], [s.num_new_tokens for s in sched.scheduled]))
        # (and one whose image requests need their tokens' M-RoPE rotations by index: Qwen4-Exp's QSA pooled keys,
        # and its torch path past the budget in a step that is not pure decode)
        rotated = [] if self.image_step is None or not hasattr(self.model, "needs_token_rotations") else [
            i for i, s in enumerate(sched.scheduled) if s.request.multi_modal is not None
            and (self.model.needs_token_rotations(s.start, s.request.num_prompt_tokens)
                 or sched.total_tokens > n_seqs and self.model.eager_step([s.start + s.num_new_tokens]))]
        calibrating = calibrating or bool(rotated)
        # a speculative decode step as decode rows (one per token; the row buffers hold max_decode_rows)
        token_rows = (not calibrating and n_seqs < sched.total_tokens <= self.max_decode_rows
                      and self._token_rows_step(sched))
        if token_rows and self.is_hybrid:  # its rows feed one recurrent state per request: only as a walks graph
            graph = self.verify_graphs.for_batch(sched.total_tokens) if self.verify_graphs is not None else None
            token_rows = graph is not None  # (else an eager prompt-form step: hybrids have no prompt graphs)
        elif self.graphs is not None and (sched.total_tokens == n_seqs or token_rows) and not calibrating:
            graph = self.graphs.for_batch(sched.total_tokens)
        elif self.prompt_graphs is not None and sched.total_tokens > n_seqs and not calibrating:
            prompt_graph = self.prompt_graphs.for_tokens(sched.total_tokens)
        slots = self._state_slots(sched) if self.state_cache is not None else None
        t, meta = self.prepare(sched, pad_to=graph.batch_size if graph else 0,
                               state_slots=slots if graph is not None else None,
                               pad_tokens_to=prompt_graph.num_tokens if prompt_graph else 0, token_rows=token_rows)
        images: dict = {}
        image_rows = None
        if self.image_step is not None:  # the step's image rows and scratch rotary rows
            image_rows = self.image_step.finish(images, self.dtype)
            if rotated:  # (Qwen4-Exp's QSA rotates past keys by their tokens' positions: an eager step)
                from voltllm.worker.image_step import ImageRows, token_positions

                p3 = {i: token_positions(sched.scheduled[i].request,
                                         sched.scheduled[i].start + sched.scheduled[i].num_new_tokens)
                      for i in rotated}
                images["token_rotations"] = {i: self.image_step.rotations(p) for i, p in p3.items()}
                image_rows = image_rows or ImageRows(None, None)
                image_rows.token_positions = p3  # (the other ranks rotate the same: ImageStep.follow)
        prompt_rows = None  # (--enable-prompt-embeds: the given rows of the step's prompt tokens)
        if calibrating and self.config.model.enable_prompt_embeds:  # (such steps run eagerly: see calibrating)
            found = gather_prompt_rows(sched.scheduled, meta.query_start_loc_cpu)
            if found is not None:
                prompt_rows = (found[0], upload(found[1], self.device).to(self.dtype))
                apply_prompt_rows(images, *prompt_rows, self.device)
        handle = StepHandle()
        qsl = meta.query_start_loc_cpu
        if token_rows:  # the requests' token spans (the metadata's rows are single tokens)
            qsl = list(itertools.accumulate((s.num_new_tokens for s in sched.scheduled), initial=0))
        scheduled = sched.scheduled
        if self.draft is not None:  # the drafts (last in each drafting request's span) over their placeholders
            self.draft.fill_inputs(self.buffers.input_ids, [(qsl[i + 1] - len(s.spec_tokens), s)
                                                            for i, s in enumerate(scheduled) if s.spec_tokens])
        # which hidden rows get logits, decided before the forward: the other TP ranks compute the same ones
        # one token per row and every row samples (decode): the rows are the hidden states in order, and no row
        # is short of its prompt's last token, so none has prompt logprobs to compute
        decode = sched.num_sampled == n_seqs == sched.total_tokens
        spec_rows: list = []
        if decode:
            rows_idx: LogitsRows = (0, n_seqs)
            reqs = [s.request for s in scheduled]
        else:
            sampling = [(i, s) for i, s in enumerate(scheduled) if s.samples]
            spec_rows = [(i, s) for i, s in sampling if s.spec_tokens]
            sampling = [(i, s) for i, s in sampling if not s.spec_tokens]
            idx = [qsl[i + 1] - 1 for i, _ in sampling]
            rows_idx = (idx[0], idx[-1] + 1) if idx and idx == list(range(idx[0], idx[-1] + 1)) else idx
            reqs = [s.request for _, s in sampling]
        plp = [] if decode else [(i, s, _prompt_logprob_rows(s)) for i, s in enumerate(scheduled)
                                 if s.request.wants_prompt_logprobs and s.start < s.request.num_prompt_tokens - 1]
        # the step's recurrent-state snapshots (hybrids), decided before the forward: the other TP ranks take the same
        saves = (self.state_snapshots.plan_saves(scheduled, slots) if self.state_snapshots is not None
                 and slots is not None else None)
        spans = [(s.start, s.start + s.num_new_tokens) for s in scheduled] if slots is not None else None
        drafts = ([len(s.spec_tokens) for s in scheduled] if slots is not None and any(s.spec_tokens for s in scheduled)
                  else None)
        if self.send_step is not None:
            step = self._step_inputs
            step.spec_logits_rows = _verify_rows(qsl, spec_rows)
            if slots is not None:
                step.state_slots, step.state_restores, step.state_saves = slots, self._state_restores, saves or []
                step.state_spans, step.state_drafts = spans, drafts
                step.state_verify = [(slots[i], len(s.spec_tokens)) for i, s in spec_rows]
            step.graph_rows = graph.batch_size if graph is not None else 0
            step.prompt_graph_tokens = prompt_graph.num_tokens if prompt_graph is not None else 0
            step.calc_kv_scales, step.calc_key_offsets = self.calc_kv_scales_pending, self.calc_key_offsets_pending
            step.logits_rows = ([rows_idx] if reqs else []) + [(qsl[i], qsl[i] + n) for i, _, n in plp]
            step.kv_transfers = sched.kv_transfers  # (each rank copies its own heads' part, at the same slots)
            step.images = image_rows.for_followers() if image_rows is not None else None
            step.prompt_embeds_at = prompt_rows[0] if prompt_rows is not None else None
            step.draft_requests = n_seqs
            step.draft_skip_run = bool(getattr(self.draft, "skips_run", False))
            step.draft_ring_slots = (self.draft.step_ring_slots(sched, t) if self.draft is not None
                                     and hasattr(self.draft, "step_ring_slots") and self.draft.group is not None
                                     else None)
            self.send_step(step)
            # (every rank takes them: a later pipeline stage, which starts from hidden states, drops them)
            self.group.broadcast_(self.buffers.input_ids[:t])
            if image_rows is not None and image_rows.embeds is not None:  # (ImageStep.follow receives them)
                self.group.broadcast_(image_rows.embeds)
            if prompt_rows is not None:
                self.group.broadcast_(prompt_rows[1].contiguous())
        hidden = self._forward(graph, prompt_graph, meta, t, spans, slots, saves, drafts, images)
        if self.draft is not None:  # the draft's KV for the step's tokens, in the same slots
            self.draft.run_step(sched, graph.batch_size if graph is not None else 0, meta)
        if spec_rows:
            self._verify_drafts(hidden, qsl, spec_rows, handle, sched.grammar_masks)
        return LaunchedForward(sched, handle, hidden, meta, qsl, reqs, rows_idx, plp)

    @torch.inference_mode()
    def launch_sampling(self, launched: LaunchedForward) -> StepHandle:
        """Launch the sampling of a step whose forward launch_forward launched; returns before the GPU finishes."""
        sched, handle, hidden, meta, qsl = launched.sched, launched.handle, launched.hidden, launched.meta, launched.qsl
        reqs, rows_idx, plp = launched.reqs, launched.rows_idx, launched.plp
        if reqs:
            rows = (slice(*rows_idx) if isinstance(rows_idx, tuple)
                    else to_device(rows_idx, torch.long, self.device))
            constrained = (sched.grammar_masks.for_requests([r.request_id for r in reqs])
                           if sched.grammar_masks is not None else None)
            greedy = all(r.argmax_only for r in reqs)
            # a greedy batch without grammar masks: the LM head may take the argmax itself (no logits written)
            head_argmax = greedy and constrained is None and hasattr(self.model, "greedy_tokens")
            last = hidden[rows]
            tokens = self.model.greedy_tokens(last) if head_argmax else None
            logits = self.model.compute_logits(last) if tokens is None else None
            bitmask = None  # structured outputs' allowed tokens (core.py fills sched.grammar_masks)
            if constrained is not None:
                dst, words = constrained
                bitmask = TokenBitmask(upload(words, self.device),
                                       None if len(dst) == len(reqs) else to_device(dst, torch.long, self.device))
            if tokens is not None:
                out = self.sampler.argmax_output(tokens)
            elif greedy:
                out = self.sampler.sample_argmax(logits, bitmask)
            else:
                # num_pending counts this step's sample too: the ones before it are still in flight. Only
                # penalties and bad words read the earlier ids (such steps wait for the one in flight:
                # Request.needs_host_history); the others get none (a copy of each output per step otherwise).
                rows = [SamplingRow(r.sampling_params, r.prompt_token_ids, r.sampling_history(),
                                    r.generator, r.num_output_tokens + r.num_pending - 1) for r in reqs]
                out = self.sampler.sample(logits, rows, logits_owned=True,  # fresh lm_head output
                                          token_bitmask=bitmask)
            ids = [r.request_id for r in reqs]
            self._prev_tokens = handle.sampled_device = out.tokens
            self._prev_rows = dict(zip(ids, range(len(ids))))
            out.copy_to_host_async()
            handle.sampler_out = out
            handle.sampled_ids = ids
        for i, s, n in plp:
            handle.prompt_logprobs[s.request.request_id] = self._prompt_logprobs(hidden[qsl[i]:qsl[i] + n], s)
        if self.pooler is not None:  # (launched before the next step's forward can rewrite a graph's hidden buffer)
            self.pooler.forget(sched.released_ids)
            handle.pooled = self.pooler.pool(hidden, qsl, sched.scheduled)
            if handle.pooled is not None:
                handle.pooled.copy_to_host_async()
        if self.draft is not None and hasattr(self.draft, "after_step"):  # MTP: its KV needs the chosen tokens
            self.draft.after_step(sched, meta, hidden, qsl, handle)
        if self.device.type == "cuda":
            handle.event = torch.cuda.Event()
            handle.event.record()
        return handle

    def _forward(self, graph, prompt_graph, meta: AttentionMetadata, t: int,
                 spans: Optional[list[tuple[int, int]]] = None, slots: Optional[list[int]] = None,
                 saves: Optional[list[tuple[int, int]]] = None, drafts: Optional[list[int]] = None,
                 images: Optional[dict] = None) -> torch.Tensor:
        """The step's hidden states: a decode graph's replay, a prompt graph's, or the eager forward. A hybrid
        model's recurrent-state bookkeeping: `slots` (one per request), `spans` (each request's (start, end)
        tokens), `saves` (the snapshots to take after the forward, StateSnapshots.plan_saves) and, in a speculative
        step, `drafts` (each request's draft count: the eager verification keeps per-position states). `images`:
        the image rows for the eager forward (ImageStep.finish)."""
        buf = self.buffers
        assert not (images and (graph is not None or prompt_graph is not None)), "image steps run eagerly"
        if graph is not None:
            if slots is not None:  # the model's own check and bookkeeping do not run in a replay
                self.state_cache.note_step(slots, [a for a, _ in spans], [b for _, b in spans])
            hidden = graph.replay()
        elif prompt_graph is not None:
            hidden = prompt_graph.replay(self.backend, meta)
        else:
            ctx = ForwardContext(meta=meta, kv_caches=self.kv_caches, backend=self.backend,
                                 calc_kv_scales=self.calc_kv_scales_pending,
                                 calc_key_offsets=self.calc_key_offsets_pending)
            self.calc_kv_scales_pending = self.calc_key_offsets_pending = False
            if slots is not None:
                ctx.extra["state_cache"] = self.state_cache
                ctx.extra["state_slots"] = slots
                if drafts is not None:  # per-position states kept
                    ctx.extra["state_drafts"] = drafts
            if images:
                ctx.extra.update(images)
            hidden = self.model(buf.input_ids[:t], buf.positions[:t], ctx)
        if self.state_snapshots is not None and saves:  # snapshots at --mamba-block-size boundaries (decode too)
            self.state_snapshots.apply_saves(saves)
        return hidden

    @torch.inference_mode()
    def execute_follower(self, step: StepInputs) -> None:
        """A tensor-parallel rank other than 0: the step rank 0 launched, from its StepInputs; the forward and the
        same logits rows (their gathers are collectives), nothing sampled."""
        if len(self._follower_events) == 2:  # the staging set about to be refilled was uploaded two steps ago
            self._follower_events.pop(0).synchronize()
        if step.kv_transfers is not None:  # rank 0 ran them first thing too
            self.kv_offload.apply(step.kv_transfers)
        buf = self._ensure_buffers()
        t, rows, width = step.padded_tokens, step.rows, step.table_width
        h = buf.host_set(t, rows)
        h["positions"][:t] = step.positions
        h["slot_mapping"][:t] = step.slot_mapping
        h["query_start_loc"][: rows + 1] = step.query_start_loc
        h["seq_lens"][:rows] = step.seq_lens
        h["block_tables"][: rows * width] = step.block_tables
        slots = step.state_slots if self.state_cache is not None else None
        if slots is not None and step.state_walks is not None:  # a verification in walks (rank 0's fill_walks)
            h["state_slots"][:rows], h["state_walks"][:rows] = step.state_walks[0], step.state_walks[1]
            h["state_walks"][buf.max_seqs:buf.max_seqs + rows] = step.state_walks[2]
        elif slots is not None and step.graph_rows:  # a hybrid's decode graph reads the slots from its buffer
            h["state_slots"][:step.num_seqs] = slots
            h["state_slots"][step.num_seqs:rows] = self.state_cache.pad_slot
        buf.upload(t, step.num_seqs, width, rows, state_slots=slots is not None and step.graph_rows > 0)
        if self.lora is not None:  # rank 0's slot loads and its tokens' adapters
            self.lora.follow_step(step.lora, t)
        images: dict = {}
        self.group.broadcast_(buf.input_ids[:t])  # (a later pipeline stage does not use them)
        if step.images is not None:  # rank 0's image rows (a broadcast after the ids) and scratch rotary rows
            self.image_step.follow(step.images, images, self.group, self.model.config.hidden_size, self.dtype,
                                   with_embeds=self.pp is None or self.pp.first)
        if step.prompt_embeds_at is not None:  # rank 0's prompt-embedding rows (a broadcast after any image rows)
            at = step.prompt_embeds_at
            given = self.group.broadcast_(torch.empty(len(at), self.model.config.hidden_size, dtype=self.dtype,
                                                      device=self.device))
            if self.pp is None or self.pp.first:  # (a later stage starts from hidden states)
                apply_prompt_rows(images, at, given, self.device)
        meta = self._metadata(buf, step.num_tokens, t, rows, step.max_query_len, step.query_start_loc, step.seq_lens)
        graphs = self.verify_graphs if step.state_walks is not None else self.graphs
        graph = graphs.for_batch(step.num_seqs) if step.graph_rows and graphs is not None else None
        prompt_graph = self.prompt_graphs.for_tokens(step.num_tokens) if step.prompt_graph_tokens else None
        if (graph.batch_size if graph else 0) != step.graph_rows or (
                prompt_graph.num_tokens if prompt_graph else 0) != step.prompt_graph_tokens:
            raise RuntimeError("tensor-parallel ranks disagree on the step's CUDA graph")
        self.calc_kv_scales_pending, self.calc_key_offsets_pending = step.calc_kv_scales, step.calc_key_offsets
        if slots is not None and step.state_restores:  # rank 0's prefix-cache hits, into this rank's heads' state
            self.state_snapshots.apply_restores(step.state_restores)
        if slots is not None:  # the slots' token counts as rank 0 checked them (it alone learns accepted drafts)
            for slot, (start, _) in zip(slots, step.state_spans):
                self.state_cache.num_tokens[slot] = start
        hidden = self._forward(graph, prompt_graph, meta, t, step.state_spans, slots, step.state_saves,
                               step.state_drafts, images)
        if self.draft is not None:  # a split drafter's run beside the step (rank 0's run_step, right after it)
            self.draft.follow_run_step(step, meta)
        # (the logits' gathers are TP collectives; under PP stage 0 alone computes them, from the last stage's rows)
        logits_here = self.pp is None or self.pp.first
        if step.spec_logits_rows:  # the verification's logits, then its accepted states (a broadcast from rank 0)
            if logits_here:
                self.model.compute_logits(hidden[to_device(step.spec_logits_rows, torch.long, self.device)])
            if slots is not None and step.state_verify:
                from voltllm.worker.hybrid_spec import follow_accepted_states

                follow_accepted_states(self.state_cache, self.group, step.state_verify)
        for sel in step.logits_rows if logits_here else ():
            self.model.compute_logits(hidden[slice(*sel) if isinstance(sel, tuple)
                                             else to_device(sel, torch.long, self.device)])
        if self.draft is not None:  # a split drafter's part after the logits (MTP / EAGLE: rank 0's after_step)
            self.draft.follow_after_step(step, meta, hidden)
        if self.device.type == "cuda":
            self._follower_events.append(torch.cuda.Event())
            self._follower_events[-1].record()

    def _verify_drafts(self, hidden: torch.Tensor, qsl: list[int], rows: list, handle: StepHandle,
                       grammar_masks=None) -> None:
        """Speculative rows: the model's greedy choice after the known token and after each draft (the last
        1 + drafts positions of each request), taken to the host with the step; collect() accepts from them.
        Structured outputs: each constrained row's logits are masked first (logprobs included, as the sampler
        does), with the grammar's mask after the drafts before the row."""
        logits = self.model.compute_logits(hidden[to_device(_verify_rows(qsl, rows), torch.long, self.device)])
        draft_ids = self.draft.verification_drafts(rows) if self.draft is not None else None
        known = _known_drafts(rows, draft_ids, grammar_masks)
        if grammar_masks is not None and known is not None:
            constrained = grammar_masks.verification(known)
            if constrained is not None:
                dst, words = constrained
                apply_token_bitmask_(logits, TokenBitmask(upload(words, self.device),
                                                          to_device(dst, torch.long, self.device)))
        if all(s.request.argmax_only for _, s in rows):
            out = self.sampler.sample_argmax(logits)  # the model's choices: collect() compares the drafts
        else:  # speculative sampling: per row, accept / reject its draft and a replacement token
            sampling_rows, drafts = [], []
            for n, (_, s) in enumerate(rows):
                r = s.request
                history = r.sampling_history()  # (penalties: every generated id; no step is in flight here)
                # bad words read the drafts before each row too (penalties count them from `prior`, below)
                before = known[n][1] if r.sampling_params.bad_words else ()
                for j in range(len(s.spec_tokens) + 1):
                    sampling_rows.append(SamplingRow(r.sampling_params, r.prompt_token_ids, history, r.generator,
                                                     r.num_output_tokens + j, before[:j]))
                    drafts.append(s.spec_tokens[j] if j < len(s.spec_tokens) else -1)
            q, drawn = self.draft.verification_probs(rows) if self.draft is not None else (None, None)
            all_drafts = drafts if draft_ids is None else draft_ids
            prior = (_drafts_before_rows(rows, all_drafts, self.device)
                     if any(s.request.sampling_params.has_penalties for _, s in rows) else None)
            out = self.sampler.verify_drafts(logits, sampling_rows, all_drafts, q, drawn, prior)
        handle.spec_lp = self._verification_logprobs(logits, rows, draft_ids, out.tokens)
        if self.state_cache is not None:  # the recurrent states after each request's last accepted draft
            from voltllm.worker.hybrid_spec import keep_accepted_states

            handle.spec_states = keep_accepted_states(self.state_cache, rows, out, draft_ids, self.group)
        handle.spec_device = (out.tokens, getattr(out, "accepted", None))
        out.copy_to_host_async()
        handle.spec_out = out
        handle.spec_drafts = [(s.request.request_id, s.spec_tokens) for _, s in rows]
        if draft_ids is not None:
            handle.spec_draft_ids = draft_ids if draft_ids.device.type != "cuda" else pinned_copy(draft_ids)

    def _verification_logprobs(self, logits: torch.Tensor, rows: list, draft_ids: Optional[torch.Tensor],
                               own: torch.Tensor) -> Optional[SpecLogprobs]:
        """The logprobs of the verification rows of requests that asked for them (SpecLogprobs; copies to the host
        started), None when none did."""
        take, ks, at = [], [], 0
        for _, s in rows:
            n, k = len(s.spec_tokens) + 1, s.request.sampling_params.logprobs
            if k is not None:
                take += range(at, at + n)
                ks += [k] * n
            at += n
        if not take:
            return None
        if draft_ids is None:  # the host's drafts (n-gram, suffix): the scheduled tokens themselves
            draft_ids = to_device([d for _, s in rows for d in (*s.spec_tokens, -1)], torch.long, logits.device)
        lp = SpecLogprobs.take(logits, take, ks, draft_ids, own)
        lp.copy_to_host_async()
        return lp

    def collect(self, handle: StepHandle) -> RunnerOutput:
        """Wait for a launched step and return its sampled tokens (host side)."""
        if handle.event is not None:
            handle.event.synchronize()
        out = RunnerOutput(prompt_logprobs=handle.prompt_logprobs)
        if handle.pooled is not None:
            out.pooled = handle.pooled.to_host()
        if handle.spec_out is not None:
            tokens, accepted = handle.spec_out.to_host()
            sampled = isinstance(handle.spec_out, DraftVerdicts)
            draft_ids = handle.spec_draft_ids.tolist() if handle.spec_draft_ids is not None else None
            lps = handle.spec_lp.to_host() if handle.spec_lp is not None else {}
            at = 0
            for rid, drafts in handle.spec_drafts:
                rows = slice(at, at + len(drafts) + 1)
                if draft_ids is not None:  # a draft model's, made on the device
                    drafts = draft_ids[at:at + len(drafts)]
                verified = (accept_sampled(drafts, accepted[rows], tokens[rows]) if sampled
                            else accept_drafts(drafts, tokens[rows]))
                if at in lps:  # (its rows were taken: it asked for logprobs)
                    out.verified_logprobs[rid] = [verified_position_logprobs(lps[at + j], t)
                                                  for j, t in enumerate(verified)]
                at += len(drafts) + 1
                out.verified[rid] = verified
                out.sampled[rid] = verified[-1]
            if handle.spec_states:
                from voltllm.worker.hybrid_spec import settle_states

                settle_states(self.state_cache, handle.spec_states, out.verified)
        if handle.sampler_out is not None:
            tokens, logprobs = handle.sampler_out.to_host()
            for rid, tok, lp in zip(handle.sampled_ids, tokens, logprobs):
                out.sampled[rid] = tok
                if lp is not None:
                    out.logprobs[rid] = lp
        return out

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.collect(self.execute_async(sched))

    # -- CUDA graphs ----------------------------------------------------------------------------
    def tune_decode_gemms(self) -> None:
        self._apply_pdl()
        if self.device.type == "cuda":  # collect dead engines (and their graphs) now, not during a capture
            import gc

            gc.collect()
        if self.device.type == "cuda" and self.dtype in (torch.float16, torch.bfloat16):
            from voltllm.worker.cuda_graphs import decode_capture_sizes
            from voltllm.worker.skinny_tuning import tune_batch_gemm, tune_skinny_gemm

            models = [self.model] + ([self.draft.model] if self.draft is not None else [])
            for model in models:
                tune_skinny_gemm(model)  # sets each Linear's choice
            self._tune_quant_tiles()
            # decode batches run at the CUDA-graph sizes; the compat route keeps cuBLAS (on sm_70/75 the
            # batch GEMM's tl.dot is CUDA-core FMA, and --compat on a newer GPU must not time tensor cores).
            # Without decode graphs (--enforce-eager) every step is launched by the host, and a Triton tile's launch
            # costs it 39-66 us against cuBLAS's 13-16 at the same GPU time (H100, 8B shapes, 3-64 rows,
            # results/session68/eager-gemm-host-cost-h100.txt): cuBLAS there too
            if self.config.device.compat == "none" and not self.config.device.enforce_eager:
                sizes = decode_capture_sizes(self.config.scheduler.max_num_seqs, self.config.device.cuda_graphs)
                for model in models:
                    tune_batch_gemm(model, sizes, head_argmax=model is self.model)
                from voltllm.worker.norm_fold_tuning import tune_norm_fold

                tune_norm_fold(self.model, sizes)  # (after tune_batch_gemm: it times the layers on those choices)

    def _tune_quant_tiles(self) -> None:
        """Weights kept quantized: the dequant-GEMM's tile per kind, shape and row class, timed on this GPU."""
        from voltllm.model.layers.quantized_linear import QuantizedLinearMethod

        method = next((m.method for m in self.model.modules() if isinstance(getattr(m, "method", None),
                                                                            QuantizedLinearMethod)), None)
        if method is None:
            return
        from voltllm.worker.quant_tuning import tune_quant_tiles

        t0 = time.monotonic()
        try:
            # the tensor-core GEMV only off the compat route (there the card stands in for one without them)
            lines = tune_quant_tiles(self.model, method, self.dtype, tensor_cores=self.config.device.compat == "none")
        except Exception as e:  # noqa: BLE001 - timing is an optimisation: keep the default tiles
            logger.warning("dequant-GEMM tile timing failed (%s); default tiles", e)
            method.tiles.clear()
            return
        logger.info("dequant-GEMM tiles chosen in %.1f s:\n  %s", time.monotonic() - t0, "\n  ".join(lines))

    def warm_up_mixed_step(self) -> None:
        """CUDA: one eager forward of a small mixed step, so the kernel forms such steps take compile now and not
        inside the first one (worker/warm_up.py)."""
        if self.device.type != "cuda" or not self.kv_caches:
            return
        from voltllm.worker.warm_up import mixed_step_forward

        t0 = time.monotonic()
        mixed_step_forward(self)
        torch.cuda.synchronize(self.device)
        logger.info("ran a mixed-step warm-up forward in %.1f s", time.monotonic() - t0)

    def capture_cuda_graphs(self) -> None:
        if self.device.type != "cuda" or self.config.device.enforce_eager or self.backend.name != "TRITON_ATTN":
            logger.info("CUDA graphs off (%s)", "--enforce-eager or cudagraph_mode NONE / -O0"
                        if self.config.device.enforce_eager else "not supported by this device/backend")
            return
        if not getattr(self.model, "supports_cuda_graphs", True):  # (a model whose steps need host work a replay skips)
            logger.info("CUDA graphs off (this model's steps cannot be replayed: eager steps)")
            return
        from voltllm.lora.manager import optional_lora

        try:
            with optional_lora(self.lora):  # the graphs record the LoRA terms (a replay reads the step's mask)
                self._capture_graphs()
        except torch.OutOfMemoryError:
            free, total = torch.cuda.mem_get_info(self.device)
            raise RuntimeError(
                f"{self.device} ran out of memory capturing the decode CUDA graphs ({free / 2**30:.2f} of "
                f"{total / 2**30:.1f} GiB free): lower --gpu-memory-utilization (the KV cache takes that share) or "
                "--max-num-seqs / --max-cudagraph-capture-size (fewer graphs), or pass --enforce-eager") from None

    def drop_cuda_graphs(self) -> None:
        """Forget the captured CUDA graphs and their memory pools (sleep mode: they recorded the addresses of weights
        and KV tensors about to be released); capture_cuda_graphs captures them again."""
        self.graphs = self.verify_graphs = self.prompt_graphs = None

    def _capture_graphs(self) -> None:
        from voltllm.worker.cuda_graphs import DecodeGraphs

        t0 = time.monotonic()
        self._apply_pdl()
        self._ensure_buffers()
        # a hybrid's plain decode steps have a row per request (its verifications replay the walks set, below)
        self.graphs = DecodeGraphs(self, rows=self.config.scheduler.max_num_seqs if self.is_hybrid else None)
        self.graphs.capture()
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s", len(self.graphs.graphs),
                    self.graphs.sizes, time.monotonic() - t0)
        # (a hybrid whose verification needs more than its GDN layers' walks, Qwen4-Exp's PLE, verifies eagerly)
        if self.is_hybrid and self.config.speculative is not None and getattr(self.model, "supports_verify_graphs",
                                                                                True):
            from voltllm.worker.hybrid_spec import capture_verify_graphs

            self.verify_graphs = capture_verify_graphs(self)
        if self.draft is not None and not self.config.speculative.draft_enforce_eager:
            # the draft's one-token steps and its run beside decode / verification steps
            t0 = time.monotonic()
            self.draft.capture_graphs()
            logger.info("captured the draft model's decode CUDA graphs in %.1f s", time.monotonic() - t0)
        self._capture_prompt_graphs()

    def prompt_graph_max_tokens(self) -> int:
        """Largest prompt step replayed from piecewise graphs (0: none): attention-only models only."""
        if self.is_hybrid or not getattr(self.model, "supports_prompt_graphs", False):
            return 0
        top = self.config.device.prompt_graph_max_tokens
        if top is None:
            from voltllm.worker.prompt_graphs import auto_max_tokens, device_speed

            layers = self.model.layers
            top = auto_max_tokens(sum(p.in_features * p.out_features for layer in layers
                                      for p in layer.projections()) / max(len(layers), 1), device_speed(self.device))
        # (a step never holds more than max_num_seqs sequences of at most max_model_len tokens)
        sched = self.config.scheduler
        return min(top, sched.max_num_batched_tokens, sched.max_num_seqs * self.config.model.max_model_len)

    def _capture_prompt_graphs(self) -> None:
        from voltllm.worker.prompt_graphs import PromptGraphs

        top = self.prompt_graph_max_tokens()
        graphs = PromptGraphs(self, top)
        if not graphs.sizes:
            return
        t0 = time.monotonic()
        try:
            graphs.capture(self.graphs.pool)
        except torch.OutOfMemoryError:  # the KV cache was sized with an estimate of their memory: keep serving
            del graphs
            if torch.cuda.is_available():
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
            logger.warning("prompt steps run eagerly: capturing their CUDA graphs ran out of GPU memory (a lower "
                           "--gpu-memory-utilization leaves room for them)")
            return
        self.prompt_graphs = graphs
        logger.info("captured piecewise prompt CUDA graphs (%s tokens, %d pieces each) in %.1f s", graphs.sizes,
                    len(graphs.graphs[graphs.sizes[-1]].pieces), time.monotonic() - t0)

    def _prompt_logprobs(self, hidden: torch.Tensor, s) -> list[PositionLogprobs]:
        """Logprobs of prompt tokens start+1 .. (end of this chunk, within the prompt); hidden: this chunk's rows
        that predict prompt tokens (_prompt_logprob_rows of them)."""
        req = s.request
        n = hidden.shape[0]
        last = s.start + n
        lp = self.model.compute_logits(hidden).float().log_softmax(dim=-1)
        targets = torch.tensor(req.prompt_token_ids[s.start + 1:last + 1], device=lp.device)
        chosen = lp.gather(1, targets[:, None]).squeeze(1)
        ranks = token_ranks(lp, chosen).tolist()
        chosen = chosen.tolist()
        k = req.sampling_params.prompt_logprobs
        top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (None, None)
        top_i = top_i.tolist() if k > 0 else [[]] * n
        top_v = top_v.tolist() if k > 0 else [[]] * n
        tl = targets.tolist()
        return [position_logprobs(tl[j], chosen[j], ranks[j], top_i[j], top_v[j]) for j in range(n)]


def _drafts_before_rows(rows: list, drafts: "list[int] | torch.Tensor", device: torch.device) -> torch.Tensor:
    """Per verification row, the drafts of its request before it ([rows, K], -1 padded): what penalties count as
    generated there beyond the host history. drafts: every row's draft (-1 after a request's last), on the host or
    the device."""
    idx, at = [], 0
    kmax = max(len(s.spec_tokens) for _, s in rows)
    for _, s in rows:
        k = len(s.spec_tokens)
        idx += [[at + i if i < j else -1 for i in range(kmax)] for j in range(k + 1)]
        at += k + 1
    idx_t = to_device([i for row in idx for i in row], torch.long, device).view(len(idx), kmax)
    d = drafts if isinstance(drafts, torch.Tensor) else to_device(drafts, torch.long, device)
    return torch.where(idx_t >= 0, d[idx_t.clamp_min(0)], -1)


def _prompt_logprob_rows(s) -> int:
    """How many of a scheduled chunk's rows predict prompt tokens (their logprobs are asked for): from its start to
    the end of the chunk or the prompt's last token, whichever is first."""
    return min(s.start + s.num_new_tokens, s.request.num_prompt_tokens - 1) - s.start


def _known_drafts(rows: list, draft_ids: Optional[torch.Tensor], grammar_masks) -> Optional[list[tuple[str, list]]]:
    """Each drafting request's id and drafts on the host, in the verification's order, when a grammar's masks or bad
    words need them (a drafter's are copied from the device: the step waits for them); else None."""
    if not ((grammar_masks is not None and grammar_masks.drafting)
            or any(s.request.sampling_params.bad_words for _, s in rows)):
        return None
    host = draft_ids.tolist() if draft_ids is not None else None
    out, at = [], 0
    for _, s in rows:
        n = len(s.spec_tokens)
        out.append((s.request.request_id, host[at:at + n] if host is not None else list(s.spec_tokens)))
        at += n + 1
    return out


def _verify_rows(qsl: list[int], rows: list) -> list[int]:
    """A speculative step's verification rows: each drafting request's (index, ScheduledRequest) known token and
    drafts, its last 1 + drafts positions."""
    return [p for i, s in rows for p in range(qsl[i + 1] - 1 - len(s.spec_tokens), qsl[i + 1])]
