"""Pipeline parallelism on the CPU (gloo): tiny fp32 models with -pp 2 / 3 against the same models on one rank,
through the offline LLM API (rank 0 in this process, the later stages spawned workers), and what it refuses."""
import pytest
import torch

from parallel_checks import ENGINE, PROMPTS, assert_logits_match
from tiny_models import make_model, make_tiny_hybrid
from voltllm import LLM, SamplingParams
from voltllm.config import ConfigError, EngineArgs
from voltllm.distributed.pipeline import stage_layers
GREEDY = SamplingParams(temperature=0, max_tokens=20, min_tokens=20)


def test_stage_layers_split():
    assert stage_layers(4, 2) == [(0, 2), (2, 4)]
    assert stage_layers(3, 2) == [(0, 1), (1, 3)]  # the extra layer away from rank 0 (it holds the embeddings, head)
    assert stage_layers(10, 4) == [(0, 2), (2, 4), (4, 7), (7, 10)]
    assert stage_layers(3, 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="more than the model's 3 decoder layers"):
        stage_layers(3, 4)


@pytest.fixture(scope="module", params=["qwen3-untied", "llama-tied"])
def engines(request, tmp_path_factory):
    kind, overrides = {"qwen3-untied": ("qwen3", {}), "llama-tied": ("llama", dict(num_hidden_layers=4))}[request.param]
    path = make_model(str(tmp_path_factory.mktemp(request.param)), kind, **overrides)
    one = LLM(path, **ENGINE)
    two = LLM(path, pipeline_parallel_size=2, **ENGINE)
    yield one, two
    two.engine.shutdown()


def test_logits_match_one_rank(engines):
    """Full distributions at every prompt position (prompt logprobs over the whole vocabulary), batched."""
    assert_logits_match(*engines)


def test_greedy_and_sampling_match_one_rank_chunked_and_cached(engines):
    one, two = engines
    expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY)]
    assert [o.outputs[0].token_ids for o in two.generate(PROMPTS, GREEDY)] == expected
    hits = two.engine.stats().prefix_cache_hits
    assert [o.outputs[0].token_ids for o in two.generate(PROMPTS, GREEDY)] == expected  # every stage's cache hit
    assert two.engine.stats().prefix_cache_hits > hits
    seeded = [SamplingParams(temperature=0.8, seed=5 + i, max_tokens=12, logprobs=2) for i in range(len(PROMPTS))]
    a, b = one.generate(PROMPTS, seeded), two.generate(PROMPTS, seeded)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    two.engine.check_integrity()


def test_each_stage_holds_its_layers(engines):
    one, two = engines
    n = len(one.engine.runner.model.layers)
    rank0 = two.engine.runner
    start, end = stage_layers(n, 2)[0]
    assert (rank0.pp.start, rank0.pp.end) == (start, end)
    assert len(rank0.model.layers) == end - start < n
    assert len(rank0.kv_caches) == end - start  # KV cache for its own attention layers only
    assert len(two.engine.tp_workers.procs) == 1


def test_three_stages_uneven(tmp_path):
    """4 layers over 3 ranks (1 / 1 / 2 layers): the hidden states go 0 -> 1 -> 2 -> 0."""
    path = make_model(str(tmp_path), "qwen2", num_hidden_layers=4, tie_word_embeddings=False)
    expected = [o.outputs[0].token_ids for o in LLM(path, **ENGINE).generate(PROMPTS, GREEDY)]
    three = LLM(path, pipeline_parallel_size=3, **ENGINE)
    try:
        assert len(three.engine.tp_workers.procs) == 2
        assert [o.outputs[0].token_ids for o in three.generate(PROMPTS, GREEDY)] == expected
    finally:
        three.engine.shutdown()


def test_moe_model(tmp_path):
    path = make_model(str(tmp_path), "qwen3_moe", num_hidden_layers=4)
    expected = [o.outputs[0].token_ids for o in LLM(path, **ENGINE).generate(PROMPTS, GREEDY)]
    two = LLM(path, pipeline_parallel_size=2, **ENGINE)
    try:
        assert [o.outputs[0].token_ids for o in two.generate(PROMPTS, GREEDY)] == expected
    finally:
        two.engine.shutdown()


def test_hybrid_gdn_model(tmp_path):
    """A qwen3_5 hybrid of 8 layers (attention every 4th): each stage its Gated DeltaNet states and KV cache, with
    prefix-cache hits resumed from each stage's own state snapshots."""
    path = make_tiny_hybrid(str(tmp_path), "qwen3_5", seed=0, gen_seed=1, num_hidden_layers=8)
    if path is None:
        pytest.skip("this transformers has no Qwen3_5TextConfig")
    kw = dict(block_size=4, mamba_block_size=8, max_num_batched_tokens=9, max_num_seqs=4, skip_tokenizer_init=True)
    prompts = [[(7 * i + 3) % 190 for i in range(n)] for n in (19, 5, 26)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(path, **kw).generate(
        [{"prompt_token_ids": p} for p in prompts], params)]
    two = LLM(path, pipeline_parallel_size=2, **kw)
    try:
        for _ in range(2):  # the second time from prefix-cache hits
            out = two.generate([{"prompt_token_ids": p} for p in prompts], params)
            assert [o.outputs[0].token_ids for o in out] == expected
        assert two.engine.runner.state_snapshots.num_restored > 0
        assert two.engine.runner.state_cache is not None
    finally:
        two.engine.shutdown()


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_stages_of_two_tensor_parallel_ranks(tmp_path, kind):
    """-tp 2 -pp 2: four ranks, each stage's layers split over its two ranks (a subgroup of their own); rank r of a
    stage hands its hidden states to rank r of the next; stage 0's ranks gather the vocabulary-parallel logits."""
    if kind == "llama":  # tied head, a vocabulary that does not divide by 2
        path = make_model(str(tmp_path), "llama", num_hidden_layers=4, vocab_size=401)
    else:
        path = make_tiny_hybrid(str(tmp_path), "qwen3_5", seed=0, gen_seed=1, num_hidden_layers=8)
        if path is None:
            pytest.skip("this transformers has no Qwen3_5TextConfig")
    kw = dict(block_size=4, mamba_block_size=8, max_num_batched_tokens=9, max_num_seqs=4, skip_tokenizer_init=True)
    prompts = [{"prompt_token_ids": [(7 * i + 3) % 190 for i in range(n)]} for n in (19, 5, 26)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    want = LLM(path, **kw).generate(prompts, params)
    four = LLM(path, tensor_parallel_size=2, pipeline_parallel_size=2, **kw)
    try:
        runner = four.engine.runner
        assert len(four.engine.tp_workers.procs) == 3 and runner.tp.size == 2 and runner.pp.size == 2
        for _ in range(2):  # the second time from prefix-cache hits
            got = four.generate(prompts, params)
            assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
            for a, b in zip(got, want):
                for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                    assert all(abs(x[t].logprob - y[t].logprob) < 2e-5 for t in y)
    finally:
        four.engine.shutdown()


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_ngram_speculation_matches_plain(tmp_path, monkeypatch, kind):
    """n-gram drafts (an oracle's: right and wrong ones) verified by rank 0 from the last stage's rows; on the hybrid
    every stage keeps the accepted rows of its own Gated DeltaNet states (rank 0's counts, a broadcast)."""
    from spec_oracle import oracle_table, patch_ngram, run_checked

    if kind == "qwen3":
        path, vocab = make_model(str(tmp_path), "qwen3", num_hidden_layers=4), 400
    else:
        path, vocab = make_tiny_hybrid(str(tmp_path), "qwen3_5", seed=0, gen_seed=1, num_hidden_layers=8), 192
        if path is None:
            pytest.skip("this transformers has no Qwen3_5TextConfig")
    kw = dict(block_size=4, mamba_block_size=8, max_num_batched_tokens=9, max_num_seqs=4, skip_tokenizer_init=True)
    prompts = [[(7 * i + 3) % 190 for i in range(n)] for n in (19, 5, 26)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = run_checked(LLM(path, **kw), prompts, params)
    patch_ngram(monkeypatch, oracle_table(prompts, plain), vocab)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    two = LLM(path, pipeline_parallel_size=2, speculative_config=ngram, **kw)
    try:
        assert run_checked(two, prompts, params) == plain
        stats = two.engine.stats().extra
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
        assert run_checked(two, prompts, params) == plain  # again, from prefix-cache hits
    finally:
        two.engine.shutdown()


@pytest.mark.parametrize("extra, message", [
    (dict(pipeline_parallel_size=0), "--pipeline-parallel-size must be >= 1"),
    (dict(pipeline_parallel_size=4), "only 3 decoder layers"),
    (dict(pipeline_parallel_size=2, cpu_offload_gb=1), "with weight offloading"),
    (dict(pipeline_parallel_size=2, offload_group_size=2, offload_prefetch_step=1), "with weight offloading"),
])
def test_refused_combinations(tmp_path, extra, message):
    path = make_model(str(tmp_path), "qwen3")
    with pytest.raises(ConfigError, match=message):
        EngineArgs(model=path, device="cpu", **extra).create_engine_config()


def test_hybrid_stage_without_attention_refused(tmp_path):
    path = make_tiny_hybrid(str(tmp_path), "qwen3_5", seed=0, gen_seed=1)  # 4 layers: attention at layer 3 alone
    if path is None:
        pytest.skip("this transformers has no Qwen3_5TextConfig")
    with pytest.raises(ConfigError, match="stage 0 .* no full-attention layer"):
        EngineArgs(model=path, device="cpu", pipeline_parallel_size=2,
                   skip_tokenizer_init=True).create_engine_config()


def test_images_qwen2_5_vl_match_transformers(tmp_path):
    """Rank 0 runs the vision tower and swaps its rows in; the later stage's attention layers read the M-RoPE scratch
    rotary rows, which it writes from the step's StepInputs (it gets no image rows)."""
    pytest.importorskip("PIL")
    from vl_models import cpu_llm, run_greedy, same_greedy, vl_image, vl_prompt, vl_reference, vl_setup

    vl = vl_setup(str(tmp_path / "vl"), "qwen2_5_vl")
    ids, out, mm = vl_prompt(vl, ["Compare", None, "with", None, "please."], [vl_image(1, 32, 48), vl_image(2, 40, 24)])
    llm = cpu_llm(vl[0], pipeline_parallel_size=2, max_num_batched_tokens=16, enable_chunked_prefill=True)
    try:
        assert llm.engine.runner.image_step is not None and len(llm.engine.runner.model.layers) == 1
        assert same_greedy(run_greedy(llm, [(ids, mm)])[0], vl_reference(vl, ids, out))
    finally:
        llm.engine.shutdown()


def test_deepstack_layers_must_be_on_rank_0(tmp_path):
    pytest.importorskip("PIL")
    from vl_models import make_tiny_qwen3_vl

    path = make_tiny_qwen3_vl(str(tmp_path), "qwen3_vl")  # 3 text layers, deepstack rows after layers 0 and 1
    with pytest.raises(ConfigError, match="rank 0's 1 layers are fewer than the 2 layers"):
        EngineArgs(model=path, device="cpu", pipeline_parallel_size=2).create_engine_config()


def test_a_stage_reads_only_its_layers(tmp_path):
    """The loader never reads another stage's decoder layers (safetensors: names filtered before reading)."""
    from voltllm.model.loader import iter_weights, load_hf_config, resolve_model

    source = resolve_model(make_model(str(tmp_path), "qwen3", num_hidden_layers=4))
    names = [n for n, _ in iter_weights(source, load_hf_config(source), layers=lambda i: i in (1, 2))]
    layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
    assert layers == {1, 2}
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names and "model.norm.weight" in names


def test_a_gguf_stage_reads_only_its_blocks(tmp_path, smollm2_gguf):
    """A tiny GGUF of llama.cpp's low-bit kinds (2 blocks): a stage's loader never dequantizes the other's block."""
    from gguf_files import LOW_BIT_CASES, write_low_bit_gguf
    from voltllm.model.loader.gguf_loader import gguf_weights

    out = str(tmp_path / "tiny.gguf")
    write_low_bit_gguf(out, next(iter(LOW_BIT_CASES)), smollm2_gguf)
    names = [n for n, _ in gguf_weights(out, layers=lambda i: i == 1)]
    assert {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")} == {1}
    assert "model.embed_tokens.weight" in names


def test_kv_scales_calculated_on_the_stages_that_lack_them(tmp_path):
    """--calculate-kv-scales with checkpoint scales for rank 0's layers only: the later stage still calculates its
    own on the first forward (the step's flag is every stage's need, not rank 0's)."""
    from safetensors.torch import load_file, save_file

    path = make_model(str(tmp_path), "qwen3", num_hidden_layers=4)
    f = f"{path}/model.safetensors"
    weights = load_file(f)
    for i in (0, 1):  # (as a checkpoint calibrated on some layers)
        weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.02)
        weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.04)
    save_file(weights, f, metadata={"format": "pt"})
    kw = dict(ENGINE, kv_cache_dtype="fp8", calculate_kv_scales=True)
    expected = [o.outputs[0].token_ids for o in LLM(path, **kw).generate(PROMPTS, GREEDY)]
    two = LLM(path, pipeline_parallel_size=2, **kw)
    try:
        assert two.engine.runner.calc_kv_scales_pending  # (rank 0's own layers have theirs)
        assert [o.outputs[0].token_ids for o in two.generate(PROMPTS, GREEDY)] == expected
    finally:
        two.engine.shutdown()
