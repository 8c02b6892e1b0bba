"""LoRA adapters on Qwen4-Exp (qwen4_exp_text; CPU, a tiny random checkpoint with PLE layers and two gated-attention
layers, adapters with random A and B): the gated attention (q_proj's [q | gate] rows per head), the Gated DeltaNet
projections (Qwen3.5's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a, out_proj), every routed expert (per expert)
and the shared expert. Each request's greedy tokens and logprobs equal transformers' on the checkpoint with its adapter
merged (W + scaling * B A), in batches mixing two adapters and none (chunked prefill, decode); -tp 2 (gloo), with and
without expert parallelism, equals it too. The linears this version does not adapt are refused by name."""
from __future__ import annotations

import functools

import pytest
import torch

from lora_adapters import make_adapter, merged_copy
from tiny_models import HYBRID_VOCAB, QWEN4_EXP_INDEXER, QWEN4_EXP_PLE, make_tiny_qwen4_exp
from voltllm import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GDN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ADAPTERS = {
    # everything built: attention, GDN, routed experts, shared expert
    "a1": dict(rank=8, alpha=16, seed=1, std=0.15, targets=ATTENTION + GDN + ("experts", "shared_expert")),
    # a smaller rank (zero-padded to --max-lora-rank), some modules of some layers
    "a2": dict(rank=4, alpha=8, seed=2, std=0.25, layers=[1, 2],
               targets=("q_proj", "o_proj", "in_proj_z", "out_proj", "experts")),
}
PROMPTS = [[5, 9, 33, 41, 7, 100, 3, 77, 12, 150, 8, 19, 23], [17, 18, 19], [3, 4] * 9, [60, 61, 2, 190, 44, 6]]
NAMES = [None, "a1", "a2", "a1"]
ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=8, device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=16, max_num_seqs=4, skip_tokenizer_init=True)
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)


class Setup:
    def __init__(self, root: str):
        # two GDN layers with PLE (1 and 3, 1-indexed), two gated-attention layers; QSA's budget past every context
        self.model = make_tiny_qwen4_exp(f"{root}/q4", 3, **QWEN4_EXP_INDEXER, **QWEN4_EXP_PLE,
                                         layer_types=["linear_attention", "indexed_attention"] * 2)
        if self.model is None:
            pytest.skip("this transformers has no Qwen4-Exp")
        self.paths = {n: make_adapter(f"{root}/{n}", self.model, **kw) for n, kw in ADAPTERS.items()}
        self.requests = {n: LoRARequest(n, i, p) for i, (n, p) in enumerate(self.paths.items(), 1)}
        self.prompts = [[t % HYBRID_VOCAB for t in p] for p in PROMPTS]
        self.root = root

    @functools.lru_cache(maxsize=None)
    def reference(self, name, prompt):
        """transformers (no cache) on the checkpoint with the adapter merged: greedy tokens, each one's logprobs."""
        model = self._merged(name)
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(GREEDY.max_tokens):
                seq.append(int(model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
            logprobs = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0].float().log_softmax(-1)
        return seq[len(prompt):], logprobs[len(prompt) - 1:-1]

    @functools.lru_cache(maxsize=None)
    def _merged(self, name):
        from transformers import AutoModelForCausalLM

        path = self.model if name is None else merged_copy(self.model, self.paths[name], f"{self.root}/merged-{name}")
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def check(self, llm, names=NAMES):
        outs = llm.generate([{"prompt_token_ids": p} for p in self.prompts], GREEDY,
                            lora_request=[self.requests.get(n) for n in names], use_tqdm=False)
        for prompt, name, out in zip(self.prompts, names, outs):
            tokens, logprobs = self.reference(name, tuple(prompt))
            got = out.outputs[0]
            assert list(got.token_ids) == tokens, (name, prompt)
            for j, (tid, lp) in enumerate(zip(got.token_ids, got.logprobs)):
                for t, v in lp.items():
                    assert v.logprob == pytest.approx(logprobs[j, t].item(), abs=1e-4), (name, j, t)
        llm.engine.check_integrity()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return Setup(str(tmp_path_factory.mktemp("lora-q4")))


def test_adapters_equal_transformers_on_the_merged_checkpoint_in_a_mixed_batch(setup):
    """a1 (attention, GDN, routed and shared experts) and a2 (some of them, rank 4) beside the base model in one
    batch: each request equals transformers with its adapter merged, and each adapter changes the output."""
    llm = LLM(setup.model, **ENGINE)
    try:
        setup.check(llm)
    finally:
        llm.engine.shutdown()
    for i, name in enumerate(NAMES):
        if name is not None:
            prompt = tuple(setup.prompts[i])
            assert setup.reference(name, prompt)[0] != setup.reference(None, prompt)[0], name


@pytest.mark.parametrize("target", ["attention", "gdn", "experts", "shared_expert"])
def test_each_part_alone_matches_and_matters(setup, target):
    """An adapter on one part alone (the other parts' terms cannot hide a missing or misplaced one): it changes the
    merged model's output, and the engine equals the merged model."""
    targets = {"attention": ATTENTION, "gdn": GDN, "experts": ("experts",), "shared_expert": ("shared_expert",)}
    name = f"only-{target}"
    path = make_adapter(f"{setup.root}/{name}", setup.model, rank=8, alpha=16, seed=5, std=0.3,
                        targets=targets[target])
    setup.paths[name] = path
    setup.requests[name] = LoRARequest(name, 10 + list(targets).index(target), path)
    names = [name, None, name, None]
    llm = LLM(setup.model, **ENGINE)
    try:
        setup.check(llm, names)
    finally:
        llm.engine.shutdown()
    assert any(setup.reference(name, tuple(p))[0] != setup.reference(None, tuple(p))[0] for p in setup.prompts)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tensor_parallel_ranks_cut_the_adapters_as_the_checkpoint(setup, expert_parallel):
    """-tp 2 (gloo): each rank's adapter slices are the model's own cuts (gated attention by heads, GDN by key /
    value heads, every expert's intermediate band or whole experts of its own, the shared expert's band); a mixed
    batch equals transformers on the merged checkpoints, as -tp 1 does."""
    two = LLM(setup.model, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **ENGINE)
    try:
        setup.check(two)
    finally:
        two.engine.shutdown()


def test_prefix_snapshots_keep_adapters_apart(setup):
    """The same long prompt under the base model, a1, a2, a1 again and the base model again, with prefix caching
    (KV blocks, QSA keys, GDN and PLE state snapshots keyed by adapter-keyed block hashes): each run equals its merged
    reference, so nothing cached under one adapter served another, and the repeats did resume from snapshots."""
    llm = LLM(setup.model, **{**ENGINE, "enable_prefix_caching": True, "mamba_block_size": 8})
    prompt = setup.prompts[2] + setup.prompts[0]
    saved = setup.prompts
    try:
        setup.prompts = [prompt]
        for name in [None, "a1", "a2", "a1", None, "a2"]:
            setup.check(llm, [name])
        assert llm.engine.runner.state_snapshots.num_restored > 0
    finally:
        setup.prompts = saved
        llm.engine.shutdown()


# -- what is not built: refused by name -------------------------------------------------------------------------
REFUSED = {
    "layers.0.attn_hyper_connection.input_mix_weight_down": ((16, 128), "hyper-connection"),
    "layers.1.mlp_hyper_connection.block_inject_weight": ((2, 128), "hyper-connection"),
    "hyper_connection_mixer.input_mix_weight_up": ((128, 16), "hyper-connection"),
    "layers.0.ple.key_proj": ((128, 64), "PLE"),
    "layers.2.ple.value_proj": ((64, 64), "PLE"),
    "layers.1.self_attn.indexer.index_qk_proj": ((160, 64), "QSA indexer"),
    "layers.3.mlp.gate": ((4, 64), "the router"),
    "layers.3.mlp.shared_expert_gate": ((1, 64), "output gate"),
}


@pytest.mark.parametrize("module", list(REFUSED))
def test_unbuilt_linears_are_refused_by_name(setup, module):
    from transformers import AutoConfig

    from voltllm.lora.adapter import LoRAAdapterError, read_adapter

    (n_out, n_in), what = REFUSED[module]
    name = f"base_model.model.model.{module}"
    extra = {f"{name}.lora_A.weight": torch.zeros(4, n_in), f"{name}.lora_B.weight": torch.zeros(n_out, 4)}
    path = make_adapter(f"{setup.root}/bad-{module}", setup.model, rank=4, targets=("q_proj",), extra_tensors=extra)
    leaf = module.split(".")[-1] if what in ("the router", "output gate") else module.split(".")[-2]
    with pytest.raises(LoRAAdapterError, match=what) as err:
        read_adapter(LoRARequest("bad", 1, path), AutoConfig.from_pretrained(setup.model), 8, torch.float32)
    assert leaf in str(err.value) and "\n" not in str(err.value)


def test_a_multimodal_checkpoints_language_model_names_are_read_as_the_text_models(setup):
    """A qwen4_exp (multimodal) checkpoint's adapter names its projections model.language_model.layers.*: the same
    slots as the text model's model.layers.* names."""
    import os

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, Qwen4ExpConfig

    from voltllm.lora.adapter import read_adapter

    text = AutoConfig.from_pretrained(setup.model)
    wrapper = Qwen4ExpConfig(text_config=text.to_dict())
    src = setup.paths["a1"]
    mm = f"{setup.root}/a1-mm"
    os.makedirs(mm, exist_ok=True)
    tensors = load_file(f"{src}/adapter_model.safetensors")
    save_file({k.replace("model.model.layers.", "model.model.language_model.layers."): v for k, v in tensors.items()},
              f"{mm}/adapter_model.safetensors")
    with open(f"{src}/adapter_config.json") as f, open(f"{mm}/adapter_config.json", "w") as g:
        g.write(f.read())
    a = read_adapter(LoRARequest("t", 1, src), text, 8, torch.float32)
    b = read_adapter(LoRARequest("m", 2, mm), wrapper, 8, torch.float32)
    assert a.weights.keys() == b.weights.keys() and a.experts.keys() == b.experts.keys()
    assert "layers.1.self_attn.qkv_proj" in b.weights and "layers.0.linear_attn.in_proj" in b.weights
    assert "layers.3.mlp.shared_expert.gate_up_proj" in b.weights and "layers.2.mlp.experts" in b.experts
    for name, shards in a.weights.items():
        for s, (x, y) in shards.items():
            assert torch.equal(x, b.weights[name][s][0]) and torch.equal(y, b.weights[name][s][1])


def test_qsa_past_its_budget_keeps_the_adapters_terms(tmp_path):
    """QSA with a budget of 8 tokens: the prompts past it take the sparse path (prompt rows) and the device selection
    (decode rows) with the adapted q / k / v (and q_proj's adapted gate); each equals transformers on the merged
    checkpoint."""
    s = Setup.__new__(Setup)
    s.root = str(tmp_path)
    s.model = make_tiny_qwen4_exp(f"{s.root}/q4", 4, **dict(QWEN4_EXP_INDEXER, indexer_budget=8),
                                  layer_types=["linear_attention", "indexed_attention"] * 2)
    if s.model is None:
        pytest.skip("this transformers has no Qwen4-Exp")
    s.paths = {"a1": make_adapter(f"{s.root}/a1", s.model, **ADAPTERS["a1"])}
    s.requests = {"a1": LoRARequest("a1", 1, s.paths["a1"])}
    s.prompts = [[t % HYBRID_VOCAB for t in p] for p in PROMPTS]
    llm = LLM(s.model, **ENGINE)
    try:
        s.check(llm, ["a1", None, "a1", "a1"])
    finally:
        llm.engine.shutdown()
    assert s.reference("a1", tuple(s.prompts[0]))[0] != s.reference(None, tuple(s.prompts[0]))[0]
