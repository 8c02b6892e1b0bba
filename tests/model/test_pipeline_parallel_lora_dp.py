"""Pipeline parallelism with LoRA adapters and with data parallelism, on the CPU (gloo, fp32).

- `-pp 2 --enable-lora` gives one rank's greedy tokens and logprobs for batches mixing adapters and the base model:
  each stage's slots hold the adapter's matrices of its own layers under their local indices (lora/stages.py), and
  the later stages follow rank 0's slot choices; adapters removed, reloaded and read again on the workers; dense
  (qwen3, llama) and hybrid (qwen3_5) models.
- `-dp 2 -pp 2`: two engines of two stages each (4 processes) behind the server, each request's tokens as one rank's.
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest

from lora_adapters import HYBRID_TARGETS, make_adapter
from tiny_models import HYBRID_VOCAB, make_model, make_tiny_hybrid
from voltllm import LLM, LoRARequest, SamplingParams
from voltllm.distributed.pipeline import PipelineStage, stage_layers

PROMPTS = ["The quick brown fox jumps over", "What is the capital of France? The capital",
           "def add(a, b):\n    return", "Hello world! Voltllm serves language models on old GPUs, fast.",
           "0123456789 0123", "Paris"]
NAMES = ["a1", None, "a2", "a1", None, "late"]
# a small token budget and blocks: chunked prefill, steps mixing prefill and decode
ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4, max_num_batched_tokens=16,
              max_num_seqs=6)
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)


def _adapters(root: str, model: str, layers: int) -> dict[str, LoRARequest]:
    """a1 on every layer; a2 of a smaller rank (rsLoRA) on some projections; `late` on the last stage's layers alone
    (where the global -> local renaming matters most)."""
    last = stage_layers(layers, 2)[1]
    kinds = {"a1": dict(rank=8, alpha=16, seed=1),
             "a2": dict(rank=4, alpha=8, seed=2, rslora=True, targets=("q_proj", "k_proj", "v_proj", "down_proj")),
             "late": dict(rank=8, alpha=16, seed=3, layers=list(range(*last)))}
    return {name: LoRARequest(name, i, make_adapter(f"{root}/{name}", model, **kw))
            for i, (name, kw) in enumerate(kinds.items(), 1)}


def _run(llm, loras, names=NAMES, params=PARAMS):
    return llm.generate(PROMPTS[:len(names)], params, lora_request=[loras.get(n) for n in names], use_tqdm=False)


def _assert_same(a, b):
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for p, q in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert p.keys() == q.keys()
            assert all(abs(p[t].logprob - q[t].logprob) < 2e-5 for t in p)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


CASES = {"qwen3-untied": ("qwen3", {}), "llama-tied": ("llama", dict(num_hidden_layers=4))}


@pytest.fixture(scope="module", params=list(CASES))
def engines(request, tmp_path_factory):
    kind, overrides = CASES[request.param]
    root = str(tmp_path_factory.mktemp(request.param))
    model = make_model(f"{root}/{kind}", kind, **overrides)
    layers = overrides.get("num_hidden_layers", 3)
    loras = _adapters(root, model, layers)
    one = LLM(model, **ENGINE)
    two = LLM(model, pipeline_parallel_size=2, **ENGINE)
    yield one, two, loras
    two.engine.shutdown()


def test_mixed_batch_matches_one_rank(engines):
    one, two, loras = engines
    a, b = _run(one, loras), _run(two, loras)
    _assert_same(a, b)
    base = _run(one, loras, [None] * len(NAMES))
    for i, name in enumerate(NAMES):  # (every adapter counts, the last stage's alone included)
        assert (_tokens(a)[i] != _tokens(base)[i]) == (name is not None)
    two.engine.check_integrity()


def test_each_stage_holds_its_layers_adapters(engines):
    one, two, loras = engines
    lora = two.engine.runner.lora
    stage = two.engine.runner.pp
    assert lora.stage is stage and stage.end - stage.start < len(one.engine.runner.model.layers)
    assert set(lora.weights) == {name for name in one.engine.runner.lora.weights if stage.local(name) == name}
    _run(two, loras, ["late"])
    key = next(k for k in lora.cached() if k.name == "late")
    assert lora._cpu[key].weights == {}  # rank 0 holds none of the last stage's layers: nothing of `late`


def test_removed_and_reloaded_adapters_on_every_stage(engines, tmp_path):
    """remove_lora on a -pp engine (the later stage drops it with rank 0's next step), then the name reloaded with
    other weights under a new id, and the removed LoRARequest used again (read afresh): every batch matches one
    rank; add_lora on both."""
    one, two, loras = engines
    before = _run(two, loras)
    for llm in (one, two):
        assert llm.remove_lora(1) is True and llm.list_loras() == {2, 3}
    model = one.config.model.model
    reloaded = dict(loras, a1=LoRARequest("a1", 9, make_adapter(str(tmp_path / "a1-new"), model, rank=8, alpha=16,
                                                                seed=5)))
    after = _run(two, reloaded)
    _assert_same(_run(one, reloaded), after)
    assert _tokens(after) != _tokens(before)
    _assert_same(before, _run(two, loras))  # the removed id 1 again: its old files, read anew
    assert two.list_loras() == {2, 3, 9}
    two.engine.check_integrity()
    for llm in (one, two):  # (as the other tests of these engines expect)
        assert llm.remove_lora(9) is True and llm.add_lora(loras["a1"]) is True
    _assert_same(before, _run(two, loras))


def test_one_slot_reloaded_and_adapters_read_again_on_every_stage(tmp_path):
    """--max-loras 1 --max-cpu-loras 1: adapters take turns in the one slot, and the later stage, which keeps only the
    resident one in CPU memory, reads the others again when rank 0 puts them back."""
    model = make_model(str(tmp_path / "llama"), "llama", num_hidden_layers=4)
    loras = _adapters(str(tmp_path), model, 4)
    engine = {**ENGINE, "max_loras": 1, "max_cpu_loras": 1}
    names = ["a1", "late", None, "a1", "a2"]
    one = LLM(model, **engine)
    alone, batch = [_run(one, loras, [n]) for n in names], _run(one, loras, names)
    two = LLM(model, pipeline_parallel_size=2, **engine)
    try:
        for name, want in zip(names, alone):
            _assert_same(want, _run(two, loras, [name]))
        _assert_same(batch, _run(two, loras, names))
    finally:
        two.engine.shutdown()


def test_hybrid_qwen3_5(tmp_path):
    """A qwen3_5 of 8 layers (attention every 4th): Gated DeltaNet, gated-attention and dense-MLP adapters on both
    stages."""
    root = str(tmp_path)
    base = make_tiny_hybrid(f"{root}/qwen3_5", "qwen3_5", seed=0, gen_seed=1, num_hidden_layers=8)
    if base is None:
        pytest.skip("this transformers has no Qwen3_5TextConfig")
    loras = {"a1": LoRARequest("a1", 1, make_adapter(f"{root}/a1", base, rank=8, seed=1, targets=HYBRID_TARGETS,
                                                     std=0.15)),
             "late": LoRARequest("late", 2, make_adapter(f"{root}/late", base, rank=4, seed=2, layers=[5, 6, 7],
                                                         targets=HYBRID_TARGETS, std=0.15))}
    kw = dict(enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4, mamba_block_size=8,
              max_num_batched_tokens=9, max_num_seqs=4, skip_tokenizer_init=True)
    prompts = [{"prompt_token_ids": [(7 * i + k) % HYBRID_VOCAB for i in range(n)]} for k, n in ((3, 19), (1, 5),
                                                                                                 (2, 26), (5, 11))]
    names = ["a1", None, "late", "a1"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)

    def run(llm, names=names):
        return llm.generate(prompts, params, lora_request=[loras.get(n) for n in names], use_tqdm=False)

    one = LLM(base, **kw)
    want, base_out = run(one), run(one, [None] * 4)
    assert all((_tokens(want)[i] != _tokens(base_out)[i]) == (n is not None) for i, n in enumerate(names))
    two = LLM(base, pipeline_parallel_size=2, **kw)
    try:
        _assert_same(want, run(two))
        two.engine.check_integrity()
    finally:
        two.engine.shutdown()


def test_stage_projection_names():
    from voltllm.lora.adapter import LoRAAdapter
    from voltllm.lora.stages import stage_adapter, stage_projections

    stage = PipelineStage(1, 2, 2, 4, group=None)
    shapes = {f"layers.{i}.self_attn.qkv_proj": i for i in range(4)}
    assert stage_projections(shapes, stage) == {"layers.0.self_attn.qkv_proj": 2, "layers.1.self_attn.qkv_proj": 3}
    assert stage_projections(shapes, None) == shapes
    a = LoRAAdapter("x", "/p", 8, 2.0, {f"layers.{i}.mlp.down_proj": {0: i} for i in (1, 3)})
    assert stage_adapter(a, stage).weights == {"layers.1.mlp.down_proj": {0: 3}}


def test_serve_dp2_pp2_matches_one_rank(tmp_path):
    """`voltllm serve -dp 2 -pp 2 --enable-lora`: two engines of two stages each (4 processes under the server), each
    request's greedy text, with the adapter or without, as one rank's, whichever engine served it."""
    import httpx
    import openai

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "server"))  # the server tests' ServerProc
    from server_helpers import ServerProc, children_of, descendants_of, free_port, wait_gone

    model = make_model(str(tmp_path / "llama"), "llama", num_hidden_layers=4)
    lora = make_adapter(str(tmp_path / "ad"), model, rank=8, alpha=16, seed=1, layers=[2, 3])  # the later stage's
    prompts = [f"The quick brown fox {i}" for i in range(6)]
    one = LLM(model, block_size=4, enable_lora=True, max_lora_rank=8)
    greedy = SamplingParams(temperature=0, max_tokens=6)
    want = {name: [o.outputs[0].text for o in one.generate(prompts, greedy, use_tqdm=False, lora_request=req)]
            for name, req in (("tiny", None), ("ad", LoRARequest("ad", 1, lora)))}
    assert want["tiny"] != want["ad"]
    srv = ServerProc([model, "--device", "cpu", "-dp", "2", "-pp", "2", "--block-size", "4", "--served-model-name",
                      "tiny", "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"ad={lora}",
                      "--disable-log-stats"], free_port(), env={"OMP_NUM_THREADS": "1"})
    try:
        srv.wait_healthy(180)
        pids = descendants_of(srv.proc.pid)
        cmd = {p: open(f"/proc/{p}/cmdline").read() for p in pids}
        engines = [p for p in pids if "spawn_main" in cmd[p]]
        assert len(engines) == 2, cmd  # 2 engine processes (rank 0 each)
        servers = [k for e in engines for k in children_of(e) if "forkserver" in cmd.get(k, "")]
        workers = [k for f in servers for k in children_of(f)]
        assert len(servers) == 2 and len(workers) == 2, cmd  # each with its later stage's worker, from its forkserver

        async def together(name: str) -> list[str]:
            c = openai.AsyncOpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=120)
            outs = await asyncio.gather(*(c.completions.create(model=name, prompt=p, max_tokens=6, temperature=0)
                                          for p in prompts))
            return [o.choices[0].text for o in outs]

        for name in ("tiny", "ad"):
            assert asyncio.run(together(name)) == want[name], name
        done = {}
        for line in httpx.get(srv.base + "/metrics", timeout=10).text.splitlines():
            if line.startswith("voltllm:request_success_total{"):
                engine = line.partition('engine="')[2].partition('"')[0]
                done[engine] = done.get(engine, 0.0) + float(line.rpartition(" ")[2])
        assert set(done) == {"0", "1"} and min(done.values()) >= 2, done  # both engines served some
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0, srv.log_text()[-3000:]
        assert not wait_gone(pids, 10), "orphan processes after SIGTERM"
    finally:
        srv.stop()


def test_data_parallel_engines_take_their_stages_cards(tmp_path, monkeypatch):
    """Engine k of -dp N -pp P starts on cuda:first + k P (its stages the P cards from there); the engines' cards
    must all be visible."""
    from dataclasses import replace
    from types import SimpleNamespace

    import torch

    from voltllm.config import EngineArgs
    from voltllm.distributed.support import pipeline_parallel_error
    from voltllm.engine.data_parallel import rank_config

    model = make_model(str(tmp_path), "llama", num_hidden_layers=4)
    cfg = EngineArgs(model=model, device="cpu", pipeline_parallel_size=2, data_parallel_size=3).create_engine_config()
    cfg = replace(cfg, device=replace(cfg.device, device=torch.device("cuda", 1)))
    assert [str(rank_config(cfg, k).device.device) for k in range(3)] == ["cuda:1", "cuda:3", "cuda:5"]
    args = SimpleNamespace(pipeline_parallel_size=2, tensor_parallel_size=1, data_parallel_size=3, enable_lora=False,
                           cpu_offload_gb=0, offload_group_size=0, kv_offloading_size=None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 6)
    hf = cfg.model.hf_config
    assert pipeline_parallel_error(args, hf, None, "generate", torch.device("cuda", 0)) is None
    assert pipeline_parallel_error(args, hf, None, "generate", torch.device("cuda", 1)) == (
        "--pipeline-parallel-size 2: needs 3 x 2 = 6 CUDA devices from cuda:1, but 6 are visible")
