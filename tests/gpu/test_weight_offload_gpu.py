"""Weight offloading on CUDA (worker/weight_offload.py): offloaded decoder layers in page-locked host memory, copied
into fewer GPU staging slots than there are of them on a copy stream ahead of their turn, decode CUDA graphs (which
capture the copies) and eager prompt steps. Greedy tokens and logprobs equal an engine without offloading: dense fp32 /
fp16, a hybrid (qwen3_5), and AWQ weights kept quantized (their planes offloaded). With --offload-backend uva the
kernels read the weights in host memory in place (dense layers at 20 decode rows, where the decode-batch GEMMs must
not take TMA tiles; a MoE model's experts only). Run on the GPU machine:
    PYTHONPATH=$PWD:$PWD/tests python3 -m pytest -m gpu -q tests/gpu/test_weight_offload_gpu.py -p no:cacheprovider
"""
from __future__ import annotations

import gc

import pytest
import torch

from tiny_models import HYBRID_VOCAB, make_model, make_tiny_hybrid, make_tokenizer
from voltllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
PROMPTS = [[(7 * i + 3 * j) % 300 + 3 for j in range(5 + 9 * i)] for i in range(5)]
ALL = 1000.0  # GiB: every layer


def _run(path, prompts=PROMPTS, **kw):
    kw.setdefault("max_num_seqs", 8)
    llm = LLM(path, device="cuda", max_model_len=256, gpu_memory_utilization=0.3, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return llm, [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
                 for o in outs]


def _assert_close(got, want, tol):
    for (ta, la), (tb, lb) in zip(got, want):
        assert ta == tb
        for a, b in zip(la, lb):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) <= tol for t in a)


def _free(llm):
    llm.engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("wo_gpu")), "qwen3", num_hidden_layers=6, hidden_size=256,
                      intermediate_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=32)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("float16", 1e-3)])
@pytest.mark.parametrize("flags,order,slots", [
    (dict(cpu_offload_gb=ALL), [0, 1, 2, 3, 4, 5], 2),  # prefetch 1: six layers through two slots
    (dict(cpu_offload_gb=ALL, offload_prefetch_step=3), [0, 1, 2, 3, 4, 5], 4),
    (dict(cpu_offload_gb=ALL, offload_prefetch_step=0), [0, 1, 2, 3, 4, 5], 1),  # copies on the compute stream
    (dict(offload_group_size=3, offload_num_in_group=2), [1, 2, 4, 5], 2),
])
def test_offloaded_layers_generate_the_same(dense, dtype, tol, flags, order, slots):
    ref_llm, reference = _run(dense, dtype=dtype)
    _free(ref_llm)
    llm, outs = _run(dense, dtype=dtype, **flags)
    runner = llm.engine.runner
    streamer = runner.weight_offload
    assert streamer.order == order and streamer.num_slots == slots
    assert all(h.is_pinned() for h in streamer.host)
    assert (streamer.stream is not None) == (streamer.prefetch > 0)
    assert runner.graphs is not None and runner.graphs.replays > 0  # decode steps replayed graphs with the copies
    assert runner.prompt_graphs is None
    lo, hi = streamer.slots.data_ptr(), streamer.slots.data_ptr() + streamer.slots.numel()
    for i, layer in enumerate(runner.model.layers):
        inside = [lo <= p.data_ptr() < hi for p in layer.parameters()]
        assert all(inside) if i in order else not any(inside)
        assert all(p.is_cuda for p in layer.parameters())
    _assert_close(outs, reference, tol)
    # a second round: the graphs replay the copies from the same host buffers
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [t for t, _ in outs]
    _free(llm)


def _gpu_weight_bytes(model) -> int:
    """Bytes of the distinct GPU storages the model's tensors view (weights, buffers, staging slots)."""
    from voltllm.worker.weight_offload import reachable_tensors

    seen = {}
    for f in reachable_tensors(model):
        if f.tensor.is_cuda:
            s = f.tensor.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def test_offloading_frees_gpu_memory(dense):
    """The model's GPU storages shrink by the offloaded layers, less the staging slots."""
    kw = dict(device="cuda", dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 26, enforce_eager=True)
    llm = LLM(dense, **kw)
    full = _gpu_weight_bytes(llm.engine.runner.model)
    _free(llm)
    llm = LLM(dense, **kw, cpu_offload_gb=ALL, offload_prefetch_step=0)
    offloaded = _gpu_weight_bytes(llm.engine.runner.model)
    streamer = llm.engine.runner.weight_offload
    saved = streamer.offloaded_bytes - streamer.staging_bytes
    assert saved > 0 and full - offloaded >= 0.9 * saved
    _free(llm)


def test_hybrid(tmp_path):
    path = make_tiny_hybrid(str(tmp_path), "qwen3_5", seed=0, gen_seed=1)
    if path is None:
        pytest.skip("this transformers has no qwen3_5")
    make_tokenizer(path)
    prompts = [[t % HYBRID_VOCAB for t in p] for p in PROMPTS]
    ref_llm, reference = _run(path, prompts, dtype="float32")
    _free(ref_llm)
    llm, outs = _run(path, prompts, dtype="float32", cpu_offload_gb=ALL)
    assert llm.engine.runner.weight_offload.num_slots == 2
    _assert_close(outs, reference, 1e-5)
    _free(llm)


def test_weights_kept_quantized(tmp_path, monkeypatch):
    import voltllm.config
    from quant_checkpoints import quantize_checkpoint

    path = make_model(str(tmp_path), "qwen3", num_hidden_layers=4, hidden_size=256, intermediate_size=512,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=32)
    quantize_checkpoint(path, "awq", group=32)
    monkeypatch.setattr(voltllm.config, "KEEP_QUANTIZED", 1)
    ref_llm, reference = _run(path, dtype="float16")
    assert ref_llm.engine.runner.keep_quantized
    _free(ref_llm)
    llm, outs = _run(path, dtype="float16", cpu_offload_gb=ALL)
    runner = llm.engine.runner
    planes = runner.model.layers[2].mlp.gate_up_proj.gguf_segments[0].weight
    streamer = runner.weight_offload
    assert streamer.slots.data_ptr() <= planes.lo.data_ptr() < streamer.slots.data_ptr() + streamer.slots.numel()
    _assert_close(outs, reference, 1e-3)
    _free(llm)


# -- --offload-backend uva: kernels read the offloaded weights in host memory, in place ------------------------------
WIDE = [[(11 * i + 5 * j) % 300 + 3 for j in range(4 + 3 * i)] for i in range(20)]  # 20 rows: decode-batch GEMMs


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("float16", 1e-3)])
def test_read_in_place(dense, dtype, tol):
    from voltllm.host_memory import in_host_memory

    ref_llm, reference = _run(dense, WIDE, dtype=dtype, max_num_seqs=32)
    _free(ref_llm)
    llm, outs = _run(dense, WIDE, dtype=dtype, max_num_seqs=32, cpu_offload_gb=ALL, offload_backend="uva")
    runner = llm.engine.runner
    held = runner.weight_offload
    assert held.num_slots == 0 and held.order == [0, 1, 2, 3, 4, 5]
    for layer in runner.model.layers:
        assert all(p.is_cuda and in_host_memory(p) for p in layer.parameters())
    assert runner.graphs is not None and runner.graphs.replays > 0
    _assert_close(outs, reference, tol)
    _free(llm)


def test_moe_experts_read_in_place(tmp_path):
    """A MoE model's experts only (vLLM's --cpu-offload-params experts) in host memory, read in place: each decode
    step reads the routed experts over the bus."""
    from voltllm.host_memory import in_host_memory

    path = make_model(str(tmp_path), "qwen3_moe", num_hidden_layers=3)
    ref_llm, reference = _run(path, dtype="float32")
    _free(ref_llm)
    llm, outs = _run(path, dtype="float32", cpu_offload_gb=ALL, offload_backend="uva", cpu_offload_params=["experts"])
    layers = llm.engine.runner.model.layers
    assert in_host_memory(layers[0].mlp.w13) and in_host_memory(layers[2].mlp.w2)
    assert not in_host_memory(layers[0].self_attn.qkv_proj.weight)
    _assert_close(outs, reference, 1e-5)
    _free(llm)
