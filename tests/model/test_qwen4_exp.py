"""Qwen4-Exp (qwen4_exp_text / qwen4_exp) vs transformers on tiny random checkpoints, fp32 CPU.

Our model runs through test_hybrid_parity's Harness (paged KV + TorchReferenceBackend + StateCache), batched over
requests of different lengths, in chunks and decode steps; its logits must equal transformers' no-cache forward.
Each feature's test also shows that breaking the feature (PLE's EOS reset, QSA's selection, the hyper-connection
injection weights) moves the logits far past the tolerance, so the comparison can fail.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen4ExpTextConfig"):
    pytest.skip("this transformers has no Qwen4-Exp", allow_module_level=True)

from model.test_hybrid_parity import Harness  # noqa: E402
from tiny_models import randomize_qwen4_exp  # noqa: E402
from voltllm.model.loader.safetensors_loader import safetensors_weights  # noqa: E402
from voltllm.model.models import qwen4_exp, qwen4_exp_ple  # noqa: E402
from voltllm.model.models import qwen4_exp_qsa_decode as qsa_decode  # noqa: E402
from voltllm.model.models.qwen4_exp import Qwen4ExpForCausalLM  # noqa: E402

VOCAB = 192
EOS = 5
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6, hc_count=2, hc_lowrank=16,
              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
              eos_token_id=EOS, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": 0.5, "mrope_section": [4, 2, 2],
                                                 "mrope_interleaved": True})
# transformers always builds the indexer: a budget past every context here is plain causal attention
INDEXER = dict(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=4096,
               indexer_compress_ratio=4)
PLE = dict(ple_layer_ids=[1, 3], ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=101,
           make_ngram_vocab_size_divisible_by=8, split_ngram_parts=4, ple_conv_kernel_size=3)
KINDS = {
    "plain": dict(INDEXER),
    "ple": dict(INDEXER, **PLE, output_gate_type="sigmoid"),
    "qsa": dict(INDEXER, **PLE, indexer_budget=8),  # (PLE too: both per-request states together)
    "qsa-nople": dict(INDEXER, indexer_budget=8, indexer_compress_ratio=8),  # (ratio 8: two 4-token pages too)
}


_randomize = randomize_qwen4_exp  # (tests/gpu/test_qwen4_exp_cuda.py imports it from here)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (directory, transformers model in eval fp32)."""
    out = {}
    for i, (kind, extra) in enumerate(KINDS.items()):
        cfg = transformers.Qwen4ExpTextConfig(**COMMON, **extra)
        torch.manual_seed(300 + i)
        ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
        _randomize(ref, 400 + i)
        d = tmp_path_factory.mktemp(kind)
        ref.save_pretrained(d)
        out[kind] = (str(d), ref)
    return out


def _ours(path: str) -> Qwen4ExpForCausalLM:
    model = Qwen4ExpForCausalLM(transformers.AutoConfig.from_pretrained(path), torch.float32, 4096).eval()
    model.load_weights(safetensors_weights(path))
    return model


def _ref_logits(ref, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()


def _err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return (ours - ref).abs().max().item() / ref.abs().max().item()


def _seqs(seed: int, lengths: list[int], eos_at: tuple = ()) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(6, VOCAB, (n,), generator=g).tolist() for n in lengths]
    for i, p in eos_at:
        seqs[i][p] = EOS
    return seqs


# Each step lists (request, n tokens): chunked prefill beside decode rows, then decode batches.
SCHEDULE = [[(0, 7), (1, 1)], [(0, 20), (1, 12), (2, 30)], [(0, 1), (1, 25), (2, 1)],
            [(0, 1), (1, 1), (2, 1)], [(0, 1), (1, 1), (2, 1)], [(0, 1), (1, 1), (2, 1)]]


def _run_schedule(model, refs, seqs, tol: float = 2e-5) -> float:
    """The worst relative error over the schedule's logits (asserted <= tol unless tol is None)."""
    h = Harness(model, num_slots=3)
    done, worst = [0] * len(seqs), 0.0
    for step in SCHEDULE:
        outs = h.step([(f"r{i}", seqs[i], done[i], n) for i, n in step])
        for (i, n), o in zip(step, outs):
            worst = max(worst, _err(o, refs[i][done[i]:done[i] + n]))
            done[i] += n
    if tol is not None:
        assert worst <= tol, f"relative error {worst:.2e}"
    return worst


def _schedule_seqs(seed: int, eos_at: tuple = ()) -> list[list[int]]:
    totals = [0, 0, 0]
    for step in SCHEDULE:
        for i, n in step:
            totals[i] += n
    return _seqs(seed, totals, eos_at)


# ("qsa-nople": its indexer scores tie at 0 for both complete blocks of request 1's row 18; qsa.break_ties takes the
# first, as transformers' CPU top-k of those two values does)
@pytest.mark.parametrize("kind", ["plain", "ple", "qsa", "qsa-nople"])
def test_chunked_prefill_and_decode_match_transformers(checkpoints, kind):
    path, ref = checkpoints[kind]
    seqs = _schedule_seqs(1, eos_at=((0, 6), (1, 13), (1, 14), (2, 3)))
    refs = [_ref_logits(ref, s) for s in seqs]
    assert min(r.std().item() for r in refs) > 0.02  # not degenerate
    _run_schedule(_ours(path), refs, seqs)


def test_transformers_generate_with_cache_matches_its_no_cache_forward(checkpoints):
    """The reference's cached path (PLE context and conv states, QSA raw-key cache) agrees with its no-cache form."""
    for kind in ("qsa", "ple"):
        _, ref = checkpoints[kind]
        prompt = _seqs(2, [17], eos_at=((0, 9),))[0]
        with torch.no_grad():
            gen = ref.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                               pad_token_id=0)[0].tolist()
        seq = list(prompt)
        for _ in range(8):
            seq.append(_greedy(_ref_logits(ref, seq)[-1]))
        assert gen == seq, kind


def _greedy(logits: torch.Tensor) -> int:
    """argmax with the EOS masked, as transformers' min_new_tokens does."""
    logits = logits.clone()
    logits[EOS] = float("-inf")
    return int(logits.argmax())


@pytest.mark.parametrize("kind", ["ple", "qsa"])
def test_greedy_tokens_match_transformers(checkpoints, kind):
    """16 greedy tokens: our chunked prefill + decode steps vs transformers' generate (its cached path)."""
    path, ref = checkpoints[kind]
    prompt = _seqs(3, [19], eos_at=((0, 8),))[0]
    with torch.no_grad():
        gen = ref.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()
    h = Harness(_ours(path))
    tokens = list(prompt)
    h.step([("g", tokens, 0, 9)])
    logits = h.step([("g", tokens, 9, len(prompt) - 9)])[0]
    ours = []
    for _ in range(16):
        ours.append(_greedy(logits[-1]))
        tokens.append(ours[-1])
        logits = h.step([("g", tokens, len(tokens) - 1, 1)])[0]
    assert ours == gen


def test_ple_eos_reset_is_needed(checkpoints, monkeypatch):
    """Without the n-gram context reset after an EOS the logits leave transformers' by far more than the tolerance."""
    path, ref = checkpoints["ple"]
    seqs = _schedule_seqs(4, eos_at=((0, 6), (0, 30), (1, 13), (2, 3)))
    refs = [_ref_logits(ref, s) for s in seqs]
    model = _ours(path)
    assert _run_schedule(model, refs, seqs) <= 2e-5
    real = qwen4_exp_ple.NGramContext.__init__

    def no_reset(self, input_ids, qsl, slots, has_initial, state_ctx, ngram_size, eos):
        real(self, input_ids, qsl, slots, has_initial, state_ctx, ngram_size, eos=-1)  # no token is an EOS

    monkeypatch.setattr(qwen4_exp_ple.NGramContext, "__init__", no_reset)
    assert _run_schedule(model, refs, seqs, tol=None) > 1e-3


def test_ple_table_is_host_memory_and_shards_load(checkpoints):
    path, ref = checkpoints["ple"]
    model = _ours(path)
    for i in (0, 2):
        ple = model.layers[i].ple
        assert ple.table.device.type == "cpu" and ple.num_shards == 4
        want = ref.model.layers[i].ple.ple_embedding.ngram_embedding.weight
        assert torch.equal(ple.table, want)
    assert not any(p is model.layers[0].ple.table for p in model.parameters())
    with pytest.raises(ValueError, match="missing"):
        Qwen4ExpForCausalLM(transformers.AutoConfig.from_pretrained(path), torch.float32, 64).load_weights(
            (n, t) for n, t in safetensors_weights(path) if "layers.2.ple.ple_embedding.ngram_embedding.shard_3" not in
            n)


def test_qsa_selection_drops_blocks_and_matters(checkpoints, monkeypatch):
    """Contexts past budget + ratio really drop blocks (prompt chunks and decode rows alike take virtual tables);
    plain causal attention there leaves transformers' logits."""
    path, ref = checkpoints["qsa"]
    seqs = _schedule_seqs(5)
    refs = [_ref_logits(ref, s) for s in seqs]
    model = _ours(path)
    dropped = {"prompt": 0, "decode": 0}
    real = qsa_decode.virtual_tables

    def counting(scores, top_blocks, positions, block_tables, ratio, block_size):
        tables, lens, page = real(scores, top_blocks, positions, block_tables, ratio, block_size)
        rows = positions[:scores.shape[0]].long()
        # (prompt_selection hands one request's table to every row; decode_selection one table per sequence)
        kind = "prompt" if block_tables.stride(0) == 0 else "decode"
        dropped[kind] += int((lens.long() < rows + 1).sum())
        return tables, lens, page

    monkeypatch.setattr(qsa_decode, "virtual_tables", counting)
    assert _run_schedule(model, refs, seqs) <= 2e-5
    assert dropped["prompt"] > 20 and dropped["decode"] > 5, dropped  # rows attended to less than their context
    monkeypatch.setattr(qsa_decode, "virtual_tables", lambda scores, top, *a: real(scores, scores.shape[1], *a))
    assert _run_schedule(model, refs, seqs, tol=None) > 1e-3  # every complete block: plain causal attention


class _GraphLike:
    """The model as a CUDA-graph step sees it: pure-decode steps get their state slots as a device tensor (the
    capture's inputs), so QSA selects on the device for every row, whatever its context."""

    def __init__(self, model):
        self.model = model
        self.graph_steps = 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, ids, pos, ctx):
        if ctx.meta.is_pure_decode:
            ctx.extra["state_slots"] = torch.tensor(ctx.extra["state_slots"])
            self.graph_steps += 1
        return self.model(ids, pos, ctx)


@pytest.mark.parametrize("kind, block_size", [("qsa-nople", 16), ("qsa-nople", 4), ("plain", 16)])
def test_qsa_decode_rows_select_on_device_and_match_transformers(checkpoints, monkeypatch, kind, block_size):
    """Decode steps take the device selection (virtual block tables; pages of 16 and 4 tokens against a ratio of 8),
    graph-style for every context length (the "plain" budget: every block selected), and equal transformers;
    selecting everything instead leaves its logits where blocks are dropped."""
    from voltllm.model.models import qwen4_exp_qsa_decode as qsa_decode

    path, ref = checkpoints[kind]
    seqs = _schedule_seqs(9)
    refs = [_ref_logits(ref, s) for s in seqs]
    model = _GraphLike(_ours(path))
    lens = []
    real = qsa_decode.decode_selection

    def counting(*args, **kwargs):
        vmeta, page = real(*args, **kwargs)
        lens.extend(vmeta.seq_lens_cpu)
        return vmeta, page

    monkeypatch.setattr(qsa_decode, "decode_selection", counting)
    init = Harness.__init__
    monkeypatch.setattr(Harness, "__init__", lambda self, m, num_slots=4: init(self, m, block_size, 512, num_slots))
    assert _run_schedule(model, refs, seqs) <= 2e-5
    decode_steps = sum(all(n == 1 for _, n in step) for step in SCHEDULE)
    assert model.graph_steps == decode_steps and len(lens) == 3 * decode_steps  # one indexed layer, 3 rows
    if kind == "plain":
        assert min(lens) > 16  # whole contexts
        return
    assert max(lens) <= 8 + 7  # budget + tail only
    monkeypatch.setattr(qsa_decode, "virtual_tables", lambda scores, k, pos, tables, r, bs: (
        tables, pos[:tables.shape[0]].int() + 1, bs))  # every past token: plain causal attention
    assert _run_schedule(_GraphLike(_ours(path)), refs, seqs, tol=None) > 1e-3


def test_injection_weights_matter(checkpoints, monkeypatch):
    path, ref = checkpoints["plain"]
    seqs = _schedule_seqs(6)
    refs = [_ref_logits(ref, s) for s in seqs]
    model = _ours(path)
    monkeypatch.setattr(qwen4_exp.GatedResidual, "inject", staticmethod(
        lambda h, out, w: h + out.repeat(1, w.shape[1])))
    assert _run_schedule(model, refs, seqs, tol=None) > 1e-3


def test_multimodal_wrapper_loads_as_text(checkpoints):
    """A qwen4_exp checkpoint (text_config inside): model.language_model.* names; model.visual.*, mtp.* skipped."""
    from voltllm.model.models.registry import build_model

    path, ref = checkpoints["ple"]
    text = transformers.AutoConfig.from_pretrained(path)
    wrapper = transformers.Qwen4ExpConfig(text_config=text.to_dict())
    assert wrapper.model_type == "qwen4_exp"
    model = build_model(wrapper, torch.float32, 4096).eval()
    assert isinstance(model, Qwen4ExpForCausalLM) and model.config.model_type == "qwen4_exp_text"
    renamed = [(n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n, t)
               for n, t in safetensors_weights(path)]
    renamed += [("model.visual.blocks.0.attn.qkv.weight", torch.zeros(3)), ("mtp.fc.weight", torch.zeros(2))]
    model.load_weights(iter(renamed))
    seq = _seqs(7, [30], eos_at=((0, 11),))[0]
    out = Harness(model).step([("a", seq, 0, 30)])[0]
    assert _err(out, _ref_logits(ref, seq)) <= 2e-5


def test_state_spec_extras_and_kv_layout(checkpoints):
    from voltllm.model.state_cache import StateCache

    ple_model = _ours(checkpoints["ple"][0])
    spec = ple_model.state_spec
    assert spec["extras"]["ple_ctx"] == ((2,), torch.long)
    assert spec["extras"]["ple_conv"] == ((2, 6, 128), torch.float32)
    assert StateCache.bytes_per_slot(spec) == 3 * (3 * 128 * 4 + 4 * 16 * 16 * 4) + 2 * 8 + 2 * 6 * 128 * 4
    assert ple_model.supports_cuda_graphs  # (PLE gathers on the device: tests/model/test_qwen4_exp_ple_graphs.py)
    qsa = _ours(checkpoints["qsa"][0])
    # one attention layer; its raw keys (32 channels) packed into one more cache of rows 2 x 32
    assert qsa.num_attention_layers == 2 and qsa.kv_heads_and_dim == (2, 32)
    assert qsa.eager_step([5, 11]) is False and qsa.eager_step([12]) is True
    # decode rows past the budget select on the device (CUDA graphs); prompt rows past it take the torch path
    assert qsa.eager_step([12, 300], [1, 1]) is False and qsa.eager_step([5, 12], [5, 1]) is False
    assert qsa.eager_step([12, 5], [2, 1]) is True
    cache = StateCache.from_spec(spec, 2)
    cache.extra["ple_ctx"][0].fill_(7)
    cache.copy_slot(0, 1)
    assert cache.extra["ple_ctx"][1].tolist() == [7, 7]
    assert cache.like(3, "cpu").extra["ple_conv"].shape == (4, 2, 6, 128)


def test_engine_greedy_with_preemption_and_prefix_cache(checkpoints):
    """Through the whole engine (scheduler, state slots with the PLE extras, QSA keys in KV blocks, chunked prefill,
    preemption, prefix-cache snapshots): greedy tokens equal transformers' generate."""
    from voltllm import LLM, SamplingParams

    path, ref = checkpoints["qsa"]
    prompts = _seqs(8, [37, 5, 26, 18], eos_at=((0, 12), (2, 20)))
    llm = LLM(path, skip_tokenizer_init=True, block_size=4, max_num_batched_tokens=16, num_gpu_blocks_override=30,
              mamba_block_size=8)
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=10)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.stats().num_preemptions > 0
    expected = []
    for p in prompts:
        with torch.no_grad():
            expected.append(ref.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                                         pad_token_id=0)[0, len(p):].tolist())
    assert [o.outputs[0].token_ids for o in outs] == expected
    snaps = llm.engine.runner.state_snapshots
    assert llm.generate([{"prompt_token_ids": prompts[2]}], params)[0].outputs[0].token_ids == expected[2]
    restored = snaps.stats()["restored"]
    again = llm.generate([{"prompt_token_ids": prompts[2]}], params)  # a prefix-cache hit restores a snapshot
    assert snaps.stats()["restored"] > restored
    assert again[0].outputs[0].token_ids == expected[2]
    llm.engine.check_integrity()


@pytest.mark.parametrize("kwargs, what", [(dict(speculative_config={"method": "mtp", "num_speculative_tokens": 2}),
                                           "MTP speculation")])
def test_unbuilt_features_are_refused(checkpoints, kwargs, what):
    from voltllm import LLM
    from voltllm.config import ConfigError

    with pytest.raises(ConfigError, match=what):
        LLM(checkpoints["qsa"][0], skip_tokenizer_init=True, **kwargs)


def test_index_keys_keep_the_model_dtype_in_an_fp8_cache():
    """An fp8 KV cache (uint8) holds QSA's index keys as their fp16 bytes: half as many per row, so more extra caches;
    every entry reads back exactly what was written, and writing one entry leaves the others alone."""
    from voltllm.model.models.qwen4_exp_qsa import IndexKeyStore

    half = IndexKeyStore(6, 6, 2, 32, 16, row_bytes_per_value=2)
    whole = IndexKeyStore(6, 6, 2, 32, 16)
    assert (half.per_plane, whole.per_plane) == (2, 4) and (half.num_caches, whole.num_caches) == (3, 2)
    caches = [torch.zeros(2, 5, 4, 2, 32, dtype=torch.uint8) for _ in range(6 + half.num_caches)]
    written = {}
    g = torch.Generator().manual_seed(3)
    for j in range(6):
        for (c, plane, off) in half.place(j):
            rows = IndexKeyStore.view(caches[c], plane, off, 16, torch.float16)
            assert rows.shape == (20, 16) and rows.dtype == torch.float16
            vals = torch.randn(20, 16, generator=g).half()
            rows.copy_(vals)
            written[(c, plane, off)] = vals
    for (c, plane, off), vals in written.items():
        assert torch.equal(IndexKeyStore.view(caches[c], plane, off, 16, torch.float16), vals)
    assert all(int(caches[i].count_nonzero()) == 0 for i in range(6))  # (the attention layers' own caches)
    with pytest.raises(ValueError, match="fp8 cache's one-byte elements, 4 per key value"):
        IndexKeyStore(6, 6, 2, 32, 32, row_bytes_per_value=4)


def test_fp8_kv_cache_serves_qsa(checkpoints, monkeypatch):
    """--kv-cache-dtype fp8_e4m3 on a QSA model (fp16, CPU): contexts past the budget still drop blocks (prompt chunks
    and decode rows), and the tokens' logprobs stay within fp8's error of the fp16 cache's run."""
    from voltllm import LLM, SamplingParams

    path, _ = checkpoints["qsa"]
    prompts = _seqs(9, [37, 26])
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, logprobs=0)
    real = qsa_decode.virtual_tables
    dropped = []

    def counting(scores, top_blocks, positions, block_tables, ratio, block_size):
        tables, lens, page = real(scores, top_blocks, positions, block_tables, ratio, block_size)
        dropped.append(int((lens.long() < positions[:scores.shape[0]].long() + 1).sum()))
        return tables, lens, page

    monkeypatch.setattr(qsa_decode, "virtual_tables", counting)
    runs = {}
    for kv in ("auto", "fp8_e4m3"):
        dropped.clear()
        llm = LLM(path, skip_tokenizer_init=True, dtype="float16", kv_cache_dtype=kv, block_size=4,
                  max_num_batched_tokens=16)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert sum(dropped) > 10, kv
        if kv != "auto":
            assert llm.engine.runner.kv_caches[0].dtype == torch.uint8
            assert llm.engine.runner.model.index_store.per_plane == 1  # (2 x 32 bytes a row: one 32-channel key)
        runs[kv] = [(o.outputs[0].token_ids, [d[t].logprob for t, d in zip(o.outputs[0].token_ids,
                                                                             o.outputs[0].logprobs)]) for o in outs]
        llm.engine.check_integrity()
    for (toks_a, lps_a), (toks_b, lps_b) in zip(runs["auto"], runs["fp8_e4m3"]):
        assert toks_a[0] == toks_b[0]
        assert abs(lps_a[0] - lps_b[0]) < 0.1


def test_fp8_kv_scales_in_the_checkpoint_are_loaded(checkpoints, tmp_path):
    """An fp8 checkpoint's KV-cache scales (self_attn.k_scale / v_scale, as vLLM and ModelOpt name them) reach the
    indexed attention layers, as on the other hybrids."""
    import glob
    import shutil

    from safetensors.torch import load_file, save_file

    from voltllm import LLM

    src = checkpoints["qsa"][0]
    path = str(tmp_path / "scaled")
    shutil.copytree(src, path)
    (file,) = glob.glob(f"{path}/*.safetensors")
    weights = load_file(file)
    layer = next(int(k.split(".layers.")[1].split(".")[0]) for k in weights if ".self_attn.q_proj." in k)
    prefix = next(k for k in weights if f".layers.{layer}.self_attn.q_proj." in k).split(".self_attn.")[0]
    weights[f"{prefix}.self_attn.k_scale"] = torch.tensor(0.5)
    weights[f"{prefix}.self_attn.v_scale"] = torch.tensor(0.25)
    save_file(weights, file, metadata={"format": "pt"})
    llm = LLM(path, skip_tokenizer_init=True, dtype="float16", kv_cache_dtype="fp8_e4m3", block_size=4,
              max_num_batched_tokens=16)
    attn = llm.engine.runner.model.layers[layer].self_attn
    assert (float(attn.k_scale), float(attn.v_scale)) == (0.5, 0.25)
    assert attn.checkpoint_kv_scales == {"k_scale", "v_scale"}
