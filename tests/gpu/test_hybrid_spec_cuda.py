"""Speculative decoding on hybrid targets on the GPU: the verification kernel (gdn_decode.gated_delta_rule_verify) at
the qwen3.5-27b shape against the torch reference, and tiny qwen3_5 / qwen3_next / qwen3_5_moe targets through the
engine with oracle drafts (tests/spec_oracle.py: all, some and none accepted). A hybrid's verification replays a
walks graph (decode rows whose GDN layers walk each request's rows) or, beside prompt chunks, runs eagerly; fp32
greedy tokens equal plain decoding's (native and --compat sm70), fp16 agrees except at near-ties (verification runs
the prefill conv / attention kernels where plain decoding runs the decode ones), sampled verification (top_k 1)
keeps the states, an attention-only draft model drafts for a hybrid target, and prefix-cache snapshots stay exact.
DFlash on a hybrid target: the drafter's logits equal the float64 reference fed by transformers' hidden states (fp32,
the target's hidden states captured inside its decode / walks graphs, the drafter's blocks replaying its own graphs),
greedy tokens are plain decoding's (fp32, native and --compat sm70), fp16 agrees, an agreeing drafter is always
accepted."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from dflash_models import check_block_logits, make_dflash, record_block_logits, zero_lm_head
from spec_oracle import oracle_table, patch_dflash, patch_draft_model, patch_ngram
from tiny_models import HYBRID_COMMON, HYBRID_VOCAB, make_model, make_tiny_hybrid

pytestmark = pytest.mark.gpu

_spec = importlib.util.spec_from_file_location(
    "_gdn_decode_interp_check", Path(__file__).resolve().parents[1] / "unit" / "_gdn_decode_interp_check.py")
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)

K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
KINDS = ["qwen3_5", "qwen3_next", "qwen3_5_moe"]


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_verify_kernel_real_shape(dtype):
    """qwen3.5-27b-shape GDN heads (16 key, 48 value, dims 128): 6 requests of 1-5 rows."""
    _cuda()
    status = H.run_verify("cuda", [5, 1, 3, 5, 2, 4], 16, 48, 128, 128, dtype, 17)
    assert status.startswith("ok"), status


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_verify_conv_real_shape(dtype):
    """The walks' conv at the qwen3.5-27b shape (10240 channels, kernel 4)."""
    _cuda()
    status = H.run_conv_verify("cuda", [5, 1, 3, 5], 2 * 16 * 128 + 48 * 128, 4, dtype, 18)
    assert status.startswith("ok"), status


@pytest.mark.parametrize("check", ["run_layer_verify", "run_layer_walks"])
def test_layer_verification_cuda(check):
    """A layer's verification (prompt form, and walks as a graph replays them) with the kernels == the torch
    reference."""
    _cuda()
    status = getattr(H, check)("cuda", True)
    assert status.startswith("ok"), status


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    pytest.importorskip("transformers")
    out = {}
    for kind in KINDS:
        path = make_tiny_hybrid(str(tmp_path_factory.mktemp(kind)), kind, seed=0, gen_seed=1)
        if path is not None:
            out[kind] = path
    return out


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, HYBRID_VOCAB, (40,), generator=g).tolist()
    return [shared + torch.randint(0, HYBRID_VOCAB, (n,), generator=g).tolist() for n in (20, 9)] + \
        [torch.randint(0, HYBRID_VOCAB, (n,), generator=g).tolist() for n in (300, 5, 64)]


def _run(llm, prompts, sp):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    llm.engine.check_integrity()
    assert llm.engine.kv.usage() == 0.0
    return [o.outputs[0].token_ids for o in outs]


def _llm(path, **kw):
    from voltllm import LLM

    # 32 rows: a verification of all 5 requests (up to 25 tokens) replays a walks graph; budget 96: prompt chunks
    # beside verifications (eager prompt-form steps)
    return LLM(path, device="cuda", skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=32,
               max_num_batched_tokens=96, gpu_memory_utilization=0.2, **kw)


def _greedy(n: int = 40):
    from voltllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


_PLAIN: dict = {}


def _plain(path, **kw):
    """Plain decoding's greedy tokens of _prompts() (cached: one engine start per configuration)."""
    key = (path, tuple(sorted(kw.items())))
    if key not in _PLAIN:
        _PLAIN[key] = _run(_llm(path, **kw), _prompts(), _greedy())
    return _PLAIN[key]


def _oracle(monkeypatch, ref, patch=patch_ngram) -> None:
    patch(monkeypatch, oracle_table(_prompts(), ref), HYBRID_VOCAB)


@pytest.mark.parametrize("kind,compat", [("qwen3_5", "none"), ("qwen3_next", "none"), ("qwen3_5_moe", "none"),
                                         ("qwen3_5", "sm70")])
def test_fp32_greedy_equals_plain(hybrids, monkeypatch, kind, compat):
    """Plus, on qwen3_5 native, top_k 1 sampled requests (the sampled verification) give the greedy tokens."""
    _cuda()
    if kind not in hybrids:
        pytest.skip(f"{kind} unavailable")
    from voltllm import SamplingParams

    ref = _plain(hybrids[kind], dtype="float32", compat=compat)
    _oracle(monkeypatch, ref)
    llm = _llm(hybrids[kind], dtype="float32", compat=compat, speculative_config=NGRAM)
    assert _run(llm, _prompts(), _greedy()) == ref
    stats = llm.engine.stats().extra
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert llm.engine.runner.verify_graphs.replays > 0  # verifications replayed walks graphs
    if kind == "qwen3_5" and compat == "none":
        one_hot = SamplingParams(temperature=0.8, top_k=1, seed=3, max_tokens=40, ignore_eos=True)
        assert _run(llm, _prompts(), one_hot) == ref


@pytest.mark.parametrize("compat", ["none", "sm70"])
def test_fp16_agrees_with_plain(hybrids, monkeypatch, compat):
    _cuda()
    path = hybrids["qwen3_5"]
    ref = _plain(path, dtype="float16", compat=compat)
    _oracle(monkeypatch, ref)
    got = _run(_llm(path, dtype="float16", compat=compat, speculative_config=NGRAM), _prompts(), _greedy())
    agree = sum(a == b for x, y in zip(ref, got) for a, b in zip(x, y)) / sum(len(x) for x in ref)
    assert agree >= 0.9, agree


def test_eager_equals_graphs(hybrids, monkeypatch):
    """--enforce-eager (verifications as prompt-form steps, plain steps without decode graphs) gives the graph
    run's tokens."""
    _cuda()
    path = hybrids["qwen3_5"]
    ref = _plain(path, dtype="float32", compat="none")
    _oracle(monkeypatch, ref)
    assert _run(_llm(path, dtype="float32", enforce_eager=True, speculative_config=NGRAM), _prompts(),
                _greedy()) == ref


def test_prefix_cache_snapshots(hybrids, monkeypatch):
    _cuda()
    kind = "qwen3_next" if "qwen3_next" in hybrids else "qwen3_5"
    ref = _plain(hybrids[kind], dtype="float32", compat="none")
    _oracle(monkeypatch, ref)
    llm = _llm(hybrids[kind], dtype="float32", speculative_config=NGRAM, mamba_block_size=16)
    for _ in range(2):
        assert _run(llm, _prompts(), _greedy()) == ref
    assert llm.engine.runner.state_snapshots.stats()["restored"] > 0


def test_draft_model_for_a_hybrid_target(hybrids, monkeypatch, tmp_path):
    _cuda()
    path = hybrids["qwen3_5"]
    draft = make_model(str(tmp_path / "draft"), "llama", seed=1, num_hidden_layers=1, vocab_size=HYBRID_VOCAB,
                       max_position_embeddings=4096)
    ref = _plain(path, dtype="float32", compat="none")
    _oracle(monkeypatch, ref, patch_draft_model)
    llm = _llm(path, dtype="float32", speculative_config={"model": draft, "num_speculative_tokens": K})
    assert _run(llm, _prompts(), _greedy()) == ref
    assert llm.engine.stats().extra["spec_accepted_tokens"] > 0


# -- DFlash --------------------------------------------------------------------------------------------------
DFLASH_LAYERS = [1, 3]  # a GDN layer's residual stream, and the last (attention) layer's output after the final norm


@pytest.fixture(scope="module")
def dflash(tmp_path_factory):
    return make_dflash(str(tmp_path_factory.mktemp("dflash")), HYBRID_COMMON["hidden_size"], HYBRID_VOCAB,
                       HYBRID_COMMON["num_hidden_layers"], DFLASH_LAYERS, block_size=5)


def _dflash(path):
    return {"method": "dflash", "model": path, "num_speculative_tokens": K}


@pytest.mark.parametrize("kind,compat", [("qwen3_5", "none"), ("qwen3_next", "none"), ("qwen3_5_moe", "none"),
                                         ("qwen3_5", "sm70")])
def test_dflash_fp32_logits_and_greedy(hybrids, dflash, monkeypatch, kind, compat):
    """Oracle drafts (partly accepted, so the context also comes from verified positions past a verification's
    first row): tokens equal plain decoding's, verifications replay walks graphs, blocks the drafter's graphs, and
    every block's logits equal the reference."""
    _cuda()
    if kind not in hybrids:
        pytest.skip(f"{kind} unavailable")
    ref = _plain(hybrids[kind], dtype="float32", compat=compat)
    _oracle(monkeypatch, ref, patch_dflash)
    llm = _llm(hybrids[kind], dtype="float32", compat=compat, speculative_config=_dflash(dflash))
    records = record_block_logits(llm.engine.runner.draft)
    assert _run(llm, _prompts(), _greedy()) == ref
    stats = llm.engine.stats().extra
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert llm.engine.runner.verify_graphs.replays > 0 and llm.engine.runner.draft.graphs.replays > 0
    assert check_block_logits(records, hybrids[kind], dflash, DFLASH_LAYERS, tol=1e-3) >= 20


def test_dflash_fp16_agrees_and_snapshots(hybrids, dflash, monkeypatch):
    """fp16 with graphs agrees with plain decoding except at near-ties, also in a second round that resumes from
    prefix-cache snapshots."""
    _cuda()
    path = hybrids["qwen3_5"]
    ref = _plain(path, dtype="float16", compat="none")
    _oracle(monkeypatch, ref, patch_dflash)
    llm = _llm(path, dtype="float16", speculative_config=_dflash(dflash), mamba_block_size=16)
    for _ in range(2):
        got = _run(llm, _prompts(), _greedy())
        agree = sum(a == b for x, y in zip(ref, got) for a, b in zip(x, y)) / sum(len(x) for x in ref)
        assert agree >= 0.9, agree
    assert llm.engine.runner.state_snapshots.stats()["restored"] > 0
    assert llm.engine.runner.draft.graphs.replays > 0


def test_dflash_fp16_sampled_requests_repeat(hybrids, dflash):
    """Seeded sampled requests (drafts drawn from the drafter's q) beside greedy ones: two engines give the same
    tokens."""
    _cuda()
    from voltllm import SamplingParams

    sps = [_greedy(), SamplingParams(temperature=1.0, seed=11, max_tokens=40, ignore_eos=True)] * 2 + [_greedy()]
    runs = [_run(_llm(hybrids["qwen3_5"], dtype="float16", speculative_config=_dflash(dflash)), _prompts(), sps)
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_dflash_agreeing_drafter_fp16(dflash, tmp_path):
    """A zero LM head: target and drafter both pick token 0 (greedy) or draw from the same uniform distribution
    (sampled: q = p), so every draft is accepted (walks graphs keeping the state after the last draft)."""
    _cuda()
    from voltllm import SamplingParams

    path = make_tiny_hybrid(str(tmp_path / "agree"), "qwen3_5", seed=0, gen_seed=1)
    if path is None:
        pytest.skip("qwen3_5 unavailable")
    zero_lm_head(path)
    llm = _llm(path, dtype="float16", speculative_config=_dflash(dflash))
    n = 41
    assert _run(llm, _prompts(), _greedy(n)) == [[0] * n] * len(_prompts())
    _run(llm, _prompts(), SamplingParams(temperature=0.8, seed=2, max_tokens=n, ignore_eos=True))
    extra = llm.engine.stats().extra
    assert extra["spec_accepted_tokens"] == extra["spec_draft_tokens"] > 0
    assert llm.engine.runner.verify_graphs.replays > 0
