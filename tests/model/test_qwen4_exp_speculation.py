"""Speculative decoding on Qwen4-Exp (CPU, a tiny random qwen4_exp_text with PLE layers and QSA past a budget of 8
tokens): greedy outputs with n-gram, suffix and draft-model speculation equal plain decoding's, which equal
transformers' generate; drafts get accepted and rejected (an oracle drafter, tests/spec_oracle.py). The GDN states
roll back as every hybrid's; the PLE per-request extras ("ple_ctx", "ple_conv") keep a checkpoint per verified row
(gdn_verify.WindowCheckpoints) and the tests show the outputs leave plain decoding's without them; QSA's pooled keys
of blocks completed by rejected rows are rewritten by the accepted row before any read (a write-once pooled store,
which would keep them, makes the outputs differ)."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen4ExpTextConfig"):
    pytest.skip("this transformers has no Qwen4-Exp", allow_module_level=True)

from model.test_qwen4_exp import COMMON, INDEXER, PLE, VOCAB, _randomize, _seqs  # noqa: E402
from spec_oracle import PlainRuns, oracle_table, patch_draft_model, patch_ngram, run_checked  # noqa: E402
from tiny_models import make_model  # noqa: E402
from voltllm import LLM, SamplingParams  # noqa: E402

K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
BASE = dict(block_size=4, max_num_seqs=4, skip_tokenizer_init=True)
# prompts past the QSA budget + ratio (12 tokens) after a few tokens, one with an EOS (PLE's context reset) and a
# repetitive one (real n-gram drafts); 20 new tokens each
PROMPTS = _seqs(11, [9, 21, 14], eos_at=((1, 6),)) + [[17, 23, 41, 17, 23, 41, 17, 23, 41, 17, 23]]
SP = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

_plain = PlainRuns(BASE)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(directory, transformers model): PLE on layers 1 and 3, QSA budget 8 / ratio 4."""
    cfg = transformers.Qwen4ExpTextConfig(**COMMON, **dict(INDEXER, **PLE, indexer_budget=8))
    torch.manual_seed(700)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    _randomize(ref, 701)
    d = tmp_path_factory.mktemp("qwen4_exp_spec")
    ref.save_pretrained(d)
    return str(d), ref


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """An attention-only llama with the target's vocabulary (its tokenizer is not read: skip_tokenizer_init)."""
    return make_model(str(tmp_path_factory.mktemp("draft")), "llama", seed=1, num_hidden_layers=1,
                      vocab_size=VOCAB, max_position_embeddings=4096)


@pytest.fixture
def oracle_ngram(monkeypatch):
    table: dict = {}
    patch_ngram(monkeypatch, table, VOCAB)
    return table


def _transformers(ref, prompts: list, n: int) -> list:
    with torch.no_grad():
        return [ref.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def _accepted_and_rejected(llm) -> None:
    stats = llm.engine.stats().extra
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]


@pytest.mark.parametrize("budget", [64, 7])
def test_ngram_oracle_greedy_equals_plain_and_transformers(target, oracle_ngram, budget):
    """Budget 7: prompt chunks share steps with verifications (their rows beside drafting ones)."""
    path, ref = target
    plain = _plain(path, PROMPTS, SP, max_num_batched_tokens=budget)
    if budget == 64:  # (plain decoding's tokens do not depend on the budget: tests/model/test_qwen4_exp.py)
        assert plain == _transformers(ref, PROMPTS, 20)
    oracle_ngram.update(oracle_table(PROMPTS, plain))
    llm = LLM(path, speculative_config=NGRAM, max_num_batched_tokens=budget, **BASE)
    assert run_checked(llm, PROMPTS, SP) == plain
    _accepted_and_rejected(llm)


def test_real_ngram_and_suffix_drafts_equal_plain(target):
    path, _ = target
    plain = _plain(path, PROMPTS, SP)
    for spec in (NGRAM, {"method": "suffix", "num_speculative_tokens": K}):
        llm = LLM(path, speculative_config=spec, **BASE)
        assert run_checked(llm, PROMPTS, SP) == plain
        assert llm.engine.stats().extra["spec_draft_tokens"] > 0


def test_draft_model_equals_plain(target, draft, monkeypatch):
    path, _ = target
    plain = _plain(path, PROMPTS, SP)
    llm = LLM(path, speculative_config={"model": draft, "num_speculative_tokens": 3}, **BASE)
    assert run_checked(llm, PROMPTS, SP) == plain
    assert llm.engine.stats().extra["spec_draft_tokens"] > 0
    table: dict = {}
    patch_draft_model(monkeypatch, table, VOCAB)
    table.update(oracle_table(PROMPTS, plain))
    llm = LLM(path, speculative_config={"model": draft, "num_speculative_tokens": K}, **BASE)
    assert run_checked(llm, PROMPTS, SP) == plain
    _accepted_and_rejected(llm)


@pytest.mark.parametrize("extra", ["ple_ctx", "ple_conv"])
def test_ple_extras_must_roll_back(target, oracle_ngram, monkeypatch, extra):
    """Without the checkpoints of one PLE extra (the slot keeps a checkpoint row never written, as if the rejected
    drafts' effects stayed or the state were lost) the outputs leave plain decoding's."""
    from voltllm.model.layers import gdn_verify

    path, _ = target
    plain = _plain(path, PROMPTS, SP)
    oracle_ngram.update(oracle_table(PROMPTS, plain))
    real = gdn_verify.WindowCheckpoints.save
    width = {"ple_ctx": PLE["ngram_size"] - 1, "ple_conv": (PLE["ple_conv_kernel_size"] - 1) * PLE["ngram_size"]}
    skipped = []

    def save(self, x, states, rows):
        if self.width == width[extra]:
            skipped.append(1)
            return
        real(self, x, states, rows)

    monkeypatch.setattr(gdn_verify.WindowCheckpoints, "save", save)
    llm = LLM(path, speculative_config=NGRAM, **BASE)
    out = run_checked(llm, PROMPTS, SP)
    assert skipped and out != plain


def test_qsa_pooled_keys_of_rejected_rows_are_rewritten(target, oracle_ngram, monkeypatch):
    """Drafts on every other step only, so pure-decode steps (which read the stored pooled block keys: device
    selection) follow verifications whose rejected rows completed blocks. Before each such read, every complete
    block's stored key equals the one recomputed from its raw keys, and the outputs equal plain decoding's; with a
    write-once pooled store (a block's key kept from its first computation, maybe a rejected row's) stale keys are
    read."""
    from voltllm.engine.scheduler import Scheduler
    from voltllm.model.models import qwen4_exp_qsa_decode as qsa_decode

    path, _ = target
    prompts = PROMPTS[1:2]  # one request (its blocks are written by it alone)
    plain = _plain(path, prompts, SP)
    oracle_ngram.update(oracle_table(prompts, plain))
    oracle = Scheduler._propose
    monkeypatch.setattr(Scheduler, "_propose", lambda self, req, max_new: (
        oracle(self, req, max_new) if len(req.all_token_ids) % 2 else []))
    real_store, real_select = qsa_decode.store_pooled_keys, qsa_decode.decode_selection
    seen = {"raw": None, "reads": 0, "stale": 0}

    def recording_store(indexer, rotary, raw_keys, *args, **kwargs):
        seen["raw"] = raw_keys  # (the layer's raw keys; its selection follows)
        return real_store(indexer, rotary, raw_keys, *args, **kwargs)

    def checking_select(indexer, rotary, q_idx, positions, pooled, meta, bs, *args, **kwargs):
        r = indexer.ratio
        for i in range(meta.block_tables.shape[0]):
            n_c = (int(positions[i]) + 1) // r
            if n_c:
                ends = torch.arange(1, n_c + 1) * r - 1
                seqs = torch.full((n_c,), i)
                slots = qsa_decode.token_slots(meta.block_tables, seqs, ends, bs)
                want = pooled.clone()
                real_store(indexer, rotary, seen["raw"], want, ends, slots, meta.block_tables, seqs, bs)
                seen["reads"] += n_c
                seen["stale"] += int((~torch.isclose(pooled[slots], want[slots], rtol=1e-5, atol=1e-6)).any(-1).sum())
        return real_select(indexer, rotary, q_idx, positions, pooled, meta, bs, *args, **kwargs)

    monkeypatch.setattr(qsa_decode, "store_pooled_keys", recording_store)
    monkeypatch.setattr(qsa_decode, "decode_selection", checking_select)
    llm = LLM(path, speculative_config=NGRAM, **BASE)
    assert run_checked(llm, prompts, SP) == plain
    _accepted_and_rejected(llm)
    assert seen["reads"] > 0 and seen["stale"] == 0

    def write_once(indexer, rotary, raw_keys, pooled_keys, *args, **kwargs):
        before = pooled_keys.clone()
        recording_store(indexer, rotary, raw_keys, pooled_keys, *args, **kwargs)
        kept = before.ne(0).any(-1)
        pooled_keys[kept] = before[kept]

    monkeypatch.setattr(qsa_decode, "store_pooled_keys", write_once)
    run_checked(LLM(path, speculative_config=NGRAM, **BASE), prompts, SP)
    assert seen["stale"] > 0


@pytest.mark.parametrize("spec, what", [
    ({"method": "mtp", "num_speculative_tokens": 2}, "MTP"),
    ({"method": "dflash", "model": "z-lab/none", "num_speculative_tokens": 2}, "DFlash"),
    ({"method": "eagle3", "model": "yuhuili/none", "num_speculative_tokens": 2}, "EAGLE-3")])
def test_unbuilt_speculative_methods_are_refused(target, spec, what):
    from voltllm.config import ConfigError

    with pytest.raises(ConfigError, match=f"Qwen4-Exp .*{what}.*hyper-connection|Qwen4-Exp .*{what}.*mtp"):
        LLM(target[0], speculative_config=spec, **BASE)
