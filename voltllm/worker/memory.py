"""GPU memory sizing: profile one forward at the configured token budget, give the rest to the KV cache."""
from __future__ import annotations

import logging
from typing import Optional

import torch

from voltllm.attention.backend import AttentionMetadata, make_kv_cache
from voltllm.model.forward_context import ForwardContext

logger = logging.getLogger("voltllm")


def profiled_tokens(runner) -> int:
    """The token count of the profiled forward: --max-num-batched-tokens, at most --max-model-len."""
    sc = runner.config.scheduler
    return min(sc.max_num_batched_tokens, sc.max_model_len)


@torch.inference_mode()
def profile_activation_bytes(runner) -> int:
    """Peak memory of one forward over --max-num-batched-tokens tokens (one sequence) beyond the weights, less the
    buffers an attention backend allocates in it and keeps (the compat prefill workspace, sized for --max-model-len):
    those stay allocated, so kv_budget_bytes charges them with the engine's memory in use, once."""
    dev = runner.device
    n = profiled_tokens(runner)
    bs = runner.block_size
    nblocks = -(-n // bs)
    heads, dim = runner.model.kv_heads_and_dim
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    caches = make_kv_cache(runner.model.num_attention_layers, nblocks, bs, heads, dim, runner.kv_dtype, dev)
    draft = getattr(runner, "draft", None)  # draft-model speculation: its forward follows the target's on each step
    draft_caches = draft.profile_caches(nblocks, bs, runner.kv_dtype) if draft is not None else None
    backends = [runner.backend] + ([draft.backend] if getattr(draft, "backend", None) is not None else [])
    kept_before = sum(b.workspace_bytes() for b in backends)
    cache_bytes = torch.cuda.memory_allocated(dev) - base
    meta = AttentionMetadata(
        num_tokens=n, query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        block_tables=torch.arange(nblocks, dtype=torch.int32, device=dev)[None],
        slot_mapping=torch.arange(n, dtype=torch.long, device=dev), max_query_len=n, max_seq_len=n,
        query_start_loc_cpu=[0, n], seq_lens_cpu=[n])
    ids = torch.zeros(n, dtype=torch.long, device=dev)
    hidden = runner.model(ids, torch.arange(n, device=dev), ForwardContext(meta, caches, runner.backend))
    if draft_caches is not None:  # (while the target's hidden states wait for their logits)
        draft.model(ids, torch.arange(n, device=dev), ForwardContext(meta, draft_caches, draft.backend))
    # (a verification's logits: a row per token, up to max_decode_rows) + the sampler's fp32 copy; a pooling model
    # has no head: its step's extra is an fp32 copy of the rows it pools (MEAN: all of them)
    pp = getattr(runner, "pp", None)
    if pp is not None and not pp.first:  # a later pipeline stage: rank 0 computes the logits
        pass
    elif getattr(runner, "pooler", None) is None:
        runner.model.compute_logits(hidden[-min(n, runner.max_decode_rows):]).float()
    else:
        hidden.float()
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base - cache_bytes
    kept = sum(b.workspace_bytes() for b in backends) - kept_before
    del caches, draft_caches, hidden
    torch.cuda.empty_cache()
    return int(max(peak - kept, _tower_peak_bytes(runner)) + _kept_image_rows_bytes(runner))


def _kept_image_rows_bytes(runner) -> int:
    """The tower rows an engine that takes images keeps across steps: those of images being prefilled (a whole image,
    while chunked prefill is inside it: the largest one's rows) and the recent ones (ImageStep.recent, up to a step's
    tokens); charged as the larger of two steps' tokens of rows and the largest image's plus one step's (a Qwen3-VL
    row holds its deepstack levels' too)."""
    step = getattr(runner, "image_step", None)
    if step is None:
        return 0
    t, h, w = step.largest_grid
    largest = t * h * w // (step.tower.merge ** 2) if step.tower is not None else 0
    width = runner.model.config.hidden_size * (1 + step.deepstack_levels)
    return max(2 * step.capacity, largest + step.capacity) * width * runner.dtype.itemsize


def _tower_peak_bytes(runner) -> int:
    """An engine that takes images: the vision tower's peak on the largest image (it runs before a step's forward, so
    the two peaks do not add up); 0 otherwise."""
    step = getattr(runner, "image_step", None)
    if step is None or step.tower is None:  # (a tensor-parallel rank > 0 has no tower)
        return 0
    dev = runner.device
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    step.profile(step.largest_grid)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    torch.cuda.empty_cache()
    return int(peak)


def prompt_graph_bytes(runner, activations: int) -> int:
    """Memory the piecewise prompt graphs keep (voltllm.worker.prompt_graphs): the activation peak scaled to their
    largest token count (activations grow with tokens), plus their static q / output buffers."""
    if runner.config.device.enforce_eager:
        return 0
    from voltllm.worker.prompt_graphs import prompt_graph_sizes

    sizes = prompt_graph_sizes(runner.prompt_graph_max_tokens())
    if not sizes:
        return 0
    top = sizes[-1]  # the largest bucket (a power of two)
    n = profiled_tokens(runner)
    attn = runner.model.layers[0].self_attn
    itemsize = torch.tensor([], dtype=runner.dtype).element_size()
    return int(activations * min(1.0, top / max(n, 1))) + 2 * top * attn.num_heads * attn.head_dim * itemsize


def chunk_workspace_slack_bytes(model: torch.nn.Module, max_num_seqs: int) -> int:
    """Hybrid models: the Gated DeltaNet chunk kernels' workspaces grow with a step's chunk count (each request's
    tokens are cut into chunks of 64 of its own), which the profiled forward, one sequence, keeps at its least. A
    step of up to max_num_seqs requests has at most that many chunks more (one partial chunk each); one layer's
    workspaces live at a time. 0 for models without GDN layers."""
    from voltllm.kernels.gdn_chunk import workspace_bytes
    from voltllm.model.layers.gdn import GatedDeltaNet

    return max((workspace_bytes(max_num_seqs, m.nv, m.dk, m.dv) for m in model.modules()
                if isinstance(m, GatedDeltaNet)), default=0)


def free_bytes_at_start(device: torch.device) -> int:
    """Free memory on `device` before an engine allocates anything (ModelRunner records it first thing)."""
    return torch.cuda.mem_get_info(device)[0]


def kv_budget_bytes(runner, utilization: float, fixed: Optional[int] = None, state_bytes: int = 0) -> int:
    """Bytes for the KV blocks. --gpu-memory-utilization is this engine's share of the card, as in vLLM: what other
    processes hold is not charged to it (two engines at 0.45 can share one GPU), but the budget never exceeds what is
    free now. The engine's own use is what the card lost since the runner started (weights, CUDA workspaces) or, if
    larger, what this process's torch allocator holds (a model built before the runner).
    fixed (--kv-cache-memory-bytes): the cache's size instead of the share; the recurrent-state slots
    (state_bytes, allocated already) are part of it. More than is free after activations is an error."""
    dev = runner.device
    activations = profile_activation_bytes(runner)
    free, total = torch.cuda.mem_get_info(dev)
    # (a runner built without the snapshot is charged everything in use, as a lone engine would be)
    ours = max(torch.cuda.memory_reserved(dev), getattr(runner, "free_at_start", total) - free)
    others = max(total - free - ours, 0)
    reserve = 256 << 20  # decode CUDA graphs, sampler temporaries, allocator slack
    prompt_graphs = prompt_graph_bytes(runner, activations)
    activations += chunk_workspace_slack_bytes(runner.model, runner.config.scheduler.max_num_seqs)
    extra = activations + reserve + prompt_graphs
    if fixed is not None:
        budget = share = fixed - state_bytes
        if budget > free - extra:
            raise RuntimeError(f"--kv-cache-memory-bytes {fixed / 2**30:.2f} GiB does not fit: "
                               f"{max(free - extra + state_bytes, 0) / 2**30:.2f} GiB is free after the weights, "
                               f"activations ({activations / 2**30:.2f} GiB) and CUDA graphs; lower it")
    else:
        share = int(total * utilization) - ours - extra
        budget = min(share, free - extra)
    logger.info("memory: %.2f GiB total, %.2f GiB in use by this engine (weights), %.2f GiB by others, %.2f GiB "
                "activation peak, %.2f GiB prompt graphs -> %.2f GiB for KV%s", total / 2**30, ours / 2**30,
                others / 2**30, activations / 2**30, prompt_graphs / 2**30, max(budget, 0) / 2**30,
                " (--kv-cache-memory-bytes)" if fixed is not None else
                " (capped by the free memory: others hold part of this engine's share)" if budget < share else "")
    return max(budget, 0)
