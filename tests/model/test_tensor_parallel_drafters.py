"""MTP and DFlash speculation under tensor parallelism (CPU, gloo, -tp 2). The MTP module and the DFlash drafter are
split over the ranks as the target's layers are, and every rank runs them with the target's vocabulary-parallel
embedding and LM head (worker/mtp_runner.py: rank 0 sends each proposal's inputs and broadcasts the drafts and the
kept rows; worker/dflash_runner.py: rank 0 sends each block's rows, and each step's context ring slots ride the step);
untied heads and, with the llama target, a tied one; DFlash also beside a qwen3_5 hybrid target, reading a Gated
DeltaNet layer's output. The
draft logits equal the float64 references of the drafters' math fed by transformers' hidden states of the target
(tests/mtp_models.py, tests/dflash_models.py), through chunked prompts beside verifications; greedy outputs equal
plain decoding's on one device."""
import json
import random

import pytest
import torch

from dflash_models import KV_HEADS, V2, check_block_drafts, check_block_logits, make_dflash, record_block_logits
from mtp_models import (MTPReference, check_against_reference, make_mtp_target, record_draft_logits,
                        record_drafts_given)
from spec_oracle import PlainRuns, oracle_table, patch_dflash, run_checked
from tiny_models import HYBRID_COMMON, HYBRID_VOCAB, make_model, make_tiny_hybrid, small_moe
from voltllm import LLM, SamplingParams

_rng = random.Random(3)
PROMPTS = [[_rng.randrange(HYBRID_VOCAB) for _ in range(11)], [_rng.randrange(HYBRID_VOCAB) for _ in range(23)],
           [7, 8]]
BASE = dict(block_size=4, max_num_seqs=4, skip_tokenizer_init=True, dtype="float32")
K = 3


# dense MLP; sparse MoE (with a shared expert), its experts' rows split or whole experts per rank
@pytest.mark.parametrize("kind,ep", [("qwen3_5", False), ("qwen3_next", False), ("qwen3_next", True)])
def test_mtp_under_tp_drafts_equal_reference(tmp_path_factory, monkeypatch, kind, ep):
    made = make_mtp_target(tmp_path_factory, kind, model=small_moe(kind))
    if made is None:
        pytest.skip(f"this transformers has no {kind}")
    path, mtp = made
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seen = record_draft_logits(monkeypatch)  # (rank 0 runs in this process: the MTP is there)
    llm = LLM(path, tensor_parallel_size=2, speculative_config={"method": "mtp", "num_speculative_tokens": K},
              max_num_batched_tokens=6, enable_expert_parallel=ep, **BASE)
    try:
        _check_split(llm)
        outs = run_checked(llm, PROMPTS, sp)
        stats = llm.engine.stats().extra
        _check_same_outs(llm)
    finally:
        llm.engine.shutdown()
    assert outs == PlainRuns(BASE)(path, PROMPTS, sp)
    assert stats["spec_draft_tokens"] > 0
    fulls = {tuple(p): list(p) + list(o) for p, o in zip(PROMPTS, outs)}
    assert check_against_reference(MTPReference(path, mtp), seen, fulls, K) >= 3 * len(PROMPTS)
    assert any(len(lg) == K for _, _, lg, _ in seen)


def test_mtp_under_tp_sampled_drafts(tmp_path_factory, monkeypatch):
    """Seeded sampled requests: rank 0 draws each draft from the module's q and broadcasts it, the other rank feeds it
    to its next pass. Every pass's logits equal the reference fed the drafts drawn (a rank fed other drafts would
    add wrong partial sums), both ranks' kept outputs are equal, drafts are accepted, and a second engine gives the
    same tokens."""
    made = make_mtp_target(tmp_path_factory, "qwen3_5")
    if made is None:
        pytest.skip("this transformers has no qwen3_5")
    path, mtp = made
    sps = [SamplingParams(temperature=0.8, top_p=0.95, seed=11 + i, max_tokens=12, ignore_eos=True)
           for i in range(len(PROMPTS))]
    runs = []
    for run in range(2):
        if run == 0:
            seen = record_draft_logits(monkeypatch)
            given = record_drafts_given(monkeypatch)
        llm = LLM(path, tensor_parallel_size=2, speculative_config={"method": "mtp", "num_speculative_tokens": K},
                  max_num_batched_tokens=6, **BASE)
        try:
            _check_split(llm)
            runs.append(run_checked(llm, PROMPTS, sps))
            stats = llm.engine.stats().extra
            _check_same_outs(llm)
        finally:
            llm.engine.shutdown()
        assert stats["spec_accepted_tokens"] > 0
        if run == 0:
            monkeypatch.undo()
            fulls = {tuple(p): list(p) + list(o) for p, o in zip(PROMPTS, runs[0])}
            assert any(len(lg) == K for _, _, lg, _ in seen)
            assert check_against_reference(MTPReference(path, mtp), seen, fulls, K, drawn=given) >= 3 * len(PROMPTS)
    assert runs[0] == runs[1]


def _check_split(llm, heads=None):
    """No whole vocabulary copies on rank 0, and each rank holds half of the drafter's KV heads (the target's KV head
    count unless given: a DFlash drafter's own config's)."""
    heads = heads if heads is not None else llm.engine.runner.model.config.num_key_value_heads
    assert llm.engine.runner.full_vocab is None
    assert [_drafter_split(llm.engine.runner)] + llm.engine.tp_workers.call_on_workers(_drafter_split) == [
        (heads // 2, True)] * 2


def _check_same_outs(llm):
    """Every rank's module kept the same outputs (rank 0 broadcast the rows; the module's all-reduces agree)."""
    kept = llm.engine.tp_workers.call_on_workers(_mtp_outs)
    assert kept and all(torch.equal(_mtp_outs(llm.engine.runner), o) for o in kept)


def _drafter_split(runner):
    """This rank's drafter: its KV heads, and whether it runs split (a group, no whole vocabulary copies)."""
    return runner.draft.model.kv_heads_and_dim[0], runner.draft.group is not None and runner.full_vocab is None


def _dflash_rings(runner):
    return runner.draft.rings is not None


def _mtp_outs(runner):
    return runner.draft.outs.cpu()


# untied LM head; tied; a DFlash2 drafter (its selector over rank 0's whole LM head's logits); a drafter with a
# sliding-window layer whose K / V live in rings on rank 0 (few requests in a small cache: DrafterRings)
@pytest.mark.parametrize("kind,v2,rings", [("qwen3", False, False), ("llama", False, False), ("qwen3", True, False),
                                           ("qwen3", False, True)])
def test_dflash_under_tp_block_logits_equal_reference(tmp_path_factory, kind, v2, rings):
    root = tmp_path_factory.mktemp(f"dflash-tp-{kind}")
    target = make_model(str(root / "target"), kind)
    with open(f"{target}/config.json") as f:
        cfg = json.load(f)
    layers = [0, cfg["num_hidden_layers"] - 1]
    window = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                  use_sliding_window=True) if rings else {}
    drafter = make_dflash(str(root / "dflash"), cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"],
                          layers, block_size=4, v2=V2 if v2 else None, **window)
    prompts = ["The quick brown fox jumps over the lazy dog. The quick brown fox", "0123456789 0123456789 0123"]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(block_size=4, max_num_batched_tokens=16) | (dict(max_num_seqs=2, kv_cache_memory_bytes=1 << 20)
                                                           if rings else {})
    llm = LLM(target, tensor_parallel_size=2, speculative_config={"method": "dflash", "model": drafter,
                                                                  "num_speculative_tokens": 3}, **kw)
    try:
        _check_split(llm, KV_HEADS)
        assert [_dflash_rings(llm.engine.runner)] + llm.engine.tp_workers.call_on_workers(_dflash_rings) == [rings] * 2
        records = record_block_logits(llm.engine.runner.draft)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        llm.engine.check_integrity()
        stats = llm.engine.stats().extra
    finally:
        llm.engine.shutdown()
    assert outs == [o.outputs[0].token_ids for o in LLM(target, **kw).generate(prompts, sp)]
    assert stats["spec_draft_tokens"] > 0
    assert check_block_logits(records, target, drafter, layers) >= 4
    if v2:
        assert check_block_drafts(records, target, drafter, layers, V2["selector_top_k"])[0] >= 8


def test_dflash_under_tp_on_a_hybrid(tmp_path_factory, monkeypatch):
    """A DFlash drafter reading a GDN layer's and the last layer's outputs of a qwen3_5 target split over two ranks
    (whole on rank 0 after each layer's all-reduce); oracle drafts (tests/spec_oracle.py), partly accepted, so the
    drafter's context also comes from verified positions; chunked prompts beside verifications."""
    target = make_tiny_hybrid(str(tmp_path_factory.mktemp("tp-hybrid")), "qwen3_5", seed=0, gen_seed=1)
    if target is None:
        pytest.skip("this transformers has no Qwen3_5TextConfig")
    layers = [1, 3]
    drafter = make_dflash(str(tmp_path_factory.mktemp("tp-hybrid-dflash")), HYBRID_COMMON["hidden_size"],
                          HYBRID_VOCAB, HYBRID_COMMON["num_hidden_layers"], layers, block_size=5)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(block_size=4, max_num_seqs=4, skip_tokenizer_init=True, max_num_batched_tokens=7)
    ref = PlainRuns(kw)(target, PROMPTS, sp)
    table: dict = {}
    patch_dflash(monkeypatch, table, HYBRID_VOCAB)
    table.update(oracle_table(PROMPTS, ref))
    llm = LLM(target, tensor_parallel_size=2, speculative_config={"method": "dflash", "model": drafter,
                                                                  "num_speculative_tokens": 3}, **kw)
    try:
        _check_split(llm, KV_HEADS)
        records = record_block_logits(llm.engine.runner.draft)
        outs = run_checked(llm, PROMPTS, sp)
        stats = llm.engine.stats().extra
    finally:
        llm.engine.shutdown()
    assert outs == ref
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert check_block_logits(records, target, drafter, layers) >= 2 * len(PROMPTS)


def _whole_tensors(runner):
    """The tensors every rank of a split drafter holds whole (fc; DFlash2's selector), on the host."""
    d = runner.draft
    mod = d.drafter if hasattr(d, "drafter") else d.model
    named = dict(mod.named_parameters())
    return {n: p.detach().cpu() for n, p in named.items() if n.startswith(("fc.", "selector."))}


def test_split_drafters_with_dummy_weights(tmp_path_factory):
    """--load-format dummy under -tp 2: the tensors each rank holds whole are drawn alike on both ranks (each from its
    own seed, whatever the split ones' shapes), so the ranks run one drafter; the engine drafts and checks out."""
    mtp_path, _ = make_mtp_target(tmp_path_factory, "qwen3_5") or (None, None)
    root = tmp_path_factory.mktemp("dflash-tp-dummy")
    target = make_model(str(root / "target"), "qwen3")
    with open(f"{target}/config.json") as f:
        cfg = json.load(f)
    drafter = make_dflash(str(root / "dflash"), cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"],
                          [0, cfg["num_hidden_layers"] - 1], block_size=4, v2=V2)
    cases = [(target, {"method": "dflash", "model": drafter, "num_speculative_tokens": 3})]
    if mtp_path is not None:
        cases.append((mtp_path, {"method": "mtp", "num_speculative_tokens": K}))
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for path, spec in cases:
        llm = LLM(path, tensor_parallel_size=2, load_format="dummy", speculative_config=spec,
                  max_num_batched_tokens=16, block_size=4, skip_tokenizer_init=True)
        try:
            mine = _whole_tensors(llm.engine.runner)
            theirs = llm.engine.tp_workers.call_on_workers(_whole_tensors)[0]
            assert mine and mine.keys() == theirs.keys()
            assert all(torch.equal(mine[n], theirs[n]) for n in mine), spec["method"]
            run_checked(llm, PROMPTS, sp)
            assert llm.engine.stats().extra["spec_draft_tokens"] > 0
        finally:
            llm.engine.shutdown()


def test_draft_tensor_parallel_size_one_keeps_the_drafter_on_rank_0(tmp_path_factory):
    """vLLM's draft_tensor_parallel_size 1: the DFlash drafter (and MTP module) runs whole on rank 0 beside its shard,
    with rank 0's whole copies of the vocabulary tables; the workers hold none; greedy outputs are plain decoding's.
    A size other than 1 or the target's is refused, and so is one above 1 under -pp."""
    from voltllm.config import ConfigError

    root = tmp_path_factory.mktemp("dflash-tp-one")
    target = make_model(str(root / "target"), "qwen3")
    with open(f"{target}/config.json") as f:
        cfg = json.load(f)
    drafter = make_dflash(str(root / "dflash"), cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"],
                          [0, cfg["num_hidden_layers"] - 1], block_size=4)
    spec = {"method": "dflash", "model": drafter, "num_speculative_tokens": 3}
    prompts = ["The quick brown fox jumps over the lazy dog. The quick brown fox", "0123456789 0123456789 0123"]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kw = dict(block_size=4, max_num_batched_tokens=16)
    llm = LLM(target, tensor_parallel_size=2, speculative_config={**spec, "draft_tensor_parallel_size": 1}, **kw)
    try:
        assert llm.engine.runner.full_vocab is not None and llm.engine.runner.draft.group is None
        assert llm.engine.tp_workers.call_on_workers(_has_drafter) == [False]
        records = record_block_logits(llm.engine.runner.draft)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        llm.engine.check_integrity()
    finally:
        llm.engine.shutdown()
    assert outs == [o.outputs[0].token_ids for o in LLM(target, **kw).generate(prompts, sp)]
    assert check_block_logits(records, target, drafter, [0, cfg["num_hidden_layers"] - 1]) >= 4
    for bad, where in (({"tensor_parallel_size": 2}, 3), ({"pipeline_parallel_size": 2}, 2)):
        with pytest.raises(ConfigError, match="draft_tensor_parallel_size"):
            LLM(target, speculative_config={**spec, "draft_tensor_parallel_size": where}, **bad, **kw)


def _has_drafter(runner):
    return runner.draft is not None


def test_a_drafter_that_cannot_split_like_the_target_is_refused(tmp_path_factory):
    """A DFlash drafter whose attention heads do not divide over the ranks: refused at configuration with the way out
    (draft_tensor_parallel_size 1), which then runs it whole on rank 0."""
    from voltllm.config import ConfigError, EngineArgs

    root = tmp_path_factory.mktemp("dflash-tp-odd")
    target = make_model(str(root / "target"), "qwen3")
    with open(f"{target}/config.json") as f:
        cfg = json.load(f)
    drafter = make_dflash(str(root / "dflash"), cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"],
                          [0], block_size=4, num_attention_heads=3, num_key_value_heads=1, head_dim=16)
    spec = {"method": "dflash", "model": drafter, "num_speculative_tokens": 3}
    with pytest.raises(ConfigError, match="3 attention heads do not divide by 2.*draft_tensor_parallel_size"):
        EngineArgs(model=target, tensor_parallel_size=2, device="cpu", speculative_config=spec).create_engine_config()
    config = EngineArgs(model=target, tensor_parallel_size=2, device="cpu",
                        speculative_config={**spec, "draft_tensor_parallel_size": 1}).create_engine_config()
    assert not config.speculative.drafter_split(config.parallel)


@pytest.mark.parametrize("method", ["mtp", "dflash"])
def test_split_drafters_graph_form_on_every_rank(tmp_path_factory, tmp_path, monkeypatch, method):
    """The graph form of a split drafter on both ranks (CPU stand-ins of the target's and the drafter's graphs in every
    process, tests/tp_eager_graphs.py): MTP's chained passes and its pass over the step, DFlash's block (a
    sliding-window layer in rings: their tables and slots in the drafter's graph buffers) replay from the input
    buffers each rank fills from rank 0's messages; logits equal the references, tokens plain decoding's."""
    import sys

    import tp_eager_graphs

    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    if method == "mtp":
        made = make_mtp_target(tmp_path_factory, "qwen3_5")
        if made is None:
            pytest.skip("this transformers has no qwen3_5")
        path, mtp = made
        spec = {"method": "mtp", "num_speculative_tokens": K}
        kw = dict(BASE)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    else:
        root = tmp_path_factory.mktemp("dflash-tp-graphs")
        path = make_model(str(root / "target"), "qwen3")
        with open(f"{path}/config.json") as f:
            cfg = json.load(f)
        layers = [0, cfg["num_hidden_layers"] - 1]
        drafter = make_dflash(str(root / "dflash"), cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"],
                              layers, block_size=4, layer_types=["sliding_attention", "full_attention"],
                              sliding_window=8, use_sliding_window=True)
        spec = {"method": "dflash", "model": drafter, "num_speculative_tokens": 3}
        kw = dict(block_size=4, max_num_seqs=2, kv_cache_memory_bytes=1 << 20)
        prompts = ["The quick brown fox jumps over the lazy dog. The quick brown fox", "0123456789 0123456789 0123"]
    expected = [o.outputs[0].token_ids for o in LLM(path, **kw).generate(prompts, sp)]
    tp_eager_graphs.worker_env(monkeypatch, tmp_path, sys.path)
    monkeypatch.setattr("voltllm.worker.runner.ModelRunner.capture_cuda_graphs", tp_eager_graphs._capture)
    seen = record_draft_logits(monkeypatch) if method == "mtp" else None
    llm = LLM(path, tensor_parallel_size=2, speculative_config=spec, max_num_batched_tokens=16, **kw)
    try:
        records = None if method == "mtp" else record_block_logits(llm.engine.runner.draft)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        llm.engine.check_integrity()
        assert llm.engine.runner.draft.graphs.replays > 0
        assert llm.engine.tp_workers.call_on_workers(_drafter_replays)[0] > 0
        if method == "dflash":
            assert llm.engine.runner.draft.rings is not None
    finally:
        llm.engine.shutdown()
    assert outs == expected
    if method == "mtp":
        fulls = {tuple(p["prompt_token_ids"]): p["prompt_token_ids"] + list(o) for p, o in zip(prompts, outs)}
        assert check_against_reference(MTPReference(path, mtp), seen, fulls, K) >= 3 * len(PROMPTS)
    else:
        assert check_block_logits(records, path, drafter, layers) >= 4


def _drafter_replays(runner):
    return runner.draft.graphs.replays
