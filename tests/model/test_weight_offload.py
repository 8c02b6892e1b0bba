"""Weight offloading (--cpu-offload-gb, --offload-group-size; worker/weight_offload.py) on tiny random models on the
CPU: offloaded decoder layers share fewer staging slots than there are of them, so every forward must copy each one
in before it runs; greedy tokens and logprobs equal an engine without offloading (fp32, the same arithmetic: bit for
bit). Dense, MoE (experts only, by name), hybrid (Gated DeltaNet) and AWQ weights kept quantized; a tensor the
offloader cannot re-point stops the start. The CUDA side (page-locked memory, the copy stream, decode graphs):
tests/gpu/test_weight_offload_gpu.py."""
from __future__ import annotations

import pytest
import torch

from tiny_models import HYBRID_VOCAB, make_model, make_tiny_hybrid
from voltllm import SamplingParams
from voltllm.worker import weight_offload
from voltllm.worker.weight_offload import LayerStreamer, choose_layers
from voltllm.weight_offload_config import WeightOffloadConfig

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
PROMPTS = [[5, 9, 33, 41, 7, 100, 3, 77, 12], [17, 18, 19], [3, 4] * 11]
ALL = 1000.0  # GiB: more than the model, so every layer is offloaded
ALL_BYTES = int(ALL * 2**30)


def _llm(path, **kw):
    from voltllm.entrypoints.llm import LLM

    return LLM(path, device="cpu", dtype="float32", enforce_eager=True, max_model_len=128, max_num_seqs=4, **kw)


def _outputs(llm, prompts=PROMPTS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    path = make_model(str(tmp_path_factory.mktemp("wo_dense")), "qwen3", num_hidden_layers=4)
    return path, _outputs(_llm(path))


def _slot_views(streamer: LayerStreamer, layer: torch.nn.Module) -> int:
    """How many of the layer's parameters view the staging slots."""
    lo = streamer.slots.data_ptr()
    hi = lo + streamer.slots.numel()
    return sum(lo <= p.data_ptr() < hi for p in layer.parameters())


@pytest.mark.parametrize("flags,offloaded,slots", [
    (dict(cpu_offload_gb=ALL, offload_prefetch_step=0), [0, 1, 2, 3], 1),
    (dict(cpu_offload_gb=ALL, offload_prefetch_step=2), [0, 1, 2, 3], 3),
    # the fewest layers freeing the budget: three (two of them go to the two staging slots), spread out
    (dict(cpu_offload_gb=1e-6), [0, 2, 3], 2),
    (dict(offload_group_size=4, offload_num_in_group=3), [1, 2, 3], 2),  # vLLM's rule: the last 3 of every 4
])
def test_offloaded_layers_generate_the_same(dense, flags, offloaded, slots):
    path, reference = dense
    llm = _llm(path, **flags)
    streamer = llm.engine.runner.weight_offload
    assert streamer.order == offloaded and streamer.num_slots == slots
    layers = llm.engine.runner.model.layers
    for i, layer in enumerate(layers):
        n = _slot_views(streamer, layer)
        assert (n == len(list(layer.parameters()))) if i in offloaded else n == 0
    assert _outputs(llm) == reference


def test_read_in_place(dense):
    """--offload-backend uva: the offloaded layers' tensors view their host buffers (on a GPU: through a CUDA view
    of the page-locked buffer); no slots, no hooks."""
    path, reference = dense
    llm = _llm(path, cpu_offload_gb=ALL, offload_backend="uva")
    held = llm.engine.runner.weight_offload
    assert held.order == [0, 1, 2, 3] and held.num_slots == 0
    for layer, host in zip(llm.engine.runner.model.layers, held.host):
        lo, hi = host.data_ptr(), host.data_ptr() + host.numel()
        assert all(lo <= p.data_ptr() < hi for p in layer.parameters())
        assert not layer._forward_pre_hooks
    assert _outputs(llm) == reference


def test_layers_sharing_a_slot_need_their_copies(dense, monkeypatch):
    """The check above can fail: with the per-layer copy skipped, layers read whichever layer's weights the shared
    slot holds."""
    path, reference = dense
    llm = _llm(path, cpu_offload_gb=ALL, offload_prefetch_step=1)
    monkeypatch.setattr(LayerStreamer, "_copy", lambda self, j: None)
    assert _outputs(llm) != reference


def test_moe_experts_only_by_name(tmp_path):
    path = make_model(str(tmp_path), "qwen3_moe", num_hidden_layers=3)
    reference = _outputs(_llm(path))
    llm = _llm(path, cpu_offload_gb=ALL, offload_prefetch_step=0, cpu_offload_params=["experts"])
    streamer = llm.engine.runner.weight_offload
    assert streamer.order == [0, 2]  # layer 1 is dense (mlp_only_layers): nothing there is named experts
    layers = llm.engine.runner.model.layers
    for i in streamer.order:
        moe = layers[i].mlp
        assert _slot_views(streamer, moe) == 2  # w13 and w2 ...
        assert _slot_views(streamer, layers[i].self_attn) == 0  # ... and nothing else
    assert _outputs(llm) == reference


def test_hybrid_layers(tmp_path):
    path = make_tiny_hybrid(str(tmp_path), "qwen3_5", seed=0, gen_seed=1)
    if path is None:
        pytest.skip("this transformers has no qwen3_5")
    from tiny_models import make_tokenizer

    make_tokenizer(path)
    prompts = [[t % HYBRID_VOCAB for t in p] for p in PROMPTS]
    reference = _outputs(_llm(path), prompts)
    llm = _llm(path, cpu_offload_gb=ALL, offload_prefetch_step=1)
    assert llm.engine.runner.weight_offload.num_slots == 2
    assert _outputs(llm, prompts) == reference


def test_weights_kept_quantized(tmp_path):
    """Planes (held outside the modules' parameters, in dataclasses) are found, packed and copied back: with one slot
    for three layers, each layer's planes hold its own values once its pre-hook has run. (The engine keeps weights
    quantized only on a GPU: tests/gpu/test_weight_offload_gpu.py runs this end to end.)"""
    from quant_checkpoints import kept_and_dense, quantize_checkpoint
    from voltllm.worker.weight_offload import install_weight_offload, reachable_tensors

    path = make_model(str(tmp_path), "qwen3", num_hidden_layers=3)
    quantize_checkpoint(path, "awq", group=32)
    model, _ = kept_and_dense(path)
    before = [[(f.path, f.tensor.clone()) for f in reachable_tensors(layer)] for layer in model.layers]
    assert any(".lo" in name for name, _ in before[0])  # the planes are among them
    cfg = WeightOffloadConfig(budget_bytes=ALL_BYTES, group_size=0, num_in_group=1, prefetch_step=0, params=())
    streamer = install_weight_offload(model, cfg, torch.device("cpu"))
    assert streamer.order == [0, 1, 2] and streamer.num_slots == 1
    planes = model.layers[1].self_attn.qkv_proj.gguf_segments[0].weight
    assert streamer.slots.data_ptr() <= planes.lo.data_ptr() < streamer.slots.data_ptr() + streamer.slots.numel()
    for i in (0, 1, 2, 1, 0):
        streamer._before(i, model.layers[i], ())
        now = [(f.path, f.tensor) for f in reachable_tensors(model.layers[i])]
        assert [n for n, _ in now] == [n for n, _ in before[i]]
        for (name, t), (_, want) in zip(now, before[i]):
            assert torch.equal(t, want), name
    streamer.remove()


def test_a_tensor_it_cannot_repoint_stops_the_start(dense, monkeypatch):
    path, _ = dense
    plan_offload = weight_offload.plan_offload
    kept = []

    def hiding_a_view(model, cfg):  # a view of an offloaded weight cached where no walk of the model finds it
        plan = plan_offload(model, cfg)
        kept.append(model.layers[plan.layers[0]].mlp.down_proj.weight[:1])
        return plan
    monkeypatch.setattr(weight_offload, "plan_offload", hiding_a_view)
    with pytest.raises(RuntimeError, match="still referenced"):
        _llm(path, cpu_offload_gb=ALL)


def _cfg(budget=0, group=0, n=1, backend="prefetch"):
    return WeightOffloadConfig(budget_bytes=budget, group_size=group, num_in_group=n, prefetch_step=1, params=(),
                               backend=backend)


def test_choose_layers():
    """The budget is GPU memory freed: the offloaded layers less the two staging slots (prefetch 1)."""
    sizes = [10] * 8
    assert choose_layers(sizes, _cfg(budget=25)) == [0, 2, 4, 5, 7]  # five layers free 30 (two slots take 20)
    assert choose_layers(sizes, _cfg(budget=10)) == [1, 4, 6]
    assert choose_layers(sizes, _cfg(budget=81)) == list(range(8))  # more than the model: all of it
    assert choose_layers(sizes, _cfg(group=4, n=2)) == [2, 3, 6, 7]
    assert choose_layers(sizes, _cfg(budget=25, backend="uva")) == [1, 4, 6]  # uva: no slots
    assert choose_layers([5, 50, 5, 5], _cfg(budget=50, backend="uva")) == [1, 3]  # sizes differ: counted


def test_offloading_that_frees_nothing_is_refused(dense):
    path, _ = dense
    with pytest.raises(RuntimeError, match="would free no GPU memory"):  # two layers, two slots
        _llm(path, offload_group_size=2, offload_num_in_group=1)
    with pytest.raises(RuntimeError, match="picks none"):
        _llm(path, offload_group_size=8, offload_num_in_group=1)


def test_vllm_parameter_names(tmp_path):
    """--cpu-offload-params takes vLLM's names: a MoE layer's experts.w13_weight, a layer by layers.N."""
    path = make_model(str(tmp_path), "qwen3_moe", num_hidden_layers=3)
    llm = _llm(path, cpu_offload_gb=ALL, offload_backend="uva", cpu_offload_params="experts.w2_weight,layers.1")
    layers = llm.engine.runner.model.layers
    host = llm.engine.runner.weight_offload.host
    spans = [(h.data_ptr(), h.data_ptr() + h.numel()) for h in host]

    def held(t):
        return any(lo <= t.data_ptr() < hi for lo, hi in spans)
    assert held(layers[0].mlp.w2) and not held(layers[0].mlp.w13)  # only w2 of the MoE layers ...
    assert all(held(p) for p in layers[1].parameters())  # ... and all of layer 1
