"""LoRA adapters in the engine (CPU, tiny random models and adapters): every request's greedy tokens and logprobs equal
transformers' with the adapter merged into the base weights (W + scaling * B A), whatever the batch mixes (other
adapters, none, chunked prefill, preemption, the decode / prompt graph forms' padding); the prefix cache is never
shared across adapters or with the base model; --max-loras / --max-cpu-loras bound the adapters in a batch / in CPU
memory; bad adapters and requests are refused."""
from __future__ import annotations

import functools

import pytest
import torch

from lora_adapters import make_adapter, merged_model
from tiny_models import make_model
from voltllm import LLM, LoRARequest, SamplingParams
from voltllm.engine.request_checks import InvalidRequestError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["The quick brown fox jumps over", "What is the capital of France? The capital",
           "def add(a, b):\n    return", "Hello world! Voltllm serves language models on old GPUs, fast.",
           "0123456789 0123", "Paris"]


# name -> make_adapter's arguments: all projections, rsLoRA on a few, some layers only (ranks below --max-lora-rank 8)
ADAPTERS = {"a1": dict(rank=8, alpha=16, seed=1),
            "a2": dict(rank=4, alpha=8, seed=2, rslora=True, targets=("q_proj", "v_proj", "down_proj")),
            "a3": dict(rank=2, alpha=4, seed=3, targets=("k_proj", "o_proj", "gate_proj", "up_proj"), layers=[0, 2])}


class Setup:
    def __init__(self, root, kind="llama", adapters=None):
        self.model = make_model(f"{root}/{kind}", kind)
        self.paths = {name: make_adapter(f"{root}/{kind}-{name}", self.model, **kw)
                      for name, kw in (adapters or ADAPTERS).items()}
        self.requests = {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(self.paths.items(), 1)}

    def lora(self, name):
        return None if name is None else self.requests[name]

    @functools.lru_cache(maxsize=None)
    def reference(self, name):
        return merged_model(self.model, None if name is None else self.paths[name])

    def greedy(self, name, ids, n):
        with torch.no_grad():
            out = self.reference(name).generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                                min_new_tokens=n)
        return out[0, len(ids):].tolist()

    def llm(self, **kw):
        kw = {"device": "cpu", "enable_lora": True, "max_loras": 3, "max_lora_rank": 8, "block_size": 4,
              "num_gpu_blocks_override": 256, **kw}
        return LLM(self.model, **kw)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return Setup(str(tmp_path_factory.mktemp("lora")))


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _check_greedy(setup, llm, names, prompts=PROMPTS, params=GREEDY):
    """Every request against transformers' merged reference; the outputs."""
    tok = llm.get_tokenizer()
    outs = llm.generate(prompts, params, lora_request=[setup.lora(n) for n in names], use_tqdm=False)
    for prompt, name, out in zip(prompts, names, outs):
        ids = tok.encode(prompt)
        assert out.outputs[0].token_ids == setup.greedy(name, ids, params.max_tokens), (prompt, name)
    llm.engine.check_integrity()
    return outs


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_tokens_and_logprobs_match_the_merged_model(tmp_path, kind):
    """A batch of the base model and three adapters (q / k / v and gate / up land in merged projections' slices; ranks
    below --max-lora-rank padded; rsLoRA scaling): greedy tokens, their logprobs and every prompt position's full
    distribution equal transformers' with each adapter merged."""
    s = Setup(str(tmp_path), kind)
    llm = s.llm()
    vocab = llm.config.model.hf_config.vocab_size
    names = [None, "a1", "a2", "a3"]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1, prompt_logprobs=vocab)
    outs = _check_greedy(s, llm, names, PROMPTS[:4], params)
    tok = llm.get_tokenizer()
    for prompt, name, out in zip(PROMPTS, names, outs):
        ids = tok.encode(prompt)
        full = ids + list(out.outputs[0].token_ids)
        with torch.no_grad():
            ref = s.reference(name)(torch.tensor([full])).logits[0].log_softmax(-1)
        for pos in range(1, len(ids)):
            ours = torch.tensor([out.prompt_logprobs[pos][t].logprob for t in range(vocab)])
            assert torch.allclose(ours, ref[pos - 1], atol=1e-4), (name, pos)
        for j, (tid, lp) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
            assert lp[tid].logprob == pytest.approx(ref[len(ids) + j - 1, tid].item(), abs=1e-4)
    base = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)]
    assert base[1:] != [o.outputs[0].token_ids for o in outs[1:]]  # (the adapters change the output)


def test_a_mixed_batch_with_chunked_prefill_gives_each_request_its_result_alone(setup):
    """Adapters and the base model mixed in one running batch, prompts prefilled in chunks of a small token budget
    beside decoding requests: each request's tokens are its own reference's."""
    llm = setup.llm(max_num_batched_tokens=16, max_num_seqs=6)
    _check_greedy(setup, llm, [None, "a1", "a2", "a1", None, "a3"])
    # sampled requests with seeds repeat whatever their batch (their adapter's distribution)
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], sampled, lora_request=setup.lora("a2"), use_tqdm=False)[0]
    mixed = llm.generate(PROMPTS[:3], sampled, lora_request=[setup.lora("a1"), setup.lora("a2"), None],
                         use_tqdm=False)[1]
    assert mixed.outputs[0].token_ids == alone.outputs[0].token_ids


def test_the_prefix_cache_is_not_shared_across_adapters(setup):
    llm = setup.llm()
    prompt = PROMPTS[3]  # 20+ tokens: several full blocks of 4
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def run(name):
        out = llm.generate(prompt, params, lora_request=setup.lora(name), use_tqdm=False)[0]
        ids = llm.get_tokenizer().encode(prompt)
        assert out.outputs[0].token_ids == setup.greedy(name, ids, 4), name
        return out.num_cached_tokens

    assert run("a1") == 0
    assert run(None) == 0  # the base model does not read a1's blocks
    assert run("a2") == 0
    assert run("a1") > 0 and run(None) > 0 and run("a2") > 0  # each reads its own


def test_max_loras_bounds_the_adapters_of_a_batch(setup):
    """--max-loras 1: requests of another adapter wait (passed over, not blocking base-model requests) until the
    running one's finish; the one slot is reloaded as adapters come and go; preemption (few KV blocks) keeps outputs."""
    llm = setup.llm(max_loras=1, max_num_seqs=4, num_gpu_blocks_override=10)
    manager = llm.engine.runner.lora
    seen: list[set] = []
    assign = manager._assign
    manager._assign = lambda names, loads: seen.append(set(names)) or assign(names, loads)
    names = ["a1", "a2", None, "a1", "a3", None]
    _check_greedy(setup, llm, names)
    assert max(len(s) for s in seen) == 1 and {k.name for s in seen for k in s} == {"a1", "a2", "a3"}
    assert llm.engine.scheduler.num_preemptions > 0


def test_max_cpu_loras_drops_unused_adapters_and_reads_them_again(setup):
    llm = setup.llm(max_loras=1, max_cpu_loras=1)
    manager = llm.engine.runner.lora
    for name in ("a1", "a2", "a1", "a3"):
        _check_greedy(setup, llm, [name, None], PROMPTS[:2])
        assert [k.name for k in manager.cached()] == [name]
    # adapters of live requests are kept even beyond the limit (one batch of three adapters, one slot)
    _check_greedy(setup, llm, ["a1", "a2", "a3"], PROMPTS[:3])


class _GraphStandIns:
    """CPU stand-ins for the decode and prompt CUDA graphs: what a replay computes (the forward over the padded rows /
    tokens the runner laid out), with the LoRA terms always computed, as a captured graph does whatever the step
    holds (tokens without an adapter: an all-zero mask row)."""

    def __init__(self, runner):
        self.runner = runner
        self.decode_replays = self.prompt_replays = 0

    # DecodeGraphs
    def for_batch(self, n):
        bs = 1 << (n - 1).bit_length()
        return _Pass(self, bs, None) if bs <= 8 else None

    # PromptGraphs
    def for_tokens(self, n):
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
        r.lora.batch.active = True
        if self.batch_size is not None:
            self.owner.decode_replays += 1
            bs = self.batch_size
            lens = buf.seq_lens[:bs].tolist()
            meta = AttentionMetadata(
                num_tokens=bs, query_start_loc=buf.query_start_loc[:bs + 1], seq_lens=buf.seq_lens[:bs],
                block_tables=buf.block_tables[:bs], slot_mapping=buf.slot_mapping[:bs], max_query_len=1,
                max_seq_len=max(lens), query_start_loc_cpu=list(range(bs + 1)), seq_lens_cpu=lens)
            return r.model(buf.input_ids[:bs], buf.positions[:bs], ForwardContext(meta, r.kv_caches, r.backend))
        self.owner.prompt_replays += 1
        t = self.num_tokens
        return r.model(buf.input_ids[:t], buf.positions[:t], ForwardContext(meta, r.kv_caches, backend))


def test_the_graph_forms_read_the_mask_of_each_step(setup):
    """Decode and prompt steps replayed through graph stand-ins (padded rows / tokens, LoRA computed for every row):
    adapter, base-only and mixed steps give the reference tokens, so the mask each step uploads is whole (padding
    and rows a previous step left set are zero)."""
    llm = setup.llm(max_num_seqs=8, max_num_batched_tokens=64)
    runner = llm.engine.runner
    runner.graphs = runner.prompt_graphs = stand_ins = _GraphStandIns(runner)
    _check_greedy(setup, llm, ["a1", "a2", None, "a3", "a1"], PROMPTS[:5])
    _check_greedy(setup, llm, [None, None, None], PROMPTS[:3])  # after steps with adapters: an all-zero mask
    _check_greedy(setup, llm, [None, "a2"], PROMPTS[:2])
    assert stand_ins.decode_replays > 10 and stand_ins.prompt_replays >= 3


def test_ngram_speculation_keeps_each_adapters_tokens(setup):
    llm = setup.llm(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                        "prompt_lookup_min": 1})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["0123456789 0123456789 0123", "The quick brown fox jumps over the lazy dog. The quick brown"] * 2
    _check_greedy(setup, llm, ["a1", "a2", None, "a3"], prompts, params)
    assert llm.engine.scheduler.num_draft_tokens > 0


def _drafter(setup, root, method):
    """A device drafter for the llama target: a draft model (the base checkpoint itself), or a tiny random EAGLE-1
    head or DFlash drafter of its width and vocabulary (an EAGLE-3 head runs as EAGLE-1's, MTPRunner, reading the
    target's layers as DFlash does; its fc needs three of them, more than this target has)."""
    import json

    from dflash_models import make_dflash
    from eagle1_models import make_eagle1

    with open(f"{setup.model}/config.json") as f:
        cfg = json.load(f)
    hidden, vocab, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    return {"draft_model": lambda: setup.model,
            "eagle": lambda: make_eagle1(f"{root}/e1", hidden, vocab),
            "dflash": lambda: make_dflash(f"{root}/df", hidden, vocab, layers, [0, layers - 1])}[method]()


@pytest.mark.parametrize("method", ["draft_model", "eagle", "dflash"])
def test_device_drafters_keep_each_adapters_tokens(setup, tmp_path, method):
    """A drafter runs without the request's adapter (a draft model on its own weights; the heads and DFlash on the
    target's hidden states, which carry the adapter, with their own layers plain): its drafts are only proposals, and
    the verification with the adapter keeps every request's greedy tokens the merged reference's, in a batch mixing
    adapters and the base model; seeded sampled requests repeat."""
    spec = {"method": method, "model": _drafter(setup, str(tmp_path), method), "num_speculative_tokens": 3}
    llm = setup.llm(speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["0123456789 0123456789 0123", "The quick brown fox jumps over the lazy dog. The quick brown",
               "def add(a, b):\n    return a + b\n\ndef", "Paris"]
    _check_greedy(setup, llm, ["a1", None, "a2", "a3"], prompts, params)
    assert llm.engine.stats().extra["spec_draft_tokens"] > 0
    sampled = SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True, seed=3)
    lora = [setup.lora("a1"), None]
    first = llm.generate(prompts[:2], sampled, lora_request=lora, use_tqdm=False)
    again = llm.generate(prompts[:2], sampled, lora_request=lora, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    llm.engine.check_integrity()


def test_bad_adapters_and_requests_are_refused(setup, tmp_path):
    llm = setup.llm()
    with pytest.raises(InvalidRequestError, match="LoRA adapter 'x' .* no such directory"):
        llm.generate("hi", GREEDY, lora_request=LoRARequest("x", 9, str(tmp_path / "none")), use_tqdm=False)
    wide = make_adapter(str(tmp_path / "wide"), setup.model, rank=16, targets=("q_proj",))
    with pytest.raises(InvalidRequestError, match="LoRA rank 16 is greater than --max-lora-rank 8"):
        llm.generate(["hi", "ho"], GREEDY, lora_request=[None, LoRARequest("wide", 9, wide)], use_tqdm=False)
    llm.generate("hi", GREEDY, lora_request=setup.lora("a1"), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="'a1' is already loaded from .*another name"):
        llm.generate("hi", GREEDY, lora_request=LoRARequest("a1", 1, setup.paths["a2"]), use_tqdm=False)
    with pytest.raises(ValueError, match="2 prompts but 3 lora requests"):
        llm.generate(["hi", "ho"], GREEDY, lora_request=[None] * 3, use_tqdm=False)
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest"):
        llm.generate("hi", GREEDY, lora_request="a1", use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
    chat = llm.chat([{"role": "user", "content": "Hello"}], GREEDY, lora_request=setup.lora("a2"), use_tqdm=False)
    assert chat[0].outputs[0].token_ids == setup.greedy("a2", chat[0].prompt_token_ids, 6)
    plain = LLM(setup.model, device="cpu")
    with pytest.raises(ValueError, match="lora_request: LoRA is not enabled; create the LLM with enable_lora=True"):
        plain.generate("hi", GREEDY, lora_request=setup.lora("a1"))


def test_a_moe_models_attention_and_dense_layers_take_adapters(tmp_path):
    """qwen3_moe: adapters on every layer's attention and on the dense layer's MLP (layer 1) match the merged model;
    the sparse layers' experts are not adapted (refused: tests/unit/test_lora_unit.py)."""
    s = Setup(str(tmp_path), "qwen3_moe", {
        "a1": dict(rank=8, targets=("q_proj", "k_proj", "v_proj", "o_proj")),
        "a2": dict(rank=4, seed=5, targets=("gate_proj", "up_proj", "down_proj"), layers=[1])})
    _check_greedy(s, s.llm(), [None, "a1", "a2"], PROMPTS[:3])


# -- adding and removing adapters (vLLM's add_lora / remove_lora / list_loras) ------------------------------------
def test_add_list_and_remove_loras(setup, tmp_path):
    llm = setup.llm(max_loras=2)
    manager = llm.engine.runner.lora
    assert llm.list_loras() == set()
    assert llm.add_lora(setup.requests["a1"]) is True
    assert llm.list_loras() == {1} and [k.name for k in manager.cached()] == ["a1"]
    _check_greedy(setup, llm, ["a1", "a2"], PROMPTS[:2])
    assert llm.list_loras() == {1, 2}
    assert llm.remove_lora(1) is True and llm.list_loras() == {2}
    assert [k.name for k in manager.cached()] == ["a2"] and [k.name for k in manager.resident()] == ["a2"]
    assert llm.remove_lora(1) is False
    with pytest.raises(ValueError, match="LoRA adapter 'x' .* no such directory"):
        llm.add_lora(LoRARequest("x", 9, str(tmp_path / "none")))
    assert llm.list_loras() == {2}
    _check_greedy(setup, llm, ["a1", None], PROMPTS[:2])  # read again from its path, dropped after
    assert llm.list_loras() == {2} and [k.name for k in manager.cached()] == ["a2"]
    llm.engine.check_integrity()


def test_a_reload_at_the_same_path_serves_the_new_weights_and_none_of_the_old_blocks(setup, tmp_path):
    """remove_lora, new files at the adapter's path, the same LoRARequest again: the new weights run, and the prefix
    cache does not hand it the blocks the old weights computed (a removed adapter comes back under a new key)."""
    llm = setup.llm()
    path = make_adapter(str(tmp_path / "re"), setup.model, rank=8, alpha=16, seed=11)
    req = LoRARequest("re", 7, path)
    prompt = PROMPTS[3]  # several full blocks of 4
    ids = llm.get_tokenizer().encode(prompt)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run():
        out = llm.generate(prompt, params, lora_request=req, use_tqdm=False)[0]
        return out.outputs[0].token_ids, out.num_cached_tokens

    def greedy():
        with torch.no_grad():
            out = merged_model(setup.model, path).generate(torch.tensor([ids]), max_new_tokens=6, min_new_tokens=6,
                                                           do_sample=False)
        return out[0, len(ids):].tolist()

    old = greedy()
    assert run() == (old, 0)
    tokens, cached = run()
    assert tokens == old and cached > 0  # its blocks are cached
    assert llm.remove_lora(7) is True
    make_adapter(path, setup.model, rank=8, alpha=16, seed=12)  # new weights at the same path
    new = greedy()
    assert new != old
    assert run() == (new, 0)
    llm.engine.check_integrity()


def test_requests_running_with_a_removed_adapter_finish_with_it(setup):
    """remove_lora while requests of the adapter run: they finish with its weights (tokens of the merged model), then
    it leaves CPU memory and its slot; nothing else is disturbed."""
    llm = setup.llm()
    engine, manager = llm.engine, llm.engine.runner.lora
    step, steps, seen = engine.step, [0], {}

    def step_then_remove():
        out = step()
        steps[0] += 1
        if steps[0] == 2:  # both requests are running: a1's are decoding
            assert engine.remove_lora(1) is True
            seen["kept"] = [k.name for k in manager.cached()]
            engine.check_integrity()
        return out

    engine.step = step_then_remove
    _check_greedy(setup, llm, ["a1", "a2", "a1"], PROMPTS[:3], SamplingParams(temperature=0, max_tokens=8,
                                                                              ignore_eos=True))
    assert steps[0] > 3 and sorted(seen["kept"]) == ["a1", "a2"]
    assert [k.name for k in manager.cached()] == ["a2"] and "a1" not in {k.name for k in manager.resident()}
    assert llm.list_loras() == {2} and not manager.retiring


def test_the_engine_process_loop_takes_remove_lora(setup):
    """engine_proc's loop (in a thread over inproc sockets) with ("remove_lora", id), as AsyncLLM.remove_lora sends it
    after a request of the adapter: the request finishes with the adapter's tokens, then the adapter is dropped."""
    import os
    import pickle
    import threading

    import zmq

    from voltllm.engine.engine_proc import _loop

    llm = setup.llm()
    engine, manager = llm.engine, llm.engine.runner.lora
    kept, remove = [], engine.remove_lora

    def remove_and_look(lora_int_id):
        removed = remove(lora_int_id)
        kept.append(sorted(k.name for k in manager.cached()))  # (what CPU memory holds right after)
        return removed

    engine.remove_lora = remove_and_look
    ctx = zmq.Context()
    to_engine, inp = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    out, from_engine = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    to_engine.bind("inproc://lora-in")
    inp.connect("inproc://lora-in")
    from_engine.bind("inproc://lora-out")
    out.connect("inproc://lora-out")
    loop = threading.Thread(target=_loop, args=(engine, inp, out, os.getppid()), daemon=True)

    def send(*msg):
        to_engine.send(pickle.dumps(msg))

    def recv():
        assert from_engine.poll(30_000), "the engine loop sent nothing"
        return pickle.loads(from_engine.recv())

    n = 100
    (req,) = llm.frontend.make_requests("r1", PROMPTS[0], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                                        lora_request=setup.lora("a1"))
    llm.frontend.forget("r1")
    try:
        loop.start()
        send("add", [req])
        tokens = []
        while True:
            msg = recv()
            assert msg[0] == "outputs", msg
            for o in msg[1]:
                if not tokens:
                    send("remove_lora", 1)  # (after the request, as AsyncLLM sends it)
                tokens += o.new_token_ids
                finished = o.finished
            if msg[1] and finished:
                break
        send("check")
        while (msg := recv())[0] != "check":
            pass
        assert msg == ("check", None)
        send("shutdown")
        loop.join(30)
        assert not loop.is_alive()
    finally:
        engine.remove_lora = remove
        for s in (to_engine, inp, out, from_engine):
            s.close(0)
    assert tokens == setup.greedy("a1", req.prompt_token_ids, n)
    assert kept == [["a1"]]  # the request was running when the message came: kept until it finished
    assert manager.cached() == [] and manager.resident() == {} and llm.list_loras() == set()
