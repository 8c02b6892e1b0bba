"""Prompt-step CUDA graphs (voltllm.worker.prompt_graphs), the parts the CPU can check: the token buckets, and the
padding a replayed step uploads (ModelRunner.prepare(pad_tokens_to=...)): padding tokens belong to no sequence,
store nothing, and leave the real rows' hidden states as an unpadded step computes them. The replay itself is
checked against eager steps on the GPU (tests/gpu/test_engine_gpu.py)."""
import pytest
import torch

from tiny_models import make_model
from voltllm import LLM, SamplingParams
from voltllm.engine.types import EngineCoreRequest
from voltllm.model.forward_context import ForwardContext
from voltllm.worker.prompt_graphs import prompt_graph_sizes


def test_buckets_are_powers_of_two_from_16():
    assert prompt_graph_sizes(0) == [] and prompt_graph_sizes(15) == []
    assert prompt_graph_sizes(16) == [16]
    assert prompt_graph_sizes(100) == [16, 32, 64]
    assert prompt_graph_sizes(512) == [16, 32, 64, 128, 256, 512]


def test_a_step_takes_the_smallest_bucket_that_holds_it():
    from voltllm.worker.prompt_graphs import PromptGraphs

    graphs = PromptGraphs(_Runner(64), 64)
    assert graphs.sizes == [16, 32, 64]
    graphs.graphs = {16: "g16", 64: "g64"}  # (32 not captured)
    assert [graphs.for_tokens(n) for n in (2, 16, 17, 33, 64, 65)] == ["g16", "g16", None, "g64", "g64", None]
    assert graphs.replays == 4  # only steps that found a graph


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_model(str(tmp_path_factory.mktemp("tiny")), "qwen3", max_position_embeddings=512)
    return LLM(path, device="cpu", dtype="float32").engine


def _hidden(runner, sched, pad):
    t, meta = runner.prepare(sched, pad_tokens_to=pad)
    buf = runner.buffers
    ids, pos, slots = buf.input_ids[:t].clone(), buf.positions[:t].clone(), meta.slot_mapping.clone()
    caches = [torch.zeros_like(c) for c in runner.kv_caches]
    ctx = ForwardContext(meta=meta, kv_caches=caches, backend=runner.backend)
    with torch.inference_mode():
        hidden = runner.model(buf.input_ids[:t], buf.positions[:t], ctx)
    return t, meta, ids, pos, slots, hidden, caches


def test_padded_prompt_step_matches_unpadded(engine):
    sp = SamplingParams(temperature=0, max_tokens=2)
    for i, n in enumerate((5, 7)):
        engine.add_request(EngineCoreRequest(f"r{i}", list(range(3 + i, 3 + i + n)), sp))
    sched = engine.scheduler.schedule()
    assert sched.total_tokens == 12 and len(sched.scheduled) == 2
    runner = engine.runner
    t0, meta0, ids0, pos0, slots0, h0, caches0 = _hidden(runner, sched, 0)
    t1, meta1, ids1, pos1, slots1, h1, caches1 = _hidden(runner, sched, 16)
    assert (t0, t1) == (12, 16)
    assert meta1.num_tokens == 12 and meta1.query_start_loc_cpu == [0, 5, 12] and meta1.seq_lens_cpu == [5, 7]
    assert meta1.slot_mapping.shape[0] == 16 and meta0.slot_mapping.shape[0] == 12
    assert torch.equal(ids1[:12], ids0) and torch.equal(pos1[:12], pos0) and torch.equal(slots1[:12], slots0)
    assert torch.all(ids1[12:] == 0) and torch.all(pos1[12:] == 0) and torch.all(slots1[12:] == -1)
    assert h1.shape[0] == 16
    torch.testing.assert_close(h1[:12], h0, rtol=1e-5, atol=1e-5)
    for c0, c1 in zip(caches0, caches1):  # padding stored nothing: the caches hold the same rows
        assert torch.equal(c0, c1)
    engine.abort_requests(["r0", "r1"])
    engine.scheduler.schedule()  # (drops the aborted requests' blocks)
    engine.check_integrity()


def test_rows_and_tokens_are_not_padded_together(engine):
    from voltllm.engine.scheduler import SchedulerOutput

    with pytest.raises(AssertionError):
        engine.runner.prepare(SchedulerOutput(), pad_to=4, pad_tokens_to=16)


class _Runner:
    """What ModelRunner._capture_prompt_graphs reads of a runner."""

    def __init__(self, top):
        self.top = top
        self.graphs = type("DecodeGraphs", (), {"pool": None})()
        self.prompt_graphs = None
        self.device = torch.device("cpu")

    def prompt_graph_max_tokens(self):
        return self.top


def test_prompt_graphs_out_of_memory_leaves_prompt_steps_eager(monkeypatch, caplog):
    """Capturing them is the last thing a start does, after the KV cache took its (estimated) share: running out of
    memory there keeps the engine up with eager prompt steps and says so."""
    from voltllm.worker import prompt_graphs
    from voltllm.worker.runner import ModelRunner

    def no_memory(self, pool):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(prompt_graphs.PromptGraphs, "capture", no_memory)
    runner = _Runner(512)
    with caplog.at_level("WARNING", logger="voltllm"):
        ModelRunner._capture_prompt_graphs(runner)
    assert runner.prompt_graphs is None
    assert "prompt steps run eagerly" in caplog.text
    captured = []
    monkeypatch.setattr(prompt_graphs.PromptGraphs, "capture", lambda self, pool: captured.append(self.sizes))
    ModelRunner._capture_prompt_graphs(_Runner(8))  # under the smallest bucket: nothing to capture
    assert captured == []


@pytest.mark.parametrize("shape,expected", [("smollm2-135m-shape", 8192), ("qwen3-0.6b-shape", 4096),
                                            ("qwen3-8b-shape", 512)])
def test_the_largest_bucket_follows_the_model_size(shape, expected):
    """Unset, the largest prompt-graph bucket shrinks as a layer's GPU time grows (tokens x the layer's projection
    parameters), as measured on the H200: SmolLM2 replays steps up to 8,192 tokens, Qwen3-0.6B up to 4,096, the 8B up
    to 512; the scheduler's token budget and an explicit value still cap it, and hybrids take none."""
    import dataclasses
    import types

    import transformers

    from voltllm.bench.shapes import SHAPES
    from voltllm.config import DeviceConfig
    from voltllm.model.models.llama import LlamaForCausalLM
    from voltllm.worker.runner import ModelRunner

    cls, kwargs = SHAPES[shape]
    with torch.device("meta"):
        model = LlamaForCausalLM(getattr(transformers, cls)(**kwargs), torch.float16, 64)
    device = DeviceConfig(torch.device("cpu"))
    runner = types.SimpleNamespace(is_hybrid=False, model=model, device=torch.device("cpu"), config=types.SimpleNamespace(
        device=device, scheduler=types.SimpleNamespace(max_num_batched_tokens=16384, max_num_seqs=256),
        model=types.SimpleNamespace(max_model_len=32768)))
    assert ModelRunner.prompt_graph_max_tokens(runner) == expected
    runner.config.scheduler.max_num_batched_tokens = 2048
    assert ModelRunner.prompt_graph_max_tokens(runner) == min(expected, 2048)
    runner.config.device = dataclasses.replace(device, prompt_graph_max_tokens=256)
    assert ModelRunner.prompt_graph_max_tokens(runner) == 256
    runner.is_hybrid = True
    assert ModelRunner.prompt_graph_max_tokens(runner) == 0


def test_auto_bucket_rule_edges_and_gpu_speed(monkeypatch):
    """The constant's edges, and slower GPUs get smaller buckets: a V100 (80 SMs of 1,024 FLOPs per clock, 0.15 of
    the H200) caps SmolLM2's layers (3.5e6 parameters) at 4,096 and the 8B's (1.9e8) at 64."""
    import types

    from voltllm.worker import prompt_graphs as pg

    c = pg.AUTO_TOKEN_LAYER_PARAMS
    assert pg.auto_max_tokens(1) == pg.AUTO_MAX_TOKENS
    assert pg.auto_max_tokens(c / 1024) == 1024 and pg.auto_max_tokens(c / 1024 + 1) == 512
    assert pg.auto_max_tokens(c / 15) == 0  # too wide for even a 16-token bucket
    assert pg.device_speed(torch.device("cpu")) == 1.0
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: types.SimpleNamespace(major=7, minor=0, multi_processor_count=80))
    v100 = pg.device_speed(torch.device("cuda", 0))
    assert abs(v100 - 80 * 1024 / (132 * 4096)) < 1e-9
    assert pg.auto_max_tokens(3.54e6, v100) == 4096 and pg.auto_max_tokens(1.93e8, v100) == 64
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: types.SimpleNamespace(major=9, minor=0, multi_processor_count=132))
    assert pg.device_speed(torch.device("cuda", 0)) == 1.0


def test_warm_up_sequences_fit_the_block_table_and_the_buckets_what_a_step_can_hold(tmp_path):
    """A prompt graph's warm-up attends as sequences no longer than --max-model-len: one sequence of a bucket's tokens
    read past its block-table row (an illegal memory access at start on the H200 with --max-model-len 200,
    --max-num-seqs 2 and 8,192-token buckets). And no bucket is larger than a step can be (max_num_seqs x
    max_model_len)."""
    from types import SimpleNamespace

    from voltllm.worker.prompt_graphs import PromptGraphs

    class Runner:  # (PromptGraphs keeps a weak reference)
        config = SimpleNamespace(model=SimpleNamespace(max_model_len=200))
        block_size = 16
        buffers = SimpleNamespace(block_tables=torch.zeros(2, 13, dtype=torch.int32))

    runner = Runner()
    graphs = PromptGraphs(runner, 400)
    assert graphs._warm_up_seqs(400) == [200, 200] and graphs._warm_up_seqs(64) == [64]
    assert graphs._warm_up_seqs(256) == [200, 56]
    path = make_model(str(tmp_path / "m"), "qwen3", max_position_embeddings=512)
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=200, max_num_seqs=2, skip_tokenizer_init=True)
    assert llm.engine.runner.prompt_graph_max_tokens() <= 2 * 200
