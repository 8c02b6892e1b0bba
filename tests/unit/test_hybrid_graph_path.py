"""The CUDA-graph decode path of hybrid (Gated DeltaNet) models, on the CPU.

A real graph needs a GPU (tests/gpu/test_hybrid_gpu.py). Here each captured graph is stood in for by
`EagerReplay`: the forward a graph holds, run eagerly on the same persistent buffers and the same
ForwardContext (DecodeGraphs.context), so the runner's replay path is exercised as on the GPU: the slot
buffer it fills (padding rows on the scratch slot), the state bookkeeping it does itself (note_step,
allocation, release, snapshot restores and saves), and the GDN layer's device-slot path. Tokens must equal
the plain eager engine's.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from voltllm.worker.cuda_graphs import DecodeGraphs  # noqa: E402

from tiny_models import HYBRID_MOE as MOE, HYBRID_VOCAB as VOCAB, make_tiny_hybrid  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {kind: make_tiny_hybrid(tmp_path_factory.mktemp(kind), kind, 700 + i, 800 + i,
                                   **(MOE if kind == "qwen3_next" else {}))
            for i, kind in enumerate(("qwen3_5", "qwen3_next"))}


class EagerReplay:
    """A captured graph's stand-in: the same forward on the same buffers and context, run eagerly. The torch
    reference attention reads host copies of the lengths (the graph's Triton decode reads the device ones)."""

    def __init__(self, graphs: DecodeGraphs, batch_size: int, log: list):
        self.graphs = graphs
        self.batch_size = batch_size
        self.log = log  # buffers.state_slots as each replay (of any size) saw them, in order

    def replay(self) -> torch.Tensor:
        r, bs = self.graphs.runner, self.batch_size
        ctx = self.graphs.context(bs)
        ctx.meta.seq_lens_cpu = ctx.meta.seq_lens.tolist()
        ctx.meta.max_seq_len = max(ctx.meta.seq_lens_cpu)
        self.log.append(ctx.extra["state_slots"].tolist())
        return r.model(r.buffers.input_ids[:bs], r.buffers.positions[:bs], ctx)


def with_eager_replays(llm) -> DecodeGraphs:
    runner = llm.engine.runner
    runner._ensure_buffers()
    graphs = DecodeGraphs(runner)
    graphs.slot_log = []
    graphs.graphs = {bs: EagerReplay(graphs, bs, graphs.slot_log) for bs in graphs.sizes}
    runner.graphs = graphs
    return graphs


def _prompts(n: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in (23, 1, 9, 40, 5)[:n]]


def _generate(llm, prompts, max_tokens):
    from voltllm import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def _clean(llm) -> None:
    eng = llm.engine
    eng.step()  # slots of requests that finished in the last step are released at the next schedule
    eng.check_integrity()
    assert eng.runner.state_cache.num_free == eng.runner.state_cache.num_slots


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_replayed_decode_equals_eager(checkpoints, kind, async_scheduling):
    """5 requests of different lengths and output counts, max 8 sequences (buckets 1, 2, 4, 8): decode steps
    replay padded batches of 8, 4, 2, 1 rows; chunked prefill (48 tokens a step) mixes eager steps in."""
    from voltllm import LLM

    kw = dict(skip_tokenizer_init=True, block_size=4, max_num_batched_tokens=48, max_num_seqs=8,
              mamba_cache_mode="none", async_scheduling=async_scheduling)
    prompts, max_tokens = _prompts(), [12, 7, 3, 10, 16]
    want, _ = _generate(LLM(checkpoints[kind], **kw), prompts, max_tokens)
    llm = LLM(checkpoints[kind], **kw)
    graphs = with_eager_replays(llm)
    got, _ = _generate(llm, prompts, max_tokens)
    assert got == want
    assert graphs.replays > 0
    assert {len(row) for row in graphs.slot_log} >= {8, 4, 1}
    _clean(llm)


def test_replays_then_eager_steps_with_slot_reuse(checkpoints):
    """Two sequences at most: a waiting request gets a finished one's slot (stale state in it). The third,
    a 1-token prompt, starts in a replay (its row must not resume the stale state); the fourth's prefill
    runs eagerly beside a request that decoded in replays so far (its slot must cover exactly its tokens)."""
    from voltllm import LLM

    kw = dict(skip_tokenizer_init=True, block_size=4, max_num_seqs=2, mamba_cache_mode="none")
    p = _prompts(4)
    prompts, max_tokens = [p[0], p[2], p[1], p[3]], [4, 12, 5, 6]
    want, _ = _generate(LLM(checkpoints["qwen3_next"], **kw), prompts, max_tokens)
    llm = LLM(checkpoints["qwen3_next"], **kw)
    graphs = with_eager_replays(llm)
    got, _ = _generate(llm, prompts, max_tokens)
    assert got == want and graphs.replays > 0
    _clean(llm)


def test_slot_buffer_rows_and_padding(checkpoints):
    """Each replay sees the requests' own slots in batch order, the scratch slot on every padding row."""
    from voltllm import LLM

    llm = LLM(checkpoints["qwen3_5"], skip_tokenizer_init=True, block_size=4, max_num_seqs=8,
              mamba_cache_mode="none", async_scheduling=False)
    graphs = with_eager_replays(llm)
    runner = llm.engine.runner
    pad = runner.state_cache.pad_slot
    assert pad == runner.state_cache.num_slots == 8
    seen = []
    original = runner.prepare

    def prepare(sched, pad_to=0, state_slots=None, **kw):
        out = original(sched, pad_to, state_slots, **kw)
        if pad_to:
            seen.append(([runner.state_cache.slot_of(s.request.request_id) for s in sched.scheduled], pad_to))
        return out

    runner.prepare = prepare
    _generate(llm, _prompts(3), [4, 6, 2])
    assert graphs.replays == len(seen) > 0
    assert graphs.slot_log == [slots + [pad] * (pad_to - len(slots)) for slots, pad_to in seen]
    assert [pad] in graphs.slot_log or any(pad in row for row in graphs.slot_log)
    assert any(row[:3] != [pad] * 3 and row[3:] == [pad] for row in graphs.slot_log)  # 3 requests in 4 rows
    _clean(llm)


def test_snapshots_saved_after_replayed_decode(checkpoints):
    """Synchronous scheduling: decode positions get snapshots too, saved after the replay. A second prompt
    extending the first request's output resumes from one of them (cached tokens 16 > the 10-token prompt)
    and gives the cold run's tokens."""
    from voltllm import LLM

    path = checkpoints["qwen3_next"]
    cold = LLM(path, skip_tokenizer_init=True, block_size=4, mamba_cache_mode="none", async_scheduling=False)
    llm = LLM(path, skip_tokenizer_init=True, block_size=4, mamba_block_size=4, max_num_seqs=8,
              num_gpu_blocks_override=64, async_scheduling=False)
    graphs = with_eager_replays(llm)
    snaps = llm.engine.runner.state_snapshots
    assert snaps is not None
    first = _prompts(1)[0][:10]
    want, _ = _generate(cold, [first], [12])
    got, cached = _generate(llm, [first], [12])
    assert got == want and cached == [0]
    assert graphs.replays >= 11 and snaps.num_saved >= 4  # boundaries 8 (prompt), 12, 16, 20 (decode)
    second = first + got[0][:8] + [3, 1, 4]
    want, _ = _generate(cold, [second], [6])
    got, cached = _generate(llm, [second], [6])
    assert got == want
    assert cached == [16] and snaps.num_restored >= 1
    _clean(llm)
    snaps.check_integrity(live_request_ids=set())
