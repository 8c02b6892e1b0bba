"""The acceleration report (voltllm.acceleration), `voltllm check`, and --require-acceleration, on the CPU.

CUDA configurations are exercised by faking the resolved device and the platform: the report and the
refusal are functions of the configuration, so they need no GPU to be checked.
"""
from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch

from tiny_models import make_model
from voltllm import acceleration
from voltllm.acceleration import ROUTES, build_report, format_report, instrument, require_acceleration
from voltllm.config import ConfigError, EngineArgs
from voltllm.platform import platform_for


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return make_model(str(tmp_path_factory.mktemp("accel") / "tiny"), kind="qwen3")


@pytest.fixture(scope="module")
def llm(tiny_dir):
    from voltllm import LLM

    return LLM(tiny_dir, device="cpu", max_model_len=256, num_gpu_blocks_override=64, max_num_seqs=4)


def _fake_cuda(config, compat="sm70", **device_fields):
    dev = dataclasses.replace(config.device, device=torch.device("cuda", 0), compat=compat, **device_fields)
    model = dataclasses.replace(config.model, dtype=torch.float16)
    return dataclasses.replace(config, device=dev, model=model)


@pytest.fixture
def fake_v100(monkeypatch):
    plat = platform_for((7, 0), compat="sm70", device="cuda:0", name="Tesla V100-SXM2-32GB")
    monkeypatch.setattr(acceleration, "for_config", lambda config: plat)
    return plat


def test_cpu_report_shape_and_reasons(llm):
    report = build_report(llm.config, llm.engine.runner)
    json.dumps(report)  # JSON-ready as it is
    assert report["object"] == "acceleration_report" and report["source"] == "engine"
    assert report["platform"]["route"] == "cpu"
    names = list(report["routes"])
    assert names == [r for r in ROUTES if not r.startswith("gdn_")
                     and r not in ("moe", "kv_offload", "weight_offload")]  # a dense model
    for name, r in report["routes"].items():
        assert set(r) >= {"enabled", "expected", "impl", "reason", "calls"}, name
        assert r["enabled"] is False and r["expected"] is False, name  # the CPU runs the reference routes
        assert r["reason"], name
    assert report["routes"]["attention_decode"]["impl"].startswith("TORCH_REF")
    assert "CPU" in report["routes"]["cuda_graphs"]["reason"]
    assert report["ok"] and report["disabled_expected"] == []
    assert report["expected"].startswith("nothing")
    text = format_report(report)
    for name in names:
        assert name in text
    assert "nothing: on the CPU" in text


def test_counters_move_when_the_engine_runs(llm):
    from voltllm.sampling.params import SamplingParams

    counters = instrument(llm.engine.runner)
    assert instrument(llm.engine.runner) is counters  # idempotent: no double counting
    before = counters.calls()
    llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    after = counters.calls()
    layers = llm.engine.runner.model.num_attention_layers
    assert after["attention_prefill"]["eager"] - before["attention_prefill"]["eager"] == layers  # one prefill step
    assert after["attention_decode"]["eager"] - before["attention_decode"]["eager"] == 5 * layers  # 5 decode steps
    assert after["sampler"]["eager"] - before["sampler"]["eager"] == 6
    assert after["linear"]["eager"] - before["linear"]["eager"] == 6 * 4 * layers  # qkv, o, gate_up, down
    assert after["cuda_graphs"]["eager"] - before["cuda_graphs"]["eager"] == 6  # eager forwards
    assert after["fused_elementwise"]["total"] == before["fused_elementwise"]["total"]  # not on the CPU
    assert all(c["graph"] == 0 for c in after.values())
    report = build_report(llm.config, llm.engine.runner)
    assert report["counters"]["eager_model_forwards"] >= 6
    assert report["routes"]["attention_decode"]["calls"]["total"] == after["attention_decode"]["total"]


def test_graph_replays_count_the_routes_inside_the_graph(llm):
    """A replay runs no Python: the report multiplies DecodeGraphs.replays by one forward's calls."""
    runner = llm.engine.runner
    counters = instrument(runner)
    template = counters.template
    layers = runner.model.num_attention_layers
    assert template["attention_decode"] == layers and template["attention_prefill"] == 0
    assert template["linear"] == 4 * layers
    base = counters.calls()
    fake = types.SimpleNamespace(replays=counters.replays0 + 7, sizes=[1, 2, 4], graphs={1: None})
    saved = runner.graphs
    runner.graphs = fake
    try:
        calls = counters.calls()
        assert calls["cuda_graphs"]["graph"] == 7
        assert calls["attention_decode"]["graph"] == 7 * layers
        assert calls["attention_decode"]["total"] == base["attention_decode"]["eager"] + 7 * layers
        assert calls["linear"]["graph"] == 7 * 4 * layers
        assert calls["sampler"]["graph"] == 0  # sampling stays eager (counted by its own calls)
        assert calls["attention_prefill"]["graph"] == 0
    finally:
        runner.graphs = saved


def test_prompt_graph_replays_count_the_routes_around_attention(llm):
    """A prompt-graph replay runs its attention calls eagerly (counted as they run); the report adds
    PromptGraphs.replays x one eager prompt forward's other calls, and the replays to the cuda_graphs route."""
    from voltllm import SamplingParams

    runner = llm.engine.runner
    counters = instrument(runner)
    llm.generate(["a prompt of a few tokens"], SamplingParams(temperature=0, max_tokens=2))  # an eager prefill
    layers = runner.model.num_attention_layers
    assert counters.prefill_template["attention_prefill"] == layers
    assert counters.prefill_template["linear"] == 4 * layers
    base = counters.calls()
    assert runner.prompt_graphs is None  # (the CPU captures none)
    runner.prompt_graphs = types.SimpleNamespace(replays=counters.prompt_replays0 + 3, sizes=[16, 32])
    try:
        calls = counters.calls()
        assert calls["cuda_graphs"]["graph"] == base["cuda_graphs"]["graph"] + 3
        assert calls["linear"]["graph"] == base["linear"]["graph"] + 3 * 4 * layers
        assert calls["attention_prefill"]["graph"] == base["attention_prefill"]["graph"]  # eager, counted
        assert calls["sampler"]["graph"] == 0
        assert build_report(llm.engine.config, runner)["counters"]["prompt_graph_replays"] == 3
    finally:
        runner.prompt_graphs = None


def test_require_acceleration_on_cpu_expects_nothing(tiny_dir):
    config = EngineArgs(model=tiny_dir, device="cpu", require_acceleration=True).create_engine_config()
    assert config.device.require_acceleration
    assert require_acceleration(config)["ok"]


def test_predicted_v100_route(tiny_dir, fake_v100):
    config = _fake_cuda(EngineArgs(model=tiny_dir, device="cpu").create_engine_config())
    report = build_report(config)
    assert report["source"].startswith("config")
    r = report["routes"]
    assert r["attention_decode"]["enabled"] and r["attention_decode"]["expected"]
    assert r["attention_decode"]["tensor_cores"] is False and "FMA" in r["attention_decode"]["reason"]
    assert r["cuda_graphs"]["enabled"] and r["cuda_graphs"]["expected"]
    assert r["fused_elementwise"]["enabled"] and r["sampler"]["enabled"] and r["linear"]["enabled"]
    assert "float16" in r["linear"]["reason"]
    assert not r["kv_codec"]["expected"]
    assert report["platform"]["sm"] == "sm_70"
    assert "cuda_graphs" in report["expected"]


def test_predicted_v100_prefill_under_compat_none(tiny_dir, monkeypatch):
    """--compat none on a real sm_70: the backend still sends prefill to bridge + SDPA (Triton's tl.dot is FMA
    there), and the prediction says so."""
    plat = platform_for((7, 0), compat="none", device="cuda:0", name="Tesla V100-SXM2-32GB")
    monkeypatch.setattr(acceleration, "for_config", lambda config: plat)
    config = _fake_cuda(EngineArgs(model=tiny_dir, device="cpu").create_engine_config(), compat="none")
    prefill = build_report(config)["routes"]["attention_prefill"]
    assert "SDPA" in prefill["impl"] and prefill["tensor_cores"] is True
    assert "on sm_70 the native route" in prefill["reason"]
    # the backend the runner would build agrees
    from voltllm.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend(use_tensor_cores=None, max_context=256)
    backend._dev_info["cuda:0"] = ((7, 0), 80)
    assert "SDPA" in backend.routes(torch.device("cuda", 0))["prefill"]


def test_require_acceleration_refuses_each_disabled_route(tiny_dir, fake_v100):
    config = _fake_cuda(EngineArgs(model=tiny_dir, device="cpu").create_engine_config(), attention_backend="TORCH_REF")
    with pytest.raises(ConfigError) as e:
        require_acceleration(config)
    msg = str(e.value)
    assert "--require-acceleration" in msg
    for route in ("attention_prefill", "attention_decode", "cuda_graphs"):
        assert route in msg
    assert "TORCH_REF" in msg
    # --enforce-eager: graphs are not expected any more, attention still is
    eager = _fake_cuda(EngineArgs(model=tiny_dir, device="cpu").create_engine_config(), attention_backend="TORCH_REF",
                       enforce_eager=True)
    with pytest.raises(ConfigError) as e:
        require_acceleration(eager)
    assert "cuda_graphs" not in str(e.value) and "attention_decode" in str(e.value)


def test_require_acceleration_hybrid_graphs(tiny_dir, fake_v100):
    from voltllm.bench.shapes import make_config

    config = _fake_cuda(EngineArgs(model=tiny_dir, device="cpu").create_engine_config())
    hybrid = dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                   hf_config=make_config("qwen3.5-27b-shape")))
    assert require_acceleration(hybrid)["ok"]  # hybrid decode replays CUDA graphs like dense models
    report = build_report(hybrid)
    assert report["routes"]["cuda_graphs"]["enabled"]
    assert "gdn_decode" in report["routes"] and report["routes"]["gdn_decode"]["enabled"]
    prefill = report["routes"]["gdn_prefill"]  # a V100 has no tf32: the chunk kernels keep exact fp32 products
    assert prefill["enabled"] and "exact fp32" in prefill["impl"] and "256 tokens" in prefill["reason"]
    eager = dataclasses.replace(hybrid, device=dataclasses.replace(hybrid.device, enforce_eager=True))
    assert require_acceleration(eager)["ok"]


def test_cli_check_no_load_json(tiny_dir, capsys):
    from voltllm.cli import main

    assert main(["check", tiny_dir, "--device", "cpu", "--no-load", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["platform"]["route"] == "cpu" and report["ok"]


def test_cli_check_loads_and_counts(tiny_dir, capsys):
    from voltllm.cli import main

    assert main(["check", tiny_dir, "--device", "cpu", "--max-model-len", "128", "--num-gpu-blocks-override", "32",
                 "--generate", "3"]) == 0
    out = capsys.readouterr().out
    assert "attention_decode" in out and "source: engine" in out
    assert "eager model forwards 3" in out


def test_cli_require_acceleration_exit_2(tiny_dir, fake_v100, monkeypatch, capsys):
    import voltllm.config as config_mod
    from voltllm.cli import main

    monkeypatch.setattr(config_mod, "_resolve_device", lambda device: torch.device("cuda", 0))
    monkeypatch.setattr(config_mod, "_gpu_capability", lambda device: (7, 0))
    rc = main(["check", tiny_dir, "--no-load", "--compat", "sm70", "--attention-backend", "TORCH_REF",
               "--require-acceleration"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "attention_decode" in err and "cuda_graphs" in err
    # the same configuration without the flag prints the report and exits 1 (an expected route is off)
    assert main(["check", tiny_dir, "--no-load", "--compat", "sm70", "--attention-backend", "TORCH_REF"]) == 1


def test_cli_check_sm70_dispatches_to_the_gate(monkeypatch):
    from voltllm.check import sm70_gate
    from voltllm.cli import main

    seen = {}
    monkeypatch.setattr(sm70_gate, "main", lambda argv: seen.setdefault("argv", argv) and 0)
    assert main(["check", "--sm70", "--arch", "70", "--module", "voltllm.kernels.fused", "-j", "1"]) == 0
    assert seen["argv"] == ["--arch", "70", "--module", "voltllm.kernels.fused", "--jobs", "1"]


def test_compile_cache_status_shape():
    acceleration.compile_cache.start()
    s = acceleration.compile_cache.status()
    assert {"dir", "exists", "writable", "tracking", "kernels_loaded", "compiled", "disk_hits"} <= set(s)


def test_hybrid_prefill_template_counts_gdn_decode_calls(tmp_path):
    """With decode graphs every decode step replays, so the per-forward template may come from a prefill. A
    hybrid prefill runs the GDN layers' chunked path, yet a replayed decode step calls both GDN decode
    launchers (conv1d, delta rule) once per GDN layer: the template says so."""
    from tiny_models import make_tiny_hybrid
    from voltllm import LLM

    path = make_tiny_hybrid(str(tmp_path), "qwen3_5", 700, 701)
    if path is None:
        pytest.skip("qwen3_5 not in this transformers")
    runner = LLM(path, device="cpu", skip_tokenizer_init=True, mamba_cache_mode="none").engine.runner
    counters = instrument(runner)
    gdn = sum(type(m).__name__ == "GatedDeltaNet" for m in runner.model.modules())
    assert gdn > 0 and counters.gdn_layers == gdn
    prefill = dict.fromkeys(counters.current(), 0)
    after = dict(prefill, attention_prefill=2, linear=9)
    counters.template = counters.template_source = None
    counters.on_forward(prefill, after)
    assert counters.template["attention_decode"] == 2 and counters.template["attention_prefill"] == 0
    assert counters.template["gdn_decode"] == 2 * gdn
    assert counters.template["gdn_prefill"] == 0  # a replayed decode step runs no chunked prefill


def test_moe_route_predicted_and_counted(tiny_dir, fake_v100, tmp_path):
    """Sparse-MoE models get a `moe` route (expected on a GPU, the Triton router + expert kernels); dense ones
    none. Its counter is the router launcher, hooked process-wide like the GDN launchers."""
    from tiny_models import make_tiny_hybrid, small_moe
    from voltllm import LLM
    from voltllm.bench.shapes import make_config
    from voltllm.kernels import moe_decode

    config = _fake_cuda(EngineArgs(model=tiny_dir, device="cpu").create_engine_config())
    assert "moe" not in build_report(config)["routes"]
    moe_cfg = dataclasses.replace(config, model=dataclasses.replace(
        config.model, hf_config=make_config("qwen3.5-35b-a3b-shape")))
    route = build_report(moe_cfg)["routes"]["moe"]
    assert route["enabled"] and route["expected"] and "router" in route["impl"]
    assert require_acceleration(moe_cfg)["ok"]
    acceleration.install_global_hooks()
    assert getattr(moe_decode.moe_route, "_voltllm_counted", False)
    path = make_tiny_hybrid(str(tmp_path), "qwen3_5_moe", 702, 703, **small_moe("qwen3_5_moe"))
    if path is None:
        pytest.skip("qwen3_5_moe not in this transformers")
    runner = LLM(path, device="cpu", skip_tokenizer_init=True, mamba_cache_mode="none").engine.runner
    cpu = build_report(runner.config, runner)["routes"]["moe"]
    assert not cpu["enabled"] and not cpu["expected"] and "reference" in cpu["impl"]


def test_gdn_prefill_route_names_the_torch_form_where_the_chunk_kernels_do_not_fit(monkeypatch):
    """After GatedDeltaNet found no chunk-kernel tile that fits the GPU (gdn._CHUNK_UNFIT_DEVICES), the report
    names the torch chunked form for that runner's device, and the Triton kernels elsewhere."""
    from types import SimpleNamespace

    import torch

    from voltllm import acceleration
    from voltllm.model.layers import gdn as gdn_layer

    runner = SimpleNamespace(device=torch.device("cuda", 0), model=torch.nn.Module())
    plat = SimpleNamespace(capability=(7, 0))
    config = SimpleNamespace(model=SimpleNamespace(dtype=torch.float16), device=SimpleNamespace(compat="sm70"))
    monkeypatch.setattr(gdn_layer, "_CHUNK_UNFIT_DEVICES", set())
    impl, _ = acceleration._gdn_prefill_route(runner, config, plat, "cpu")
    assert impl.startswith("Triton causal conv1d + chunked gated delta rule (exact fp32 FMA")
    gdn_layer._CHUNK_UNFIT_DEVICES.add(torch.device("cuda", 0))
    impl, why = acceleration._gdn_prefill_route(runner, config, plat, "cpu")
    assert "torch chunked" in impl and "shared memory" in why


def test_linear_route_names_the_kept_quantized_format(tiny_dir, fake_v100):
    """Predicted for a GPU with quantized weights kept quantized: the route names the format (FP8 is not a 4-bit
    group format); dequantized at load, it says so."""
    import copy

    from quant_checkpoints import nvfp4_config

    config = _fake_cuda(EngineArgs(model=tiny_dir, device="cpu").create_engine_config())
    int4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}
    for method, words, qc in (("fp8", "FP8 E4M3", None), ("awq", "awq 4-bit groups", None),
                              ("gguf", "GGUF Q4_0", None), ("modelopt_fp4", "NVFP4 E2M1", None),
                              ("gptq", "gptq 8-bit groups", {"quant_method": "gptq", "bits": 8, "group_size": 128}),
                              ("compressed-tensors", "NVFP4 E2M1", nvfp4_config("compressed-tensors", [])),
                              ("compressed-tensors", "compressed-tensors int4 (groups of 128)", int4)):
        hf_config = copy.copy(config.model.hf_config)
        hf_config.quantization_config = qc
        kept = dataclasses.replace(config, quantization=method, model=dataclasses.replace(
            config.model, quantization=method, quantized_weights="quantized", hf_config=hf_config))
        assert words in build_report(kept)["routes"]["linear"]["impl"], method
        dense = dataclasses.replace(kept, model=dataclasses.replace(kept.model, quantized_weights="dequantized"))
        assert f"{method} weights dequantized" in build_report(dense)["routes"]["linear"]["impl"]


def test_kv_offload_route_predicted_and_counted(tiny_dir, fake_v100):
    """--kv-offloading-size adds the CPU tier's route: predicted page-locked on CUDA; on an engine, its slots and the
    blocks it saved and loaded."""
    from voltllm import LLM, SamplingParams

    config = _fake_cuda(EngineArgs(model=tiny_dir, device="cpu", kv_offloading_size=0.01).create_engine_config())
    r = build_report(config)["routes"]["kv_offload"]
    assert r["enabled"] and r["expected"] and "page-locked" in r["reason"]
    assert "kv_offload" not in build_report(_fake_cuda(EngineArgs(model=tiny_dir, device="cpu")
                                                       .create_engine_config()))["routes"]
    llm = LLM(tiny_dir, device="cpu", max_model_len=256, num_gpu_blocks_override=12, block_size=16,
              kv_offloading_size=0.01, skip_tokenizer_init=True)
    greedy = SamplingParams(temperature=0, max_tokens=2)
    for prompt in ([5] * 100, [7] * 100, [5] * 100):  # the second evicts the first, the third loads it back
        llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)
    report = build_report(llm.engine.config, llm.engine.runner)
    r = report["routes"]["kv_offload"]
    assert not r["enabled"] and not r["expected"] and r["blocks_saved"] > 0 and r["blocks_loaded"] > 0
    assert f"{r['blocks_loaded']} loaded" in r["reason"] and "kv_offload" in format_report(report)


def test_weight_offload_route(tiny_dir, fake_v100):
    """--cpu-offload-gb adds the offloaded layers' route: predicted page-locked on CUDA; on an engine, its layers."""
    from voltllm import LLM

    config = _fake_cuda(EngineArgs(model=tiny_dir, device="cpu", cpu_offload_gb=1000).create_engine_config())
    r = build_report(config)["routes"]["weight_offload"]
    assert r["enabled"] and r["expected"] and "2 GPU staging slots" in r["impl"]
    uva = _fake_cuda(EngineArgs(model=tiny_dir, device="cpu", cpu_offload_gb=1000,
                                offload_backend="uva").create_engine_config())
    assert "read in place" in build_report(uva)["routes"]["weight_offload"]["impl"]
    llm = LLM(tiny_dir, device="cpu", max_model_len=256, cpu_offload_gb=1000, skip_tokenizer_init=True)
    report = build_report(llm.engine.config, llm.engine.runner)
    r = report["routes"]["weight_offload"]
    n = len(llm.engine.runner.model.layers)
    assert r["layers"] == n and f"{n} layers" in r["reason"] and "weight_offload" in format_report(report)


def test_triton_gemm_note_counts_the_lm_head_once():
    """The self-check's note on start-up GEMM choices: the LM head (its own Linear or the tied embeddings) counts
    once, by the model's logits_skinny / logits_batch, and its batch rows are listed."""
    import transformers

    from voltllm.acceleration import _triton_gemm_note
    from voltllm.model.models.llama import LlamaForCausalLM

    for tie in (False, True):
        cfg = transformers.Qwen3Config(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=8, intermediate_size=24,
                                       tie_word_embeddings=tie)
        model = LlamaForCausalLM(cfg, torch.float32, 64)
        runner = types.SimpleNamespace(model=model)
        assert _triton_gemm_note(runner) == ""
        model.layers[0].self_attn.qkv_proj.skinny = ("s",)
        if not tie:  # the tuner sets the head's Linear too (it shares the model's group)
            model.lm_head.skinny, model.lm_head.batch_gemm = ("s",), {8: ("b",)}
        model.logits_skinny, model.logits_batch = ("s",), {8: ("b",)}
        model.layers[0].mlp.down_proj.batch_gemm = {2: ("b",)}
        assert _triton_gemm_note(runner) == ("; Triton GEMMs where start-up timing beat cuBLAS: skinny (1 row) on 2 "
                                             "layers, decode-batch (rows 2, 8) on 2 layers"), tie
        model.layers[0].mlp.down_proj.batch_gemm = {2: ("b",), 3: ("b",), 4: ("b",), 33: ("b",)}
        assert "decode-batch (rows 2-4, 8, 33) on 2 layers" in _triton_gemm_note(runner)
        assert "RMSNorms folded" not in _triton_gemm_note(runner)
        model.norm_fold = types.SimpleNamespace(configs={32: {}, 48: {}, 64: {}})  # (the start-up timing's plan)
        assert _triton_gemm_note(runner).endswith("; RMSNorms folded into the decode-batch GEMMs at rows 32, 48, 64")
        model.logits_argmax = {16: ("b",), 24: ("b",), 32: ("b",)}  # (the greedy head's argmax epilogue)
        note = "; greedy batches' argmax in the LM head's epilogue at rows 16, 24, 32"
        assert _triton_gemm_note(runner).endswith(note)
        model.norm_fold = model.logits_skinny = model.logits_batch = None
        model.layers[0].self_attn.qkv_proj.skinny = model.layers[0].mlp.down_proj.batch_gemm = None
        if not tie:
            model.lm_head.skinny = model.lm_head.batch_gemm = None
        assert _triton_gemm_note(runner) == note
