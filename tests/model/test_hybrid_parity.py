"""Hybrid models (Qwen3.5, Qwen3-Next, Qwen3.5-MoE) vs transformers on tiny random checkpoints, fp32 CPU.

Our model runs through a small harness of its own (paged KV cache + TorchReferenceBackend + StateCache),
batched over requests of different lengths, one-shot and in chunks followed by decode steps: the logits
of every step must equal the matching rows of transformers' full-sequence forward.
"""
from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from voltllm.attention.backend import AttentionMetadata, make_kv_cache  # noqa: E402
from voltllm.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from voltllm.model.forward_context import ForwardContext  # noqa: E402
from voltllm.model.loader.safetensors_loader import safetensors_weights  # noqa: E402
from voltllm.model.models.qwen3_next import (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM,  # noqa: E402
                                              Qwen3NextForCausalLM)
from voltllm.model.state_cache import StateCache  # noqa: E402

VOCAB = 192
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, intermediate_size=96, max_position_embeddings=4096,
              initializer_range=0.08, rms_norm_eps=1e-6)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def _config(kind: str):
    if kind == "qwen3_5":
        return transformers.Qwen3_5TextConfig(**COMMON)
    if kind == "qwen3_next":
        # layer 1 dense (mlp_only_layers) to cover the mixed MoE/dense case
        return transformers.Qwen3NextConfig(**COMMON, **MOE, mlp_only_layers=[1])
    if kind == "qwen3_5_moe":
        cls = getattr(transformers, "Qwen3_5MoeTextConfig", None)
        if cls is None:
            pytest.skip("this transformers has no Qwen3_5MoeTextConfig")
        return cls(**COMMON, **MOE)
    raise ValueError(kind)


OUR_CLASS = {"qwen3_5": Qwen3_5ForCausalLM, "qwen3_next": Qwen3NextForCausalLM, "qwen3_5_moe": Qwen3_5MoeForCausalLM}
KINDS = list(OUR_CLASS)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Make the random checkpoint non-degenerate: norm weights off zero, slow-ish decays (so the recurrent
    state carries across chunks), varied dt_bias."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.02, 0.6, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.4)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (directory, transformers model in eval fp32)."""
    out = {}
    for i, kind in enumerate(KINDS):
        try:
            cfg = _config(kind)
        except pytest.skip.Exception:
            continue
        torch.manual_seed(100 + i)
        ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
        _randomize(ref, 200 + i)
        d = tmp_path_factory.mktemp(kind)
        ref.save_pretrained(d)
        out[kind] = (str(d), ref)
    return out


def _ours(kind: str, path: str, max_positions: int = 4096):
    cfg = transformers.AutoConfig.from_pretrained(path)
    model = OUR_CLASS[kind](cfg, torch.float32, max_positions).eval()
    model.load_weights(safetensors_weights(path))
    return model


def _ref_logits(ref, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()


def _close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 2e-4) -> None:
    err = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= rel * scale, f"max abs diff {err:.3e} vs max |ref| {scale:.3e}"


class Harness:
    """Drives a model the way the runner does: paged KV (TorchReferenceBackend) + state slots."""

    def __init__(self, model, block_size: int = 16, num_blocks: int = 512, num_slots: int = 4):
        self.model = model
        self.bs = block_size
        heads, dim = model.kv_heads_and_dim
        self.kv = make_kv_cache(model.num_attention_layers, num_blocks, block_size, heads, dim, torch.float32,
                                torch.device("cpu"))
        self.free_blocks = list(range(num_blocks))[::-1]
        self.states = StateCache.for_model(model, num_slots, "cpu")
        self.blocks: dict[str, list[int]] = {}
        self.backend = TorchReferenceBackend()

    def release(self, rid: str) -> None:
        self.free_blocks.extend(self.blocks.pop(rid, []))
        self.states.free(rid)

    @torch.no_grad()
    def step(self, work: list[tuple[str, list[int], int, int]]) -> list[torch.Tensor]:
        """work: (request id, all its tokens, start, n) -> logits [n, V] per request."""
        ids, pos, slots_map, qsl, seq_lens, tables, state_slots = [], [], [], [0], [], [], []
        for rid, tokens, start, n in work:
            blocks = self.blocks.setdefault(rid, [])
            while len(blocks) * self.bs < start + n:
                blocks.append(self.free_blocks.pop())
            state_slots.append(self.states.allocate(rid))
            ids.extend(tokens[start:start + n])
            for p in range(start, start + n):
                pos.append(p)
                slots_map.append(blocks[p // self.bs] * self.bs + p % self.bs)
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            tables.append(blocks)
        width = max(len(t) for t in tables)
        table = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        meta = AttentionMetadata(
            num_tokens=len(ids), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=table,
            slot_mapping=torch.tensor(slots_map, dtype=torch.int64),
            max_query_len=max(qsl[i + 1] - qsl[i] for i in range(len(work))), max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
        ctx = ForwardContext(meta=meta, kv_caches=self.kv, backend=self.backend,
                             extra={"state_cache": self.states, "state_slots": state_slots})
        hidden = self.model(torch.tensor(ids), torch.tensor(pos), ctx)
        logits = self.model.compute_logits(hidden)
        return [logits[qsl[i]:qsl[i + 1]] for i in range(len(work))]


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("kind", KINDS)
def test_one_shot_batched_prefill(checkpoints, kind):
    if kind not in checkpoints:
        pytest.skip(f"{kind} not available in this transformers")
    path, ref = checkpoints[kind]
    model = _ours(kind, path)
    assert model.num_attention_layers == 1 and model.state_spec["num_layers"] == 3
    prompts = _prompts(1, [23, 70, 9])
    h = Harness(model)
    outs = h.step([(f"r{i}", p, 0, len(p)) for i, p in enumerate(prompts)])
    for p, o in zip(prompts, outs):
        r = _ref_logits(ref, p)
        assert r.std() > 0.05  # not degenerate
        _close(o, r)


# Each step lists (request index, n tokens); requests start when first listed. The last steps are pure
# decode batches; one of them holds a request at its very first token (no initial state, decode path).
SCHEDULE = [
    [(0, 5), (1, 1)],
    [(0, 1), (1, 17), (2, 30)],
    [(0, 40), (1, 2), (2, 1)],
    [(0, 1), (1, 1), (2, 1), (3, 1)],
    [(0, 1), (1, 21), (2, 3), (3, 1)],
    [(0, 1), (1, 1), (2, 1), (3, 1)],
    [(0, 1), (1, 1), (2, 1), (3, 1)],
    [(0, 1), (1, 1), (2, 1)],
]


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_then_decode(checkpoints, kind):
    if kind not in checkpoints:
        pytest.skip(f"{kind} not available in this transformers")
    path, ref = checkpoints[kind]
    model = _ours(kind, path)
    totals = [0] * 4
    for step in SCHEDULE:
        for i, n in step:
            totals[i] += n
    seqs = _prompts(2, totals)
    refs = [_ref_logits(ref, s) for s in seqs]
    h = Harness(model, num_slots=4)
    done = [0] * 4
    for step in SCHEDULE:
        work = [(f"r{i}", seqs[i], done[i], n) for i, n in step]
        outs = h.step(work)
        for (i, n), o in zip(step, outs):
            _close(o, refs[i][done[i]:done[i] + n])
            done[i] += n
    h.states.check_integrity()
    # preemption: request 1 restarts from token 0 in a reused slot (stale state there) and must match again
    h.release("r1")
    h.release("r0")
    out = h.step([("r1-again", seqs[1], 0, 9), ("r0-again", seqs[0], 0, 1)])
    _close(out[0], refs[1][:9])
    _close(out[1], refs[0][:1])
    out = h.step([("r1-again", seqs[1], 9, len(seqs[1]) - 9), ("r0-again", seqs[0], 1, 1)])
    _close(out[0], refs[1][9:])
    _close(out[1], refs[0][1:2])


def test_long_prompt_2000_tokens(checkpoints):
    path, ref = checkpoints["qwen3_5"]
    model = _ours("qwen3_5", path)
    seq = _prompts(3, [2000])[0]
    r = _ref_logits(ref, seq)
    h = Harness(model, num_blocks=300)
    outs = []
    for start, n in [(0, 777), (777, 1000), (1777, 223)]:  # uneven chunks, not chunk-size aligned
        outs.append(h.step([("long", seq, start, n)])[0])
    _close(torch.cat(outs), r)


def test_greedy_tokens_match_generate(checkpoints):
    """32 greedy tokens: our chunked prefill + decode steps vs transformers' generate (its recurrent path)."""
    path, ref = checkpoints["qwen3_next"]
    model = _ours("qwen3_next", path)
    prompt = _prompts(4, [19])[0]
    with torch.no_grad():
        gen = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                           max_new_tokens=32, do_sample=False, min_new_tokens=32,
                           pad_token_id=VOCAB)[0, len(prompt):].tolist()
    h = Harness(model)
    tokens = list(prompt)
    logits = h.step([("g", tokens, 0, 12)])[0]
    logits = h.step([("g", tokens, 12, len(prompt) - 12)])[0]
    ours = []
    for _ in range(32):
        tok = int(logits[-1].argmax())
        ours.append(tok)
        tokens.append(tok)
        logits = h.step([("g", tokens, len(tokens) - 1, 1)])[0]
    assert ours == gen


def test_multimodal_names_and_tied_head(checkpoints):
    """A Qwen3.5 multimodal checkpoint's text part: model.language_model.* names, visual/mtp skipped."""
    path, _ = checkpoints["qwen3_5"]
    plain = _ours("qwen3_5", path)
    cfg = transformers.AutoConfig.from_pretrained(path)
    renamed = []
    for name, t in safetensors_weights(path):
        renamed.append((name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name, t))
    renamed += [("model.visual.blocks.0.attn.qkv.weight", torch.zeros(3)), ("mtp.fc.weight", torch.zeros(2))]
    mm = Qwen3_5ForCausalLM(cfg, torch.float32, 64)
    mm.load_weights(iter(renamed))
    for (n1, p1), (n2, p2) in zip(plain.named_parameters(), mm.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    with pytest.raises(ValueError, match="missing"):
        Qwen3_5ForCausalLM(cfg, torch.float32, 64).load_weights(
            (n, t) for n, t in safetensors_weights(path) if "in_proj_a" not in n)


def test_resume_without_state_raises(checkpoints):
    """A request that starts at token 16 (as after a prefix-cache hit) in a fresh slot must not run."""
    path, _ = checkpoints["qwen3_5"]
    h = Harness(_ours("qwen3_5", path))
    seq = _prompts(5, [40])[0]
    h.step([("a", seq, 0, 16)])
    with pytest.raises(RuntimeError, match="covers 0 tokens"):
        h.step([("hit", seq, 16, 4)])
    with pytest.raises(RuntimeError, match="covers 16 tokens"):
        h.step([("a", seq, 20, 4)])  # skipping tokens 16..19


def test_padding_rows_and_profiling_forward(checkpoints):
    """Slot -1 rows (CUDA-graph padding) leave real slots alone; a forward without state info (memory
    profiling) runs when nothing resumes, and raises when something does."""
    path, ref = checkpoints["qwen3_5"]
    model = _ours("qwen3_5", path)
    seq = _prompts(6, [12])[0]
    r = _ref_logits(ref, seq)
    h = Harness(model)
    h.step([("a", seq, 0, 11)])
    slot = h.states.slot_of("a")
    meta = AttentionMetadata(num_tokens=1, query_start_loc=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
                             seq_lens=torch.tensor([12, 1, 1], dtype=torch.int32),
                             block_tables=torch.tensor([h.blocks["a"], [0], [0]], dtype=torch.int32),
                             slot_mapping=torch.tensor([h.blocks["a"][0] * 16 + 11, -1, -1]), max_query_len=1,
                             max_seq_len=12, query_start_loc_cpu=[0, 1, 2, 3], seq_lens_cpu=[12, 1, 1])
    ctx = ForwardContext(meta=meta, kv_caches=h.kv, backend=h.backend,
                         extra={"state_cache": h.states, "state_slots": [slot, -1, -1]})
    with torch.no_grad():
        logits = model.compute_logits(model(torch.tensor([seq[11], 0, 0]), torch.tensor([11, 0, 0]), ctx))
    _close(logits[:1], r[11:12])
    # profiling-style forward: fresh KV, no extra
    kv = make_kv_cache(1, 4, 16, *model.kv_heads_and_dim, torch.float32, torch.device("cpu"))
    meta = AttentionMetadata(num_tokens=12, query_start_loc=torch.tensor([0, 12], dtype=torch.int32),
                             seq_lens=torch.tensor([12], dtype=torch.int32),
                             block_tables=torch.tensor([[0]], dtype=torch.int32), slot_mapping=torch.arange(12),
                             max_query_len=12, max_seq_len=12, query_start_loc_cpu=[0, 12], seq_lens_cpu=[12])
    with torch.no_grad():
        out = model.compute_logits(model(torch.tensor(seq), torch.arange(12), ForwardContext(meta, kv, h.backend)))
    _close(out, r)
    meta.seq_lens_cpu = [13]
    with pytest.raises(RuntimeError, match="state_cache"):
        model(torch.tensor(seq), torch.arange(1, 13), ForwardContext(meta, kv, h.backend))


def test_state_spec_and_slot_bytes(checkpoints):
    path, _ = checkpoints["qwen3_5"]
    model = _ours("qwen3_5", path)
    spec = model.state_spec
    assert spec["conv_shape"] == (3, 2 * 32 + 64) and spec["ssm_shape"] == (4, 16, 16)
    per_layer = 3 * 128 * 4 + 4 * 16 * 16 * 4
    assert StateCache.bytes_per_slot(spec) == 3 * per_layer
    assert math.prod(model.kv_heads_and_dim) == 2 * 32


@pytest.mark.parametrize("kind", KINDS)
def test_engine_greedy_with_chunking_preemption_async(checkpoints, kind):
    """Through the whole engine (scheduler, state slots, async scheduling): 24 greedy tokens per request equal
    transformers' generate, with tiny chunks and a KV budget small enough to force preemption."""
    if kind not in checkpoints:
        pytest.skip(f"{kind} unavailable")
    from voltllm import LLM, SamplingParams

    path, ref = checkpoints[kind]
    prompts = _prompts(7, [37, 5, 60, 18])
    llm = LLM(path, skip_tokenizer_init=True, block_size=4, max_num_batched_tokens=16, num_gpu_blocks_override=30)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, min_tokens=24))
    assert llm.engine.stats().num_preemptions > 0
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p])
        exp = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                           do_sample=False)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == exp
    llm.engine.check_integrity()
    assert llm.engine.kv.usage() == 0.0
