"""LoRA adapters on MoE experts (CPU, tiny random qwen3_moe / qwen3_5_moe checkpoints and adapters with random A and B
on every routed expert's gate / up / down, a shared expert's and the attention's): each request's greedy tokens and
logprobs equal transformers' on the checkpoint with the adapter merged (W + scaling * B A, expert by expert), in
batches mixing two adapters and the base model; -tp 2 (gloo), with and without expert parallelism, equals -tp 1."""
from __future__ import annotations

import functools

import pytest
import torch

from lora_adapters import make_adapter, make_fused_expert_adapter, merged_copy, merged_fused_model
from tiny_models import make_model
from voltllm import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["The quick brown fox jumps over", "What is the capital of France? The capital",
           "def add(a, b):\n    return", "Hello world! Voltllm serves language models on old GPUs, fast.",
           "0123456789 0123", "Paris"]
NAMES = [None, "a1", "a2", "a1", None, "a2"]
# a1: the attention and every routed expert; a2: the experts alone, a smaller rank (zero-padded to --max-lora-rank)
ADAPTERS = {"a1": dict(rank=8, alpha=16, seed=1, targets=("q_proj", "v_proj", "o_proj", "experts"), std=0.2),
            "a2": dict(rank=4, alpha=8, seed=2, targets=("experts",), std=0.3),
            "a3": dict(rank=4, alpha=8, seed=3, targets=("k_proj", "o_proj"), std=0.3)}  # (no experts)
ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4, max_num_batched_tokens=16,
              max_num_seqs=6)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)


class Setup:
    def __init__(self, root: str):
        self.model = make_model(f"{root}/moe", "qwen3_moe")
        self.paths = {n: make_adapter(f"{root}/moe-{n}", self.model, **kw) for n, kw in ADAPTERS.items()}
        self.requests = {n: LoRARequest(n, i, p) for i, (n, p) in enumerate(self.paths.items(), 1)}
        self.root = root

    @functools.lru_cache(maxsize=None)
    def reference(self, name):
        """transformers on the checkpoint with the adapter merged into its per-expert weights."""
        from transformers import AutoModelForCausalLM

        path = self.model if name is None else merged_copy(self.model, self.paths[name], f"{self.root}/merged-{name}")
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def check(self, llm, names=NAMES, prompts=PROMPTS):
        tok = llm.get_tokenizer()
        outs = llm.generate(prompts, GREEDY, lora_request=[self.requests.get(n) for n in names], use_tqdm=False)
        for prompt, name, out in zip(prompts, names, outs):
            ids = tok.encode(prompt)
            with torch.no_grad():
                ref = self.reference(name).generate(torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens,
                                                    do_sample=False, min_new_tokens=GREEDY.max_tokens)
                full = ref[0].tolist()
                logits = self.reference(name)(torch.tensor([full])).logits[0].log_softmax(-1)
            assert list(out.outputs[0].token_ids) == full[len(ids):], (prompt, name)
            for j, (tid, lp) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
                assert lp[tid].logprob == pytest.approx(logits[len(ids) + j - 1, tid].item(), abs=1e-4), (name, j)
        llm.engine.check_integrity()
        return outs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return Setup(str(tmp_path_factory.mktemp("lora-moe")))


def test_expert_adapters_match_the_merged_model_in_a_mixed_batch(setup):
    """Two adapters with random expert A and B, and the base model, in one batch (chunked prefill, decode steps mixing
    them): each request equals transformers with its adapter merged; the adapters change the output."""
    llm = LLM(setup.model, **ENGINE)
    outs = setup.check(llm)
    base = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    changed = [o.outputs[0].token_ids != b.outputs[0].token_ids for o, b, n in zip(outs, base, NAMES) if n]
    assert all(changed)


def test_expert_only_adapter_changes_the_output_where_attention_adapters_are_absent(setup):
    """a2 adapts the experts alone: without its expert terms the engine would serve the base model."""
    llm = LLM(setup.model, **ENGINE)
    setup.check(llm, ["a2", "a2"], PROMPTS[:2])


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tensor_parallel_ranks_cut_expert_adapters_as_their_experts(setup, expert_parallel):
    """-tp 2 (gloo): each rank holds its band of every expert's intermediate rows (or whole experts of its own under
    --enable-expert-parallel) and cuts the adapters alike; tokens and logprobs equal the merged model's."""
    two = LLM(setup.model, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **ENGINE)
    try:
        setup.check(two)
    finally:
        two.engine.shutdown()


@pytest.mark.parametrize("params", [("gate_up_proj", "down_proj"), ("down_proj",)])
def test_fused_expert_adapters_match_peft_update_on_the_3d_experts(setup, params):
    """PEFT's target_parameters form over transformers 5's 3D expert tensors (one pair over all experts per
    parameter, nested under base_layer): greedy tokens and logprobs equal transformers with PEFT's own update formula
    applied to the 3D tensors, beside the base model in one batch."""
    name = "fused-" + "-".join(params)
    path = make_fused_expert_adapter(f"{setup.root}/{name}", setup.model, params=params)
    ref = merged_fused_model(setup.model, path)
    base = setup.reference(None)
    llm = LLM(setup.model, **ENGINE)
    req = LoRARequest(name, 7, path)
    outs = llm.generate(PROMPTS[:4], GREEDY, lora_request=[req, None, req, req], use_tqdm=False)
    tok = llm.get_tokenizer()
    changed = 0
    for prompt, out, model in zip(PROMPTS[:4], outs, (ref, base, ref, ref)):
        ids = tok.encode(prompt)
        with torch.no_grad():
            full = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                                  min_new_tokens=GREEDY.max_tokens)[0].tolist()
            logits = model(torch.tensor([full])).logits[0].log_softmax(-1)
        assert list(out.outputs[0].token_ids) == full[len(ids):], prompt
        for j, (tid, lp) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
            assert lp[tid].logprob == pytest.approx(logits[len(ids) + j - 1, tid].item(), abs=1e-4), (prompt, j)
        if model is ref:
            with torch.no_grad():
                changed += int(base.generate(torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                                             min_new_tokens=GREEDY.max_tokens)[0].tolist() != full)
    assert changed >= 2  # the adapter changes the outputs it should
    llm.engine.check_integrity()


def test_fused_expert_adapter_equals_its_per_expert_form(setup, tmp_path):
    """The fused pairs read as per-expert pairs: expert e's A is rows e r .. e r + r - 1 of lora_A and its B the
    columns k E + e of lora_B, gate_up's B rows split gate then up; shapes that fit neither parameter, and an
    expert adapted in both forms, are refused by name."""
    import os

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from voltllm.lora.adapter import LoRAAdapterError, read_adapter

    cfg = AutoConfig.from_pretrained(setup.model)
    path = make_fused_expert_adapter(str(tmp_path / "fused"), setup.model, rank=2, seed=5)
    got = read_adapter(LoRARequest("f", 1, path), cfg, 8, torch.float32)
    fused = load_file(os.path.join(path, "adapter_model.safetensors"))
    e, i, r = cfg.num_experts, cfg.moe_intermediate_size, 2
    scaling = 8 / 2
    gu = next(k for k in fused if k.endswith("experts.base_layer.lora_A.weight"))  # (the first sparse layer's)
    layer = gu.split(".layers.")[1].split(".")[0]
    a_gu, b_gu = fused[gu], fused[gu.replace(".lora_A.", ".lora_B.")]
    for x in (0, 5):
        a, bt = got.experts[f"layers.{layer}.mlp.experts"][(x, "up")]
        assert torch.equal(a, a_gu[x * r:(x + 1) * r])
        want_b = torch.stack([b_gu[i:, k * e + x] for k in range(r)], dim=1)  # [I, r]
        assert torch.allclose(bt, (want_b * scaling).t())
    assert set(got.experts[f"layers.{layer}.mlp.experts"]) == {(x, k) for x in range(e)
                                                              for k in ("gate", "up", "down")}

    bad = dict(fused)
    bad[f"base_model.model.model.layers.{layer}.mlp.experts.lora_A.weight"] = torch.zeros(r * e, 7)
    save_file(bad, os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match="fused experts.*gate_up_proj.*down_proj"):
        read_adapter(LoRARequest("f", 1, path), cfg, 8, torch.float32)
    both = dict(fused)
    both[f"base_model.model.model.layers.{layer}.mlp.experts.3.down_proj.lora_A.weight"] = torch.zeros(r, i)
    both[f"base_model.model.model.layers.{layer}.mlp.experts.3.down_proj.lora_B.weight"] = torch.zeros(
        cfg.hidden_size, r)
    save_file(both, os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match="expert 3's down_proj is adapted twice"):
        read_adapter(LoRARequest("f", 1, path), cfg, 8, torch.float32)


class _GraphStandIns:
    """CPU stand-ins for the decode and prompt CUDA graphs: a replay computes the forward over the padded rows /
    tokens as a captured graph does: the Linears' LoRA terms always, the experts' never (captures record no expert
    terms: LoRAManager.capturing)."""

    def __init__(self, runner):
        self.runner = runner
        self.replays = 0

    def for_batch(self, n):  # DecodeGraphs
        bs = 1 << (n - 1).bit_length()
        return _Pass(self, bs, None) if bs <= 8 else None

    def for_tokens(self, n):  # PromptGraphs
        t = max(16, 1 << (n - 1).bit_length())
        return _Pass(self, None, t) if t <= 64 else None


class _Pass:
    def __init__(self, owner, batch_size, num_tokens):
        self.owner, self.batch_size, self.num_tokens = owner, batch_size, num_tokens

    def replay(self, backend=None, meta=None):
        from voltllm.attention.backend import AttentionMetadata
        from voltllm.model.forward_context import ForwardContext

        r = self.owner.runner
        buf = r.buffers
        r.lora.batch.active, r.lora.batch.experts_active = True, False
        self.owner.replays += 1
        if self.batch_size is not None:
            bs = self.batch_size
            lens = buf.seq_lens[:bs].tolist()
            meta = AttentionMetadata(
                num_tokens=bs, query_start_loc=buf.query_start_loc[:bs + 1], seq_lens=buf.seq_lens[:bs],
                block_tables=buf.block_tables[:bs], slot_mapping=buf.slot_mapping[:bs], max_query_len=1,
                max_seq_len=max(lens), query_start_loc_cpu=list(range(bs + 1)), seq_lens_cpu=lens)
            return r.model(buf.input_ids[:bs], buf.positions[:bs], ForwardContext(meta, r.kv_caches, r.backend))
        t = self.num_tokens
        return r.model(buf.input_ids[:t], buf.positions[:t], ForwardContext(meta, r.kv_caches, backend))


def test_steps_with_expert_adapters_run_eagerly_and_the_others_replay_graphs(setup):
    """With graphs (CPU stand-ins that, as a capture, hold no expert terms), a step whose tokens use an adapter with
    expert weights runs eagerly (ModelRunner: LoRAManager.needs_eager), so its tokens keep their expert terms; steps
    of the base model and of an attention-only adapter still replay graphs."""
    llm = LLM(setup.model, **{**ENGINE, "max_loras": 3, "max_num_batched_tokens": 64, "max_num_seqs": 8})
    runner = llm.engine.runner
    runner.graphs = runner.prompt_graphs = stand_ins = _GraphStandIns(runner)
    setup.check(llm, [None, "a3", None], PROMPTS[:3])
    graphed = stand_ins.replays
    assert graphed >= 6  # (a prompt step and the decode steps)
    setup.check(llm, ["a1", None, "a2", "a3"], PROMPTS[:4])
    assert stand_ins.replays == graphed  # (every step held a1 or a2 tokens)


# -- a hybrid MoE (qwen3_5_moe): routed experts beside a shared expert --------------------------------------------
HYBRID_PROMPTS = [[5, 9, 33, 41, 7, 100, 3, 77, 12, 150, 8], [17, 18, 19], [3, 4] * 9, [60, 61, 2, 190, 44]]


def _hybrid_outputs(path, prompts, lora=None, **kw):
    kw = {"device": "cpu", "dtype": "float32", "enforce_eager": True, "max_model_len": 128, "max_num_seqs": 4,
          "block_size": 4, **kw}
    llm = LLM(path, **kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=lora, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


@pytest.mark.parametrize("tp", [1, 2])
def test_hybrid_moe_routed_and_shared_expert_adapters_equal_the_merged_checkpoint(tmp_path, tp):
    """qwen3_5_moe (every layer sparse, with a shared expert): an adapter on the routed experts, the shared expert
    and some attention / Gated DeltaNet projections, beside the base model in one batch, equals a plain engine on the
    merged checkpoint (at -tp 1; the adapted engine at -tp 1 and -tp 2)."""
    from tiny_models import HYBRID_VOCAB, make_tiny_hybrid, small_moe

    root = str(tmp_path)
    base = make_tiny_hybrid(f"{root}/h", "qwen3_5_moe", seed=0, gen_seed=1, **small_moe("qwen3_5_moe"))
    if base is None:
        pytest.skip("this transformers has no qwen3_5_moe")
    a1 = make_adapter(f"{root}/a1", base, rank=8, alpha=16, seed=1, std=0.25,
                      targets=("experts", "shared_expert", "q_proj", "in_proj_qkv"))
    names = ["a1", None, "a1", None]
    prompts = [[t % HYBRID_VOCAB for t in p] for p in HYBRID_PROMPTS]
    ours = _hybrid_outputs(base, prompts, [LoRARequest("a1", 1, a1) if n else None for n in names],
                           enable_lora=True, max_loras=2, max_lora_rank=8, tensor_parallel_size=tp)
    refs = {None: _hybrid_outputs(base, prompts),
            "a1": _hybrid_outputs(merged_copy(base, a1, f"{root}/merged"), prompts)}
    for i, n in enumerate(names):
        tokens, lps = ours[i]
        assert tokens == refs[n][i][0], (i, n)
        for d, r in zip(lps, refs[n][i][1]):
            assert d.keys() == r.keys() and all(d[t] == pytest.approx(r[t], abs=1e-4) for t in d)
    assert refs["a1"][0][0] != refs[None][0][0]


def test_pipeline_stages_hold_their_layers_expert_adapters(setup):
    """-pp 2 (gloo): each stage's expert slots hold the adapter's experts of its own layers (lora/stages.py), and
    every stage runs the steps of expert adapters eagerly alike; tokens and logprobs equal the merged model's."""
    two = LLM(setup.model, pipeline_parallel_size=2, **ENGINE)
    try:
        setup.check(two)
    finally:
        two.engine.shutdown()
