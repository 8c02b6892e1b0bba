"""Model runner: loads the model, owns the KV cache, turns a scheduled step into one forward + sampling."""
from __future__ import annotations

import logging
import time
from typing import Optional

import numpy as np
import torch

from voltllm.attention.backend import AttentionBackend, AttentionMetadata, make_kv_cache
from voltllm.config import EngineConfig
from voltllm.engine.scheduler import RunnerOutput, SchedulerOutput
from voltllm.engine.types import PositionLogprobs
from voltllm.model.forward_context import ForwardContext
from voltllm.sampling.sampler import Sampler, SamplingRow

logger = logging.getLogger("voltllm")


def select_attention_backend(config: EngineConfig) -> AttentionBackend:
    name = (config.device.attention_backend or "").upper()
    if config.device.device.type == "cpu" or name == "TORCH_REF":
        from voltllm.attention.torch_ref import TorchReferenceBackend

        return TorchReferenceBackend()
    try:
        from voltllm.attention.triton_backend import TritonAttentionBackend
    except ImportError:
        from voltllm.attention.torch_ref import TorchReferenceBackend

        logger.warning("Triton attention backend unavailable; using the torch reference backend")
        return TorchReferenceBackend()
    return TritonAttentionBackend()


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights in place (speed depends on shapes, not values): N(0, 0.02), norms at 1."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: Optional[torch.nn.Module] = None):
        self.config = config
        self.device = config.device.device
        self.dtype = config.model.dtype
        self.block_size = config.cache.block_size
        self.model = model if model is not None else self._load_model()
        self.backend = select_attention_backend(config)
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.sampler = Sampler()

    # -- set-up ---------------------------------------------------------------------------------
    def _load_model(self) -> torch.nn.Module:
        from voltllm.model.loader import iter_weights, resolve_model
        from voltllm.model.models.registry import build_model

        t0 = time.monotonic()
        mc = self.config.model
        with torch.device(self.device):
            model = build_model(mc.hf_config, self.dtype, mc.max_model_len)
        if mc.load_format == "dummy":
            init_dummy_weights(model, mc.seed)
            logger.info("random weights at the shapes of %s (--load-format dummy)", mc.model)
            return model.eval()
        model.load_weights((n, t.to(self.dtype) if t.is_floating_point() else t)
                           for n, t in iter_weights(resolve_model(mc.model), mc.hf_config))
        model.eval()
        logger.info("loaded %s (%s) in %.1f s", mc.model, mc.architecture, time.monotonic() - t0)
        return model

    def kv_block_bytes(self) -> int:
        heads, dim = self.model.kv_heads_and_dim
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return 2 * self.block_size * heads * dim * elem * self.model.num_attention_layers

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.dtype

    def determine_num_blocks(self) -> int:
        cc = self.config.cache
        if cc.num_gpu_blocks_override:
            return cc.num_gpu_blocks_override
        per_block = self.kv_block_bytes()
        sc = self.config.scheduler
        useful = sc.max_num_seqs * -(-sc.max_model_len // self.block_size) + 1
        if self.device.type == "cpu":
            return max(1, min(useful, cc.cpu_kv_cache_bytes // per_block))
        from voltllm.worker.memory import kv_budget_bytes

        budget = kv_budget_bytes(self, cc.gpu_memory_utilization)
        num = min(useful, budget // per_block)
        if num < -(-sc.max_model_len // self.block_size):
            raise RuntimeError(
                f"not enough GPU memory for the KV cache: {budget / 2**30:.2f} GiB left after weights and "
                f"activations holds {num} blocks, fewer than one request of --max-model-len "
                f"{sc.max_model_len} needs; lower --max-model-len or raise --gpu-memory-utilization")
        return int(num)

    def initialize_kv_cache(self) -> int:
        self.num_blocks = self.determine_num_blocks()
        heads, dim = self.model.kv_heads_and_dim
        self.kv_caches = make_kv_cache(self.model.num_attention_layers, self.num_blocks, self.block_size,
                                       heads, dim, self.kv_dtype, self.device)
        gib = self.num_blocks * self.kv_block_bytes() / 2**30
        logger.info("KV cache: %d blocks of %d tokens = %d tokens, %.2f GiB (%s)", self.num_blocks,
                    self.block_size, self.num_blocks * self.block_size, gib, self.kv_dtype)
        return self.num_blocks

    # -- one step -------------------------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput):
        bs = self.block_size
        ids, pos, slots = [], [], []
        qsl = [0]
        seq_lens = []
        max_blocks = max(len(s.block_ids) for s in sched.scheduled)
        table = np.zeros((len(sched.scheduled), max_blocks), dtype=np.int32)
        for i, s in enumerate(sched.scheduled):
            req = s.request
            n = s.num_new_tokens
            ids.extend(req.all_token_ids[s.start:s.start + n])
            p = np.arange(s.start, s.start + n)
            bids = np.asarray(s.block_ids, dtype=np.int64)
            table[i, : len(bids)] = bids
            pos.append(p)
            slots.append(bids[p // bs] * bs + p % bs)
            qsl.append(qsl[-1] + n)
            seq_lens.append(s.start + n)
        dev = self.device
        input_ids = torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True)
        positions = torch.from_numpy(np.concatenate(pos)).to(dev, non_blocking=True)
        meta = AttentionMetadata(
            num_tokens=len(ids),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32).to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(table).to(dev, non_blocking=True),
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev, non_blocking=True),
            max_query_len=max(qsl[i + 1] - qsl[i] for i in range(len(seq_lens))),
            max_seq_len=max(seq_lens), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
        return input_ids, positions, meta

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        input_ids, positions, meta = self.prepare(sched)
        ctx = ForwardContext(meta=meta, kv_caches=self.kv_caches, backend=self.backend)
        hidden = self.model(input_ids, positions, ctx)
        out = RunnerOutput()

        qsl = meta.query_start_loc_cpu
        sample_idx = [qsl[i + 1] - 1 for i, s in enumerate(sched.scheduled) if s.samples]
        sampling = [s for s in sched.scheduled if s.samples]
        if sampling:
            logits = self.model.compute_logits(hidden[sample_idx])
            rows = [SamplingRow(s.request.sampling_params, s.request.prompt_token_ids,
                                s.request.output_token_ids, s.request.generator) for s in sampling]
            tokens, logprobs = self.sampler(logits, rows)
            for s, tok, lp in zip(sampling, tokens, logprobs):
                out.sampled[s.request.request_id] = tok
                if lp is not None:
                    out.logprobs[s.request.request_id] = lp
        for i, s in enumerate(sched.scheduled):
            req = s.request
            if req.wants_prompt_logprobs and s.start < req.num_prompt_tokens - 1:
                out.prompt_logprobs[req.request_id] = self._prompt_logprobs(hidden[qsl[i]:qsl[i + 1]], s)
        return out

    def _prompt_logprobs(self, hidden: torch.Tensor, s) -> list[Optional[PositionLogprobs]]:
        """Logprobs of prompt tokens start+1 .. (end of this chunk, within the prompt)."""
        req = s.request
        last = min(s.start + s.num_new_tokens, req.num_prompt_tokens - 1)  # rows predicting prompt tokens
        n = last - s.start
        lp = self.model.compute_logits(hidden[:n]).log_softmax(dim=-1)
        targets = torch.tensor(req.prompt_token_ids[s.start + 1:last + 1], device=lp.device)
        chosen = lp.gather(1, targets[:, None]).squeeze(1).tolist()
        k = req.sampling_params.prompt_logprobs
        top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (None, None)
        result: list[Optional[PositionLogprobs]] = []
        for j in range(n):
            d = {int(targets[j]): chosen[j]}
            if k > 0:
                for t, v in zip(top_i[j].tolist(), top_v[j].tolist()):
                    d.setdefault(t, v)
            result.append(d)
        return result
