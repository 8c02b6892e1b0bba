"""DFlash2 speculative decoding in the engine (CPU, a tiny random qwen3 target and tiny random DFlash2 drafters in
the public checkpoint format: convolutions around every sublayer, a candidate selector): the block's logits equal a
float64 reference of the drafter's math fed by transformers' hidden states of the target, eager and in the padded
graph form; greedy drafts are the reference selector's path (which leaves the argmax at some positions); greedy
outputs equal plain decoding's; sampled and mixed batches run; bad DFlash2 configs and checkpoints are refused."""
import json
import os

import pytest
import torch

from dflash_models import V2, check_block_drafts, check_block_logits, make_dflash, record_block_logits
from graph_stand_ins import PaddedDecodeGraphs
from spec_oracle import TEXT_PROMPTS as PROMPTS
from spec_oracle import text_outputs as _run
from tiny_models import make_model
from voltllm import LLM, SamplingParams

K = 3


def _spec(path, k=K):
    return {"method": "dflash", "model": path, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash2")
    target = make_model(str(root / "target"), "qwen3")
    with open(os.path.join(target, "config.json")) as f:
        c = json.load(f)
    layers = [0, c["num_hidden_layers"] - 1]
    drafter = make_dflash(str(root / "dflash2"), c["hidden_size"], c["vocab_size"], c["num_hidden_layers"], layers,
                          block_size=5, v2=V2)
    return {"target": target, "layers": layers, "drafter": drafter, "shape": c}


@pytest.mark.parametrize("graph_rows", [0, 16])
def test_block_logits_and_selected_drafts_equal_the_reference(models, graph_rows):
    """Every proposal of a batched greedy run (blocks of up to 4 rows side by side, so a convolution tap that read
    across two requests' blocks or into a graph's padding rows would show): the logits against the float64
    reference, the drafts against the reference selector's walk, which leaves the argmax somewhere."""
    target, drafter = models["target"], models["drafter"]
    llm = LLM(target, block_size=4, max_num_batched_tokens=16, speculative_config=_spec(drafter))
    dr = llm.engine.runner.draft
    assert dr.drafter.selector is not None
    if graph_rows:
        dr.graphs = PaddedDecodeGraphs(dr, graph_rows)
    records = record_block_logits(dr)
    _run(llm, PROMPTS[:3], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert check_block_logits(records, target, drafter, models["layers"]) >= 6
    checked, off_argmax = check_block_drafts(records, target, drafter, models["layers"], V2["selector_top_k"])
    assert checked >= 12 and off_argmax > 0
    assert not graph_rows or dr.graphs.replays >= 3


@pytest.mark.parametrize("budget", [64, 5])
def test_greedy_outputs_equal_plain_decoding(models, budget):
    target = models["target"]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    kw = dict(block_size=4, max_num_batched_tokens=budget, max_num_seqs=4)
    llm = LLM(target, speculative_config=_spec(models["drafter"]), **kw)
    assert _run(llm, PROMPTS, sp) == _run(LLM(target, **kw), PROMPTS, sp)
    assert llm.engine.stats().extra["spec_draft_tokens"] > 0


def test_mixed_batches_take_the_path_for_greedy_requests(models):
    """Greedy and sampled requests in one proposal: the greedy ones' drafts are the selector's path (their outputs
    equal plain decoding's), the sampled ones' are drawn (seeded: they repeat)."""
    target, drafter = models["target"], models["drafter"]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, ignore_eos=True, seed=5)
    llm = LLM(target, block_size=4, speculative_config=_spec(drafter))
    dr = llm.engine.runner.draft
    records = record_block_logits(dr)
    orig = dr.drafter.select

    def spy(hidden, logits, anchors):
        out = orig(hidden, logits, anchors)
        records[-1]["path"] = out.cpu()
        return out

    dr.drafter.select = spy
    sps = [greedy, sampled, greedy, sampled]
    first = _run(llm, PROMPTS, sps)
    mixed = 0
    for rec in records:
        if len(set(rec["greedy"])) == 2:
            mixed += 1
            for i, (g, (_, _, k)) in enumerate(zip(rec["greedy"], rec["rows"])):
                if g:
                    assert rec["drafts"][:k, i].tolist() == rec["path"][:k, i].tolist()
    assert mixed >= 3
    assert first == _run(llm, PROMPTS, sps)
    plain = _run(LLM(target, block_size=4), PROMPTS[0::2], greedy)
    assert [first[0], first[2]] == plain


def test_dummy_weights_run(models):
    """--load-format dummy: random convolutions and selector (the target random too): the engine starts, drafts and
    stays consistent."""
    llm = LLM(models["target"], block_size=4, load_format="dummy", speculative_config=_spec(models["drafter"]))
    _run(llm, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert llm.engine.stats().extra["spec_draft_tokens"] > 0


def _config_error(target, spec):
    from voltllm.config import ConfigError, EngineArgs

    with pytest.raises(ConfigError) as e:
        EngineArgs(model=target, speculative_config=json.dumps(spec)).create_engine_config()
    return str(e.value)


def test_bad_dflash2_drafters_are_refused(models, tmp_path):
    target, c = models["target"], models["shape"]

    def drafter(name, v2=V2, **kw):
        return make_dflash(str(tmp_path / name), c["hidden_size"], c["vocab_size"], c["num_hidden_layers"], [0],
                           v2=v2, **kw)

    assert "conv_group_size" in _config_error(target, _spec(drafter("no_group", {**V2, "conv_group_size": None})))
    assert "does not divide" in _config_error(target, _spec(drafter("odd_group", {**V2, "conv_group_size": 7})))
    assert "selector_top_k" in _config_error(
        target, _spec(drafter("wide", {**V2, "selector_top_k": c["vocab_size"] + 1})))
    assert "selector_rank" in _config_error(target, _spec(drafter("rank0", {**V2, "selector_rank": 0})))


def test_checkpoints_missing_dflash2_tensors_are_refused(models, tmp_path):
    from safetensors.torch import load_file, save_file

    target = models["target"]
    for missing in ("candidate_selector.successor_codebook", "layers.1.mlp_conv.base_kernel"):
        path = str(tmp_path / missing.replace(".", "_"))
        c = models["shape"]
        make_dflash(path, c["hidden_size"], c["vocab_size"], c["num_hidden_layers"], [0], v2=V2)
        file = os.path.join(path, "model.safetensors")
        w = load_file(file)
        del w[missing]
        save_file(w, file, metadata={"format": "pt"})
        with pytest.raises(Exception, match="missing") as e:
            LLM(target, block_size=4, speculative_config=_spec(path))
        assert missing in str(e.value)


def test_codebooks_saved_as_embedding_weights_load(models, tmp_path):
    """A converter that saved the codebooks as embeddings' `.weight`s: the same drafts."""
    from safetensors.torch import load_file, save_file

    c = models["shape"]
    path = make_dflash(str(tmp_path / "emb"), c["hidden_size"], c["vocab_size"], c["num_hidden_layers"],
                       models["layers"], block_size=5, v2=V2)
    file = os.path.join(path, "model.safetensors")
    w = load_file(file)
    for name in ("predecessor", "successor"):
        w[f"candidate_selector.{name}_codebook.weight"] = w.pop(f"candidate_selector.{name}_codebook")
    save_file(w, file, metadata={"format": "pt"})
    a = LLM(models["target"], block_size=4, speculative_config=_spec(models["drafter"])).engine.runner.draft
    b = LLM(models["target"], block_size=4, speculative_config=_spec(path)).engine.runner.draft
    for (n, p), (_, q) in zip(a.drafter.selector.named_parameters(), b.drafter.selector.named_parameters()):
        assert torch.equal(p, q), n
