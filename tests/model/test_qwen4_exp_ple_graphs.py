"""Qwen4-Exp's PLE layers in CUDA-graph decode steps, on the CPU (fp32, tiny random checkpoint).

The n-gram windows come from the device-side "ple_ctx" state and the step's input ids as the runner leaves them on
the device (under async scheduling a decode row's token is filled there from the step in flight), and the table rows
are gathered where the step runs (a GPU reads the page-locked host table in place): nothing is read back to the
host, so a graph can replay it. Here each captured graph is stood in for by tests/unit/test_hybrid_graph_path's
EagerReplay (the same forward on the runner's persistent buffers with the device slot tensor, as a capture runs
it). The replayed engine must give the eager engine's tokens and logprobs bit for bit, and transformers' greedy
tokens; the one-row forms of the window and conv code must equal the general per-request forms bit for bit.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen4ExpTextConfig"):
    pytest.skip("this transformers has no Qwen4-Exp", allow_module_level=True)

from model.test_qwen4_exp import COMMON, EOS, INDEXER, PLE, _randomize, _ref_logits, _seqs  # noqa: E402
from unit.test_hybrid_graph_path import with_eager_replays  # noqa: E402
from voltllm.model.models.qwen4_exp_ple import NGramContext  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def ple_checkpoint(tmp_path_factory):
    """(directory, transformers model): PLE on layers 1 and 3, QSA's budget past every context (graphs allowed)."""
    cfg = transformers.Qwen4ExpTextConfig(**COMMON, **INDEXER, **PLE)
    torch.manual_seed(900)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    _randomize(ref, 901)
    d = tmp_path_factory.mktemp("ple-graphs")
    ref.save_pretrained(d)
    return str(d), ref


# prompts with an EOS inside and one right at the end (the first decode windows reach back across it)
PROMPTS = _seqs(21, [23, 1, 9, 14, 5], eos_at=((0, 7), (2, 8), (3, 12)))
MAX_TOKENS = [12, 7, 3, 10, 16]


def _generate(llm):
    from voltllm import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=0) for m in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
    return tokens, logprobs


def _llm(path, async_scheduling):
    from voltllm import LLM

    return LLM(path, skip_tokenizer_init=True, block_size=4, max_num_batched_tokens=16, max_num_seqs=8,
               mamba_cache_mode="none", async_scheduling=async_scheduling)


def _stand_ins(llm, every_size: bool):
    """The runner's decode graphs as EagerReplay stand-ins; every_size: one per batch size 1..8 (no padding rows)."""
    from unit.test_hybrid_graph_path import EagerReplay

    graphs = with_eager_replays(llm)
    if every_size:
        graphs.sizes = list(range(1, 9))
        graphs.graphs = {bs: EagerReplay(graphs, bs, graphs.slot_log) for bs in graphs.sizes}
    return graphs


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_replayed_decode_equals_eager_and_transformers(ple_checkpoint, async_scheduling):
    """Replays of every batch size (no padding rows) give the eager engine's logprobs bit for bit; replays of the
    bucketed sizes (1, 2, 4, 8: padding rows) its tokens (padded batches change the products' row counts, so the
    logits only agree closely, as for any model)."""
    path, ref = ple_checkpoint
    want_tokens, want_logprobs = _generate(_llm(path, async_scheduling))
    for every_size in (True, False):
        llm = _llm(path, async_scheduling)
        assert llm.engine.runner.model.supports_cuda_graphs
        graphs = _stand_ins(llm, every_size)
        got_tokens, got_logprobs = _generate(llm)
        assert graphs.replays > 10 and {len(row) for row in graphs.slot_log} >= ({5, 4, 1} if every_size else
                                                                                  {8, 4, 1})
        assert got_tokens == want_tokens
        if every_size:
            assert got_logprobs == want_logprobs  # bit for bit
        else:
            assert torch.allclose(torch.tensor(sum(got_logprobs, [])), torch.tensor(sum(want_logprobs, [])),
                                  rtol=0, atol=1e-5)
        llm.engine.step()
        llm.engine.check_integrity()
    for prompt, out in zip(PROMPTS, got_tokens):  # greedy: each token is transformers' argmax after the ones before
        logits = _ref_logits(ref, prompt + out)
        assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == out


def test_replayed_decode_needs_the_saved_context(ple_checkpoint, monkeypatch):
    """The same run with the one-row steps not saving each request's last tokens ("ple_ctx") leaves the eager
    tokens: the replays' windows really come from the device state."""
    path, _ = ple_checkpoint
    want, _ = _generate(_llm(path, True))
    real = NGramContext.save

    def save_but_one_row_steps(self, state_ctx, slots):
        if self.windows.shape[1] != slots.shape[0]:
            real(self, state_ctx, slots)

    monkeypatch.setattr(NGramContext, "save", save_but_one_row_steps)
    llm = _llm(path, True)
    with_eager_replays(llm)
    got, _ = _generate(llm)
    assert got != want


def _python_windows(history: list[list[int]], tokens: list[list[int]], n: int) -> list[list[int]]:
    """Reference windows [n, T]: each token's shifted tokens from its request's history, reset after an EOS."""
    out = [[] for _ in range(n)]
    for hist, toks in zip(history, tokens):
        seq = hist + toks
        for p in range(len(hist), len(seq)):
            out[0].append(seq[p])
            valid = True
            for s in range(1, n):
                valid = valid and seq[p - s] != EOS
                out[s].append(seq[p - s] if valid else EOS)
    return out


def test_one_row_windows_equal_the_general_form():
    """Decode rows (device-only form) and a mixed step (per-request index form) against a plain-Python reference;
    rows without a state start from EOS padding; the saved context is each request's last tokens."""
    n_ctx = 2
    state = torch.tensor([[7, 8], [EOS, 9], [10, EOS], [3, 3], [11, 12]])
    slots = torch.tensor([4, 1, 2, 0])
    init = torch.tensor([True, True, True, False])
    for step in ([[20], [21], [22], [23]], [[20, EOS, 30], [21], [22, 40], [23, 24, 25, 26]]):
        qsl = [0]
        for toks in step:
            qsl.append(qsl[-1] + len(toks))
        ids = torch.tensor([t for toks in step for t in toks])
        ctx = NGramContext(ids, qsl, slots, init, state.clone(), n_ctx + 1, EOS)
        history = [state[s].tolist() if i else [EOS] * n_ctx for s, i in zip(slots.tolist(), init.tolist())]
        assert ctx.windows.tolist() == _python_windows(history, step, n_ctx + 1)
        assert ctx.new_ctx.tolist() == [(h + toks)[-n_ctx:] for h, toks in zip(history, step)]


def test_one_row_conv_equals_the_per_request_loop(ple_checkpoint):
    """The dilated conv of a decode step (all rows at once) against the per-request loop, bit for bit, state too."""
    from types import SimpleNamespace

    from model.test_qwen4_exp import _ours

    ple = _ours(ple_checkpoint[0]).layers[0].ple
    g = torch.Generator().manual_seed(5)
    width = ple.conv_weight.shape[0]
    x = torch.randn(4, width, generator=g)
    state = torch.randn(6, ple.conv_rows, width, generator=g)
    batch = SimpleNamespace(query_start_loc=[0, 1, 2, 3, 4], slots=torch.tensor([5, 0, 3, 2]),
                            has_initial_state=torch.tensor([True, False, True, True]))
    got_state = state.clone()
    got = ple._dilated_conv(x, got_state, batch)
    want_state = state.clone()
    want = []
    for i in range(4):  # the loop form with one row per request (the eager form before the one-row path)
        prev = state[batch.slots[i]] if batch.has_initial_state[i] else torch.zeros_like(state[0])
        seq = torch.cat([prev, x[i:i + 1]])
        acc = torch.zeros(1, width)
        for j in range(ple.kernel):
            start = ple.conv_rows - (ple.kernel - 1 - j) * ple.dilation
            acc += seq[start:start + 1] * ple.conv_weight[:, j]
        want.append(acc)
        want_state[batch.slots[i]] = seq[-ple.conv_rows:]
    assert torch.equal(got, torch.cat(want)) and torch.equal(got_state, want_state)


def test_table_rows_are_gathered_where_the_step_runs(ple_checkpoint, monkeypatch):
    """Off the GPU the layer gathers from the host table itself; nothing in the embedding goes through .cpu()."""
    from model.test_qwen4_exp import _ours

    ple = _ours(ple_checkpoint[0]).layers[2].ple
    assert ple.readable_table(torch.device("cpu")) is ple.table
    windows = torch.tensor([[20, 21, 22], [EOS, 30, 31], [EOS, EOS, 40]])
    ids = ple.ngram_ids(windows)
    want = ple.table[ids.reshape(-1)].view(3, -1)
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: pytest.fail("host round trip"))
    assert torch.equal(ple.embed(windows), want)


class GraphFormHarness:
    """test_hybrid_parity's Harness whose decode steps take the CUDA-graph form of the context: the state slots as
    a device tensor (HybridBatch._from_device_slots: no host reads, the runner's bookkeeping skipped)."""

    def __init__(self, model):
        from model.test_hybrid_parity import Harness

        self.h = Harness(model, block_size=4, num_slots=4)
        self.graph_form = False
        real = self.h.model.forward

        def forward(input_ids, positions, ctx):
            if self.graph_form:
                slots = ctx.extra["state_slots"]
                self.h.states.note_step(slots, [n - 1 for n in ctx.meta.seq_lens_cpu], ctx.meta.seq_lens_cpu)
                ctx.extra["state_slots"] = torch.tensor(slots, dtype=torch.long)
            return real(input_ids, positions, ctx)

        self.h.model.forward = forward


def test_graph_form_forward_equals_eager_bit_for_bit(ple_checkpoint):
    """The same decode batches through the eager context and the graph form: logits and every PLE state equal bit
    for bit (fp32), step after step, with rows resuming and one starting fresh in a decode step."""
    from model.test_qwen4_exp import _ours

    path, _ = ple_checkpoint
    seqs = _seqs(31, [30, 30, 30, 30], eos_at=((0, 9), (1, 11), (2, 3)))
    runs = []
    for graph_form in (False, True):
        g = GraphFormHarness(_ours(path))
        h = g.h
        h.step([("a", seqs[0], 0, 10), ("b", seqs[1], 0, 12), ("c", seqs[2], 0, 1)])
        outs = []
        g.graph_form = graph_form
        for k in range(6):
            work = [("a", seqs[0], 10 + k, 1), ("b", seqs[1], 12 + k, 1), ("c", seqs[2], 1 + k, 1)]
            if k >= 2:  # a request whose first token is a decode row (no state to resume)
                work.append(("d", seqs[3], k - 2, 1))
            outs.append(h.step(work))
        runs.append((outs, {k: v.clone() for k, v in h.states.extra.items()}))
    (eager, eager_state), (graph, graph_state) = runs
    for e, g in zip(eager, graph):
        assert all(torch.equal(a, b) for a, b in zip(e, g))
    assert all(torch.equal(eager_state[k], graph_state[k]) for k in ("ple_ctx", "ple_conv"))
