"""vLLM's --enable-mfu-metrics: each step's estimated FLOPs and bytes read and written per GPU, summed into counters
(GET /metrics: estimated_flops_per_gpu_total, estimated_read_bytes_per_gpu_total, estimated_write_bytes_per_gpu_total)
and logged as TF/s and GB/s per GPU with the periodic stats line.

The estimate is the bench's cost model of the loaded model (bench/limits.py ModelCost: matmul weights, the LM head,
K / V bytes per token, a hybrid's recurrent state, MoE experts touched, sliding windows), applied to what the step
scheduled: per request, its new tokens' matmuls (2 x active weights each), its attention (4 x layers x query heads x
head dim per attended position, causal within the step), its sampled rows' LM head, its context's K / V and recurrent
state read and its new tokens' K / V (and state) written; per step, the weights it reads (the routed experts its
tokens touch). Activations are not counted. Per GPU: the sum over the engine's ranks divided by their number (an
estimate: under tensor or pipeline parallelism the whole model's cost is taken from its meta-device build).
"""
from __future__ import annotations

from typing import Any

# the SchedulerStats.extra keys (cumulative, per GPU), also the metric names without the prefix and _total
FLOPS, READ, WRITE = "estimated_flops_per_gpu", "estimated_read_bytes_per_gpu", "estimated_write_bytes_per_gpu"


class StepPerf:
    def __init__(self, cost: Any, gpus: int = 1):
        self.cost = cost
        self.gpus = max(1, gpus)
        self.flops = 0.0
        self.read = 0.0
        self.write = 0.0

    def add(self, scheduled: list) -> None:
        """One step of ScheduledRequests (each with request, start, num_new_tokens, spec_tokens)."""
        c = self.cost
        attn_per_pos = 4 * c.attention_layers * c.q_heads * c.head_dim
        active = c.active_matmul_params()
        tokens = 0
        flops = read = write = 0.0
        for s in scheduled:
            n, start = s.num_new_tokens, s.start
            if n <= 0:
                continue
            tokens += n
            end = start + n
            sampled = len(s.spec_tokens) + 1 if end >= s.request.num_prompt_tokens else 0
            # causal within the step: token i of n attends to start + i + 1 positions (mean: start + (n + 1) / 2)
            flops += 2 * active * n + 2 * c.logits_params * sampled + attn_per_pos * n * c.attended(
                start + (n + 1) / 2)
            read += c.kv_bytes_per_token * c.attended(end) + c.state_bytes_per_request
            write += c.kv_bytes_per_token * n + c.state_bytes_per_request
        if not tokens:
            return
        read += c.weight_bytes - c.expert_bytes * (1.0 - c.experts_touched(tokens))
        self.flops += flops / self.gpus
        self.read += read / self.gpus
        self.write += write / self.gpus

    def totals(self) -> dict:
        return {FLOPS: self.flops, READ: self.read, WRITE: self.write}


def step_perf_for(config: Any, runner: Any) -> StepPerf:
    """The estimator of an engine: the loaded model's cost (quantized weights at their held size) on one GPU, the
    whole model's meta-device cost divided over the ranks under tensor / pipeline parallelism."""
    from voltllm.bench.limits import model_cost

    hf = config.model.hf_config
    gpus = config.parallel.tensor_parallel_size * config.parallel.pipeline_parallel_size
    if gpus == 1:
        return StepPerf(model_cost(runner.model, hf, runner.kv_dtype))
    import torch

    from voltllm.model.models.registry import build_model

    with torch.device("meta"):
        whole = build_model(hf, runner.dtype, 1)
    return StepPerf(model_cost(whole, hf, runner.kv_dtype), gpus)
