"""DFlash speculative decoding in the engine (CPU, tiny random qwen3 / llama targets and tiny random drafters in the
public checkpoint format): the drafter's block logits inside the engine equal a float64 reference of the drafter's
math fed by transformers' hidden states of the target; greedy outputs equal plain decoding's (chunked prefill,
prefix-cache hits, preemption, concurrent requests); a drafter that always agrees is always accepted and saves
steps; sampled requests run; bad drafters are refused at configuration time, against attention-only and hybrid
targets. (DFlash runs on hybrid targets: tests/model/test_hybrid_speculation.py.)"""
import json
import os

import pytest

from dflash_models import check_block_logits, make_dflash, record_block_logits, zero_lm_head
from graph_stand_ins import PaddedDecodeGraphs
from tiny_models import make_model
from voltllm import LLM, SamplingParams

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
           "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
           "0123456789 0123456789 0123",
           "Hi"]
K = 3


def _spec(path, k=K):
    return {"method": "dflash", "model": path, "num_speculative_tokens": k}


def _target_shape(path):
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    return c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def models(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    target = make_model(str(root / "target"), request.param)
    hidden, vocab, layers = _target_shape(target)
    # layers 0 and 2 of 3: a middle layer's residual stream and the last layer's (after the final norm) output
    return {"target": target, "layers": [0, layers - 1],
            "drafter": make_dflash(str(root / "dflash"), hidden, vocab, layers, [0, layers - 1], block_size=4)}


def _run(llm, prompts, sps):
    outs = llm.generate(prompts, sps)
    llm.engine.check_integrity()
    return [o.outputs[0].token_ids for o in outs]


_PLAIN: dict = {}


def _plain(target, prompts, sp, **kw):
    key = (target, tuple(prompts), repr(sp), tuple(sorted(kw.items())))
    if key not in _PLAIN:
        _PLAIN[key] = _run(LLM(target, **kw), prompts, sp)
    return _PLAIN[key]


def _runner(llm):
    return llm.engine.runner.draft


@pytest.mark.parametrize("graph_rows", [0, 8])
def test_block_logits_equal_the_reference(models, graph_rows):
    """Every proposal of a batched greedy run: the drafter's logits for each request's drafts against the float64
    reference, fed by transformers' hidden states of the target over the request's tokens before its block. With
    graph_rows, the block forward takes its graph form (rows padded to a power of two in the input buffers) up to
    that many rows, as CUDA graph replays would."""
    target, drafter_path = models["target"], models["drafter"]
    llm = LLM(target, block_size=4, max_num_batched_tokens=16, speculative_config=_spec(drafter_path))
    dr = _runner(llm)
    if graph_rows:
        dr.graphs = PaddedDecodeGraphs(dr, graph_rows)
    records = record_block_logits(dr)
    _run(llm, PROMPTS[:3], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert check_block_logits(records, target, drafter_path, models["layers"]) >= 6
    assert not graph_rows or dr.graphs.replays >= 3


@pytest.fixture(scope="module")
def sliding(models, tmp_path_factory):
    """A drafter whose first layer attends over a sliding window of 8 positions (Qwen3.6's drafters: 2,048), shorter
    than the prompts, so each block row's window starts inside its context."""
    hidden, vocab, layers = _target_shape(models["target"])
    return make_dflash(str(tmp_path_factory.mktemp("sliding") / "dflash"), hidden, vocab, layers, models["layers"],
                       block_size=4, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                       use_sliding_window=True)


# a cache small enough, for few enough requests, that the windowed layer's K / V go into rings (DrafterRings)
RINGS = dict(max_num_seqs=3, kv_cache_memory_bytes=2 << 20)


@pytest.mark.parametrize("rings", [False, True])
@pytest.mark.parametrize("graph_rows", [0, 8])
def test_sliding_window_block_logits_equal_the_reference(models, sliding, graph_rows, rings):
    """A drafter with a sliding-window layer: each block row at position p sees the context from p - 7 on and the
    whole block, eagerly and in the graph form, its K / V in the blocks or in rings; the same drafter read as full
    attention (its window ignored) does not match the windowed reference, so the window is what was checked."""
    from dflash_models import layer_windows

    target = models["target"]
    assert layer_windows(sliding) == [8, 0]
    llm = LLM(target, block_size=4, max_num_batched_tokens=16, speculative_config=_spec(sliding),
              **(RINGS if rings else {}))
    dr = _runner(llm)
    assert (dr.rings is not None) == rings
    assert [layer.self_attn.sliding_window for layer in dr.drafter.layers] == [8, 0]
    if graph_rows:
        dr.graphs = PaddedDecodeGraphs(dr, graph_rows)
    records = record_block_logits(dr)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    _run(llm, PROMPTS[:3], sp)
    assert check_block_logits(records, target, sliding, models["layers"]) >= 6
    assert not graph_rows or dr.graphs.replays >= 3
    if rings:  # (a ring holds only the window: the drafter cannot be read without it)
        return
    for layer in dr.drafter.layers:
        layer.self_attn.sliding_window = 0
    records = record_block_logits(dr)
    _run(llm, PROMPTS[:1], sp)
    with pytest.raises(AssertionError, match="relative error"):
        check_block_logits(records, target, sliding, models["layers"])


def test_sliding_window_drafter_keeps_greedy_outputs(models, sliding):
    target = models["target"]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    kw = dict(block_size=4, max_num_batched_tokens=5, max_num_seqs=4)
    llm = LLM(target, speculative_config=_spec(sliding), **kw)
    assert _run(llm, PROMPTS, sp) == _plain(target, PROMPTS, sp, **kw)
    assert llm.engine.stats().extra["spec_draft_tokens"] > 0


def test_sliding_window_layers_keep_rings_not_blocks(models, sliding):
    """The windowed layer's K / V live in per-request rings (window 8 + 3 drafts + 1 -> 3 blocks of 4 each, one ring
    per --max-num-seqs request) charged apart from the blocks; a block holds only the full layer's. Prefix-cache hits
    leave the window to be computed again, and with blocks for fewer requests than prompts, requests are preempted
    and rings reused: greedy outputs and the block logits still match, and no ring is left held."""
    import torch

    target = models["target"]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(block_size=4, max_num_seqs=3)
    llm = LLM(target, speculative_config=_spec(sliding), kv_cache_memory_bytes=2 << 20, **kw)
    dr = _runner(llm)
    rings = dr.rings
    assert (rings.blocks, rings.capacity, rings.num_rings) == (3, 12, 3)
    layer = 2 * 4 * dr.drafter.kv_heads * dr.drafter.head_dim * 4  # (fp32)
    assert dr.kv_block_bytes(4, torch.float32) == layer  # the full layer's alone
    assert dr.fixed_kv_bytes(4, torch.float32) == layer * 9
    assert [tuple(c.shape[:2]) for c in dr.kv_caches] == [(2, 9), (2, llm.engine.runner.num_blocks)]
    runner = llm.engine.runner
    # (the fixed size less the rings, in blocks of the target's and the full layer's bytes; at most what 3 requests
    # of --max-model-len 1024 use)
    assert runner.num_blocks == min(((2 << 20) - layer * 9) // runner.kv_block_bytes(), 3 * 256 + 1)
    assert llm.engine.kv.recompute_tail == 8
    prompts = [PROMPTS[0] + " and again", PROMPTS[0] + " once more", PROMPTS[1], PROMPTS[2]]
    ref = _plain(target, prompts, sp, **kw)
    assert _run(llm, prompts, sp) == ref
    records = record_block_logits(dr)
    hits = llm.engine.stats().prefix_cache_hits
    assert _run(llm, prompts, sp) == ref  # (the same prompts again: hits, cut back to leave the window)
    assert llm.engine.stats().prefix_cache_hits > hits
    assert check_block_logits(records, target, sliding, models["layers"]) >= 8
    llm.engine.step()  # (the last finished request's ring goes back with the next step, as its blocks' state does)
    assert rings.in_use == 0
    tight = LLM(target, speculative_config=_spec(sliding), num_gpu_blocks_override=24, max_num_batched_tokens=32,
                **kw)
    assert _run(tight, PROMPTS, sp) == _plain(target, PROMPTS, sp, **kw)
    tight.engine.step()
    assert tight.engine.stats().num_preemptions > 0 and _runner(tight).rings.in_use == 0


def test_a_hit_leaves_the_window_to_compute(models, sliding):
    """recompute_tail: a cached prompt of 40 tokens (10 blocks of 4) hits at most 40 - 8 tokens -> 8 blocks."""
    target = models["target"]
    llm = LLM(target, block_size=4, speculative_config=_spec(sliding), **RINGS)
    assert _runner(llm).rings is not None
    ids = list(range(5, 45))
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate({"prompt_token_ids": ids}, sp)
    before = llm.engine.stats().prefix_cache_hits
    llm.generate({"prompt_token_ids": ids}, sp)
    assert llm.engine.stats().prefix_cache_hits - before == 32
    full = LLM(target, block_size=4, speculative_config=_spec(models["drafter"]))  # (no rings: all but one token)
    full.generate({"prompt_token_ids": ids}, sp)
    before = full.engine.stats().prefix_cache_hits
    full.generate({"prompt_token_ids": ids}, sp)
    assert full.engine.stats().prefix_cache_hits - before == 36


def test_rings_only_where_they_hold_more(models, sliding):
    """Rings cost --max-num-seqs x C positions whatever the contexts: for 256 requests in 2 MiB the windowed layer's
    K / V stay in the blocks (more of them: 409 of 5,120 bytes against 2 MiB less 256 rings in blocks of 4,096), a
    hit needs no recomputed window, and outputs stay plain decoding's; for 3 requests the rings hold more."""
    target = models["target"]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(block_size=4, kv_cache_memory_bytes=2 << 20)
    many = LLM(target, max_num_seqs=256, speculative_config=_spec(sliding), **kw)
    dr, runner = _runner(many), many.engine.runner
    assert dr.rings is None and many.engine.kv.recompute_tail == 1
    assert [tuple(c.shape[:2]) for c in dr.kv_caches] == [(2, runner.num_blocks)] * 2
    assert runner.num_blocks == (2 << 20) // runner.kv_block_bytes() == 409
    assert _run(many, PROMPTS, sp) == _plain(target, PROMPTS, sp, max_num_seqs=256, **kw)
    few = LLM(target, max_num_seqs=3, speculative_config=_spec(sliding), **kw)
    assert _runner(few).rings is not None and few.engine.runner.num_blocks == 509


@pytest.mark.parametrize("budget", [64, 5])
def test_greedy_outputs_equal_plain_decoding(models, budget):
    """Four concurrent requests, the token budget large or small (prompts in chunks of 5; drafts cut by it)."""
    target = models["target"]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    kw = dict(block_size=4, max_num_batched_tokens=budget, max_num_seqs=4)
    llm = LLM(target, speculative_config=_spec(models["drafter"]), **kw)
    assert _run(llm, PROMPTS, sp) == _plain(target, PROMPTS, sp, **kw)
    assert llm.engine.stats().extra["spec_draft_tokens"] > 0


def test_prefix_cache_hits_and_preemption_keep_outputs(models):
    target = models["target"]
    prompts = [PROMPTS[0] + " and again", PROMPTS[0] + " once more", PROMPTS[1]]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(target, block_size=4, speculative_config=_spec(models["drafter"]))
    ref = _plain(target, prompts, sp, block_size=4)
    assert _run(llm, prompts, sp) == ref
    hits = llm.engine.stats().prefix_cache_hits
    assert _run(llm, prompts, sp) == ref
    assert llm.engine.stats().prefix_cache_hits > hits
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    tight = LLM(target, block_size=4, max_num_batched_tokens=32, num_gpu_blocks_override=24,
                speculative_config=_spec(models["drafter"]))
    assert _run(tight, PROMPTS, sp) == _plain(target, PROMPTS, sp, block_size=4)
    assert tight.engine.stats().num_preemptions > 0


@pytest.mark.parametrize("calculate", [False, True])
def test_fp8_kv_cache_holds_the_drafter_too(models, calculate):
    """--kv-cache-dtype fp8_e4m3: the drafter's caches are fp8 as the target's (a block's bytes count them at one
    byte per element); the block logits move off the reference by the fp8 rounding of the context (not within 1e-4,
    within 5%); greedy outputs equal plain decoding with the same cache; --calculate-kv-scales sets the drafter's
    scales from the first step's context."""
    import torch

    target, drafter_path = models["target"], models["drafter"]
    kw = dict(block_size=4, max_num_batched_tokens=16, kv_cache_dtype="fp8_e4m3", calculate_kv_scales=calculate)
    llm = LLM(target, speculative_config=_spec(drafter_path), **kw)
    dr = _runner(llm)
    assert dr.kv_caches and all(c.dtype == torch.uint8 for c in dr.kv_caches)
    per_block = 2 * 4 * dr.drafter.kv_heads * dr.drafter.head_dim * len(dr.drafter.layers)
    assert dr.kv_block_bytes(4, torch.uint8) == per_block
    full = LLM(target, speculative_config=_spec(drafter_path), block_size=4, max_num_batched_tokens=16)
    assert llm.engine.runner.kv_block_bytes() * 4 == full.engine.runner.kv_block_bytes()  # fp32 model: 4 bytes
    records = record_block_logits(dr)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert _run(llm, PROMPTS[:3], sp) == _plain(target, PROMPTS[:3], sp, **kw)
    scales = [(a.k_scale.item(), a.v_scale.item()) for a in (layer.self_attn for layer in dr.drafter.layers)]
    assert all(k != 1.0 and v != 1.0 for k, v in scales) if calculate else scales == [(1.0, 1.0)] * len(scales)
    with pytest.raises(AssertionError, match="relative error"):
        check_block_logits(records, target, drafter_path, models["layers"])
    assert check_block_logits(records, target, drafter_path, models["layers"], tol=0.25) >= 6


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory):
    """A qwen3 target whose LM head is zero (every logit 0: greedy picks id 0, sampling is uniform) and a drafter
    sharing that head: it always agrees with the target (greedy: the same argmax; sampled: q = p)."""
    root = tmp_path_factory.mktemp("agree")
    target = make_model(str(root / "target"), "qwen3")
    zero_lm_head(target)
    hidden, vocab, layers = _target_shape(target)
    return target, make_dflash(str(root / "dflash"), hidden, vocab, layers, [1], block_size=6, new_style=False)


@pytest.mark.parametrize("k", [2, 5])
def test_agreeing_drafter_is_always_accepted(agreeing, k):
    target, drafter = agreeing
    n = 41
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm = LLM(target, block_size=4, speculative_config=_spec(drafter, k))
    steps0 = llm.engine.stats().step_counter
    assert _run(llm, PROMPTS[2:3], sp) == _plain(target, PROMPTS[2:3], sp, block_size=4)
    stats = llm.engine.stats()
    rounds = -(-(n - 1) // (k + 1))  # each emits its drafts + 1 (the last one's drafts cut by max_tokens)
    assert stats.extra["spec_accepted_tokens"] == stats.extra["spec_draft_tokens"] == n - 1 - rounds
    assert stats.step_counter - steps0 == 1 + rounds


def test_sampled_requests_speculate(agreeing, models):
    """Seeded sampled requests: q = p for the agreeing drafter (every draft accepted); with the random drafter they
    run and repeat from run to run."""
    target, drafter = agreeing
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True, seed=7)
    llm = LLM(target, block_size=4, speculative_config=_spec(drafter))
    _run(llm, PROMPTS[:2], sp)
    extra = llm.engine.stats().extra
    assert extra["spec_accepted_tokens"] == extra["spec_draft_tokens"] > 0
    llm = LLM(models["target"], block_size=4, speculative_config=_spec(models["drafter"]))
    sp = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True, seed=3)
    assert _run(llm, PROMPTS[:2], sp) == _run(llm, PROMPTS[:2], sp)


def _config_error(target, spec):
    from voltllm.config import ConfigError, EngineArgs

    with pytest.raises(ConfigError) as e:
        EngineArgs(model=target, speculative_config=json.dumps(spec)).create_engine_config()
    return str(e.value)


def test_bad_drafters_are_refused(models, tmp_path):
    target = models["target"]
    hidden, vocab, layers = _target_shape(target)

    def drafter(name, **kw):
        args = dict(hidden=hidden, vocab=vocab, target_layers=layers, layer_ids=[0, 1])
        args.update(kw)
        return make_dflash(str(tmp_path / name), **args)

    assert "exceeds block_size - 1" in _config_error(target, _spec(models["drafter"], k=4))
    assert "mask_token_id" in _config_error(target, _spec(drafter("nomask", mask_token_id=None)))
    assert "not a token id" in _config_error(target, _spec(drafter("bigmask", mask_token_id=vocab)))
    assert "target_layer_ids" in _config_error(target, _spec(drafter("ids", layer_ids=[0, layers])))
    assert "hidden size" in _config_error(target, _spec(drafter("hidden", hidden=hidden * 2)))
    assert "vocabulary" in _config_error(target, _spec(drafter("vocab", vocab=vocab + 1)))
    assert "made for a target of" in _config_error(target, _spec(drafter("layers", target_layers=layers + 1)))
    # (a DFlash2 architecture without its convolution and selector keys; DFlash2 itself: test_dflash2_speculation.py)
    assert "DFlash2 needs a positive integer conv_kernel_size" in _config_error(
        target, _spec(drafter("v2", architectures=["DFlash2DraftModel"])))
    assert "neither" in _config_error(target, _spec(drafter("eagle", architectures=["EagleDraftModel"])))
    assert "only full_attention and sliding_attention" in _config_error(target, _spec(drafter(
        "chunked", layer_types=["chunked_attention", "full_attention"])))
    assert "shorter than block_size" in _config_error(target, _spec(drafter(
        "narrow", layer_types=["sliding_attention", "full_attention"], sliding_window=3, use_sliding_window=True)))
    assert "cannot load" in _config_error(target, _spec(str(tmp_path / "missing")))


def test_hybrid_targets_are_checked(tmp_path):
    """A hybrid target is taken (its runs: tests/model/test_hybrid_speculation.py); the drafter is checked against
    its text config: layer ids, hidden size, vocabulary, the layer count it was made for; a multimodal checkpoint's
    config (text_config inside) is read the same way."""
    from transformers import AutoConfig, Qwen3_5Config

    from tiny_models import HYBRID_COMMON, HYBRID_VOCAB, make_tiny_hybrid
    from voltllm.config import EngineArgs
    from voltllm.engine.dflash import dflash_params
    from voltllm.engine.speculative import SpeculativeConfigError

    hybrid = make_tiny_hybrid(str(tmp_path / "hybrid"), "qwen3_5", 0, 0)
    if hybrid is None:
        pytest.skip("this transformers lacks qwen3_5")
    hidden, layers = HYBRID_COMMON["hidden_size"], HYBRID_COMMON["num_hidden_layers"]

    def drafter(name, **kw):
        args = dict(hidden=hidden, vocab=HYBRID_VOCAB, target_layers=layers, layer_ids=[1, layers - 1])
        args.update(kw)
        return make_dflash(str(tmp_path / name), **args)

    ok = drafter("ok")
    spec = EngineArgs(model=hybrid, skip_tokenizer_init=True,
                      speculative_config=json.dumps(_spec(ok))).create_engine_config().speculative
    assert spec.uses_dflash and spec.num_speculative_tokens == K
    assert "target_layer_ids" in _config_error(hybrid, _spec(drafter("ids", layer_ids=[0, layers])))
    assert "hidden size" in _config_error(hybrid, _spec(drafter("hidden", hidden=hidden * 2)))
    assert "vocabulary" in _config_error(hybrid, _spec(drafter("vocab", vocab=HYBRID_VOCAB + 1)))
    assert "made for a target of" in _config_error(hybrid, _spec(drafter("layers", target_layers=layers + 1)))
    wrapped = Qwen3_5Config(text_config=dict(HYBRID_COMMON))
    assert dflash_params(AutoConfig.from_pretrained(ok), wrapped, K).target_layer_ids == (1, layers - 1)
    with pytest.raises(SpeculativeConfigError, match="made for a target of"):
        dflash_params(AutoConfig.from_pretrained(tmp_path / "layers"), wrapped, K)


def test_default_layer_ids_and_checkpoint_layouts():
    from voltllm.engine.dflash import default_target_layer_ids

    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B's public drafter reads these
    assert default_target_layer_ids(36, 1) == [18]
