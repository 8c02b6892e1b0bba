"""LoRA adapters on the hybrid models (qwen3_5 / qwen3_next / qwen3_5_moe; CPU, tiny random checkpoints and adapters):
a request's greedy tokens and logprobs with an adapter equal a plain engine's on the checkpoint with that adapter
merged into its weights (W + scaling * B A, saved by transformers: so each PEFT module's B rows must land where our
loader put the weight's rows: the gated q_proj's [q | gate] per head, Qwen3.5's flat in_proj_qkv, Qwen3-Next's
head-grouped in_proj_qkvz / in_proj_ba), whatever the batch mixes (other adapters, none, chunked prefill); hybrid
state snapshots (prefix caching) are never shared across adapters."""
from __future__ import annotations

import pytest

from lora_adapters import HYBRID_TARGETS, make_adapter, save_merged
from tiny_models import HYBRID_VOCAB, make_tiny_hybrid, small_moe
from voltllm import LoRARequest, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[5, 9, 33, 41, 7, 100, 3, 77, 12, 150, 8], [17, 18, 19], [3, 4] * 9, [60, 61, 2, 190, 44]]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)


def _llm(path, **kw):
    from voltllm.entrypoints.llm import LLM

    kw = {"device": "cpu", "dtype": "float32", "enforce_eager": True, "max_model_len": 128, "max_num_seqs": 4,
          "block_size": 4, **kw}
    return LLM(path, **kw)


def _lora_llm(path, **kw):
    return _llm(path, enable_lora=True, max_loras=2, max_lora_rank=8, **kw)


def _outputs(llm, prompts, lora=None, params=PARAMS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lora, use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs or ()])
            for o in outs]


def _same(ours, ref, atol=1e-4):
    for (tokens, lps), (ref_tokens, ref_lps) in zip(ours, ref):
        assert tokens == ref_tokens
        for d, r in zip(lps, ref_lps):
            assert d.keys() == r.keys()
            for t in d:
                assert d[t] == pytest.approx(r[t], abs=atol)


def _hybrid(root, kind):
    path = make_tiny_hybrid(f"{root}/{kind}", kind, seed=0, gen_seed=1, **small_moe(kind))
    if path is None:
        pytest.skip(f"this transformers has no {kind}")
    return path


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next", "qwen3_5_moe"])
def test_adapters_equal_the_merged_checkpoint(tmp_path, kind):
    """Every projection an adapter may target on this hybrid (gated attention, Gated DeltaNet, dense MLPs), two
    adapters (one rsLoRA of a smaller rank, some modules and layers only) and the base model in one batch: each request
    equals a plain engine on its merged checkpoint, and the adapters change the output."""
    root = str(tmp_path)
    base = _hybrid(root, kind)
    a1 = make_adapter(f"{root}/a1", base, rank=8, alpha=16, seed=1, targets=HYBRID_TARGETS, std=0.15)
    a2 = make_adapter(f"{root}/a2", base, rank=4, alpha=8, seed=2, rslora=True, layers=[1, 3], std=0.15,
                      targets=("q_proj", "v_proj", "in_proj_qkv", "in_proj_b", "in_proj_qkvz", "out_proj",
                               "down_proj"))
    reqs = {"a1": LoRARequest("a1", 1, a1), "a2": LoRARequest("a2", 2, a2)}
    names = [None, "a1", "a2", "a1"]
    prompts = [[t % HYBRID_VOCAB for t in p] for p in PROMPTS]
    ours = _outputs(_lora_llm(base), prompts, [reqs[n] if n else None for n in names])
    refs = {None: _outputs(_llm(base), prompts)}
    for n, path in (("a1", a1), ("a2", a2)):
        refs[n] = _outputs(_llm(save_merged(base, path, f"{root}/merged-{n}")), prompts)
    for i, n in enumerate(names):
        _same([ours[i]], [refs[n][i]])
    assert refs["a1"][1][0] != refs[None][1][0] and refs["a2"][2][0] != refs[None][2][0]


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_tensor_parallel_ranks_cut_the_adapters_as_the_checkpoint(tmp_path, kind):
    """-tp 2: each rank's adapter slices are the model's own cuts of its projections (gated attention by heads,
    Gated DeltaNet in_proj by key / value heads and out_proj by value-head columns, dense MLPs by intermediate
    rows): a mixed batch equals the merged checkpoints at -tp 1."""
    root = str(tmp_path)
    base = _hybrid(root, kind)
    a1 = make_adapter(f"{root}/a1", base, rank=8, alpha=16, seed=1, targets=HYBRID_TARGETS, std=0.15)
    reqs = {"a1": LoRARequest("a1", 1, a1)}
    names = ["a1", None, "a1"]
    prompts = [[t % HYBRID_VOCAB for t in p] for p in PROMPTS[:3]]
    ours = _outputs(_lora_llm(base, tensor_parallel_size=2), prompts, [reqs[n] if n else None for n in names])
    refs = {None: _outputs(_llm(base), prompts), "a1": _outputs(_llm(save_merged(base, a1, f"{root}/m1")), prompts)}
    for i, n in enumerate(names):
        _same([ours[i]], [refs[n][i]])
    assert refs["a1"][0][0] != refs[None][0][0]


def test_chunked_prefill_and_prefix_snapshots_keep_adapters_apart(tmp_path):
    """Prompts prefilled in small chunks beside decoding requests of other adapters; then the same long prompt under
    the base model, a1, a2 and a1 again with prefix caching (KV blocks and Gated DeltaNet state snapshots): each run
    equals its merged reference, so no snapshot taken under one adapter served another."""
    root = str(tmp_path)
    base = _hybrid(root, "qwen3_5")
    a1 = make_adapter(f"{root}/a1", base, rank=8, seed=3, targets=HYBRID_TARGETS, std=0.15)
    a2 = make_adapter(f"{root}/a2", base, rank=8, seed=4, targets=HYBRID_TARGETS, std=0.15)
    reqs = {"a1": LoRARequest("a1", 1, a1), "a2": LoRARequest("a2", 2, a2)}
    prompt = [(7 * i + 3) % HYBRID_VOCAB for i in range(26)]
    refs = {None: _llm(base)}
    for n, path in (("a1", a1), ("a2", a2)):
        refs[n] = _llm(save_merged(base, path, f"{root}/merged-{n}"))
    llm = _lora_llm(base, max_num_batched_tokens=8, enable_prefix_caching=True, mamba_block_size=8)
    names = ["a1", None, "a2", "a1"]
    mixed = _outputs(llm, PROMPTS, [reqs[n] if n else None for n in names])
    for i, n in enumerate(names):
        _same([mixed[i]], _outputs(refs[n], [PROMPTS[i]]))
    snaps = llm.engine.runner.state_snapshots
    for n in [None, "a1", "a2", "a1", None, "a2"]:
        _same(_outputs(llm, [prompt], reqs[n] if n else None), _outputs(refs[n], [prompt]))
    assert snaps is not None and snaps.num_restored > 0  # (the repeats did resume from snapshots)
    llm.engine.check_integrity()


def test_snapshot_hashes_carry_the_adapter():
    """A snapshot's key is the hash of the KV block it ends at, the adapter's key in its chain (as the KV blocks'):
    the pool may be the first to hash a request's blocks, and must not hash them without the adapter."""
    from types import SimpleNamespace

    from voltllm.cache.prefix import extend_block_hashes
    from voltllm.cache.state_snapshots import StateSnapshots

    tokens = list(range(16))
    snaps = StateSnapshots.__new__(StateSnapshots)
    snaps.block_size = 4
    hashes = {}
    for key in (None, ("a1", 1), ("a2", 2)):
        req = SimpleNamespace(all_token_ids=tokens, block_hashes=[], cache_salt=None, lora_key=key, content_spans=())
        hashes[key] = snaps._hash_at(req, 8)
        want = []
        extend_block_hashes(want, tokens, 4, None, key)
        assert req.block_hashes == want
    assert len(set(hashes.values())) == 3


def test_mtp_drafts_keep_each_adapters_tokens(tmp_path_factory):
    """The checkpoint's MTP module runs without the request's adapter (its layer plain; the target's hidden states it
    reads carry the adapter): a batch mixing an adapter and the base model keeps each request's greedy tokens those of
    a plain engine on the merged checkpoint (which has no MTP: speculation does not change greedy tokens)."""
    from mtp_models import make_mtp_target

    made = make_mtp_target(tmp_path_factory, "qwen3_5")
    if made is None:
        pytest.skip("this transformers has no qwen3_5")
    base, root = made[0], str(tmp_path_factory.mktemp("lora-mtp"))
    a1 = make_adapter(f"{root}/a1", base, rank=8, alpha=16, seed=1, targets=HYBRID_TARGETS, std=0.15)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[t % HYBRID_VOCAB for t in p] for p in PROMPTS[:3]]
    names = ["a1", None, "a1"]
    llm = _lora_llm(base, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    ours = _outputs(llm, prompts, [LoRARequest("a1", 1, a1) if n else None for n in names], greedy)
    assert llm.engine.stats().extra["spec_draft_tokens"] > 0
    refs = {None: _outputs(_llm(base), prompts, params=greedy),
            "a1": _outputs(_llm(save_merged(base, a1, f"{root}/m1")), prompts, params=greedy)}
    for i, n in enumerate(names):
        assert ours[i][0] == refs[n][i][0]
    assert refs["a1"][0][0] != refs[None][0][0]
