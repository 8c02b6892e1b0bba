"""Qwen4-Exp on a CUDA GPU (tiny random checkpoints of tests/model/test_qwen4_exp.py): fp32 greedy tokens equal
transformers' generate, with CUDA graphs on, for a model without PLE (graphs replayed, also for decode rows past the
QSA budget: they select on the device through virtual block tables; raw and pooled index keys in the KV blocks; ratio
4 and 8 against pages of 16 and 4 tokens) and ones with PLE (the n-gram tables in page-locked host memory, read in
place by the GPU, in graph replays too), through chunked prefill and decode. Run on the GPU machine: pytest -m gpu
tests/gpu/test_qwen4_exp_cuda.py."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen4ExpTextConfig"):
    pytest.skip("this transformers has no Qwen4-Exp", allow_module_level=True)

from model.test_qwen4_exp import COMMON, INDEXER, PLE, _randomize, _seqs  # noqa: E402
from voltllm import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu
KINDS = {"qsa-graphs": dict(INDEXER, indexer_budget=8), "qsa-ple": dict(INDEXER, **PLE, indexer_budget=8),
         "qsa-graphs-r8-page4": dict(INDEXER, indexer_budget=16, indexer_compress_ratio=8)}
BLOCK_SIZE = {"qsa-graphs-r8-page4": 4}


def _checkpoint(path, extra: dict, seed: int):
    """A tiny random Qwen4-Exp (COMMON + extra) saved at path; transformers' model of it (eval, fp32)."""
    cfg = transformers.Qwen4ExpTextConfig(**COMMON, **extra)
    torch.manual_seed(seed)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    _randomize(ref, seed + 1)
    ref.save_pretrained(path)
    return ref


@pytest.mark.parametrize("kind", list(KINDS))
def test_fp32_greedy_matches_transformers(tmp_path, kind):
    ref = _checkpoint(tmp_path, KINDS[kind], 11)
    prompts = _seqs(3, [37, 5, 26, 3], eos_at=((0, 12),))
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", skip_tokenizer_init=True, gpu_memory_utilization=0.2,
              block_size=BLOCK_SIZE.get(kind, 16), max_num_batched_tokens=32, max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                pad_token_id=0)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == want, kind
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.replays >= 10, kind  # (decode steps past the budget and PLE steps replay)
    llm.engine.check_integrity()


def test_ple_graphs_equal_eager_and_transformers(tmp_path):
    """PLE with CUDA graphs (QSA's budget past every context, so every decode step replays): the n-gram tables are
    page-locked host memory the graphs read in place. Greedy fp32 tokens equal transformers' generate, and the
    logprobs equal --enforce-eager's bit for bit (capture sizes 1..4: no padding rows), async scheduling on."""
    ref = _checkpoint(tmp_path, dict(INDEXER, **PLE), 13)
    prompts = _seqs(4, [37, 5, 26, 3], eos_at=((0, 12), (2, 25)))
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, logprobs=0)
    runs = {}
    for eager in (True, False):
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", skip_tokenizer_init=True, gpu_memory_utilization=0.2,
                  block_size=16, max_num_batched_tokens=32, max_num_seqs=4, enforce_eager=eager,
                  compilation_config={"cudagraph_capture_sizes": [1, 2, 3, 4]})
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        runner = llm.engine.runner
        assert (runner.graphs is None) == eager and (eager or runner.graphs.replays >= 8)
        from voltllm.host_memory import in_host_memory

        assert in_host_memory(runner.model.layers[0].ple.readable_table(runner.device))
        runs[eager] = [(o.outputs[0].token_ids, [d[t].logprob for t, d in zip(o.outputs[0].token_ids,
                                                                               o.outputs[0].logprobs)]) for o in outs]
        llm.engine.check_integrity()
        del llm
    assert runs[False] == runs[True]
    for p, (tokens, _) in zip(prompts, runs[False]):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                pad_token_id=0)[0, len(p):].tolist()
        assert tokens == want


def test_long_context_decode_graphs_match_transformers(tmp_path):
    """A context of a few thousand tokens (budget 64, ratio 4: most blocks dropped), fp32: greedy tokens with decode
    graphs (the device selection replayed) equal an eager engine's and transformers' generate."""
    ref = _checkpoint(tmp_path, dict(INDEXER, indexer_budget=64), 13)
    prompts = _seqs(5, [3001, 1234, 77])
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    outs = {}
    for eager in (False, True):
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", skip_tokenizer_init=True, gpu_memory_utilization=0.2,
                  max_model_len=4096, max_num_batched_tokens=512, max_num_seqs=4, enforce_eager=eager)
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                    params)]
        if not eager:
            assert llm.engine.runner.graphs.replays >= 7
        llm.engine.check_integrity()
        del llm
        torch.cuda.empty_cache()
    assert outs[False] == outs[True]
    ref = ref.cuda()
    for p, got in zip(prompts, outs[False]):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p], device="cuda"), max_new_tokens=8, min_new_tokens=8,
                                do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert got == want


def test_fp8_kv_cache_with_qsa_graphs(tmp_path):
    """--kv-cache-dtype fp8_e4m3 on a QSA model (fp16, CUDA graphs): the index keys kept as fp16 bytes in the uint8
    cache, decode rows past the budget selecting inside graph replays and prompt rows past it on the multi-row route;
    the first tokens equal the fp16 cache's run and their logprobs stay within fp8's error of it."""
    _checkpoint(tmp_path, dict(INDEXER, indexer_budget=8), 17)
    prompts = _seqs(5, [37, 26, 70])
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, logprobs=0)
    runs = {}
    for kv in ("auto", "fp8_e4m3"):
        llm = LLM(str(tmp_path), device="cuda", dtype="float16", skip_tokenizer_init=True, gpu_memory_utilization=0.2,
                  kv_cache_dtype=kv, block_size=16, max_num_batched_tokens=32, max_num_seqs=4)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert llm.engine.runner.graphs.replays >= 8
        runs[kv] = [(o.outputs[0].token_ids, [d[t].logprob for t, d in zip(o.outputs[0].token_ids,
                                                                             o.outputs[0].logprobs)]) for o in outs]
        llm.engine.check_integrity()
        del llm
    for (toks_a, lps_a), (toks_b, lps_b) in zip(runs["auto"], runs["fp8_e4m3"]):
        assert toks_a[0] == toks_b[0] and abs(lps_a[0] - lps_b[0]) < 0.1


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_block_scores_kernel_matches_reference(dtype):
    """kernels/qsa_scores against the torch reference on fresh random data at a decode batch's size: 64 rows of
    contexts from 0 to 8K tokens (tables 9K tokens wide), 16 index heads of 128, ratio 4, pages of 16, the pooled keys a
    strided view of a wider cache row, the output poisoned; three keys zeroed (exact ties at 0)."""
    from voltllm.kernels.qsa_scores import qsa_block_scores
    from voltllm.model.models.qwen4_exp_qsa_decode import block_scores_reference

    g = torch.Generator(device="cuda").manual_seed(5)
    rows, heads, dim, ratio, page, width = 64, 16, 128, 4, 16, 9216 // 16
    slots = rows * width * page
    cache = torch.randn(slots, 4 * dim, device="cuda", generator=g).to(dtype)
    pooled = cache[:, dim:2 * dim]
    pooled[torch.randint(0, slots, (3,), device="cuda", generator=g)] = 0
    tables = torch.randperm(rows * width, device="cuda", generator=g).view(rows, width).to(torch.int32)
    tok = torch.randint(0, 8192, (rows,), device="cuda", generator=g)
    tok[:3] = torch.tensor([0, 3, 8191], device="cuda")
    q = torch.randn(rows, heads, dim, device="cuda", generator=g).to(dtype)
    indexer = type("Indexer", (), {"ratio": ratio, "dim": dim})()
    want = block_scores_reference(indexer, q, pooled, tok, tables, page)
    got = qsa_block_scores(q, pooled, tok, tables, ratio, page, out=torch.full_like(want, float("nan")))
    assert not torch.isnan(got).any()
    assert torch.equal(got.isneginf(), want.isneginf())
    fin = torch.isfinite(want)
    assert ((got[fin] - want[fin]).abs().max() / want[fin].abs().max()).item() < 1e-5
    for i, n in enumerate(fin.sum(-1).tolist()):  # the top blocks among each row's complete ones
        k = min(64, n)
        assert torch.equal(got[i].topk(k).indices.sort().values, want[i].topk(k).indices.sort().values), i


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_chunk_scores_kernel_matches_reference(dtype):
    """kernels/qsa_scores.qsa_chunk_scores (tensor-core tiles; fp32 in IEEE) against the torch form prompt_selection
    falls back to, on fresh random data: 300 consecutive rows of one 6K-token request, 1,536 blocks (ratio 4), 16
    index heads of 128, the output poisoned, two blocks' keys zeroed (ties at 0)."""
    import math

    from voltllm.kernels.qsa_scores import qsa_chunk_scores
    from voltllm.model.models.qwen4_exp_qsa import break_ties

    g = torch.Generator(device="cuda").manual_seed(6)
    rows, heads, dim, ratio, n = 300, 16, 128, 4, 6144
    keys = torch.randn(n // ratio, dim, device="cuda", generator=g).to(dtype)
    keys[:2] = 0
    q = torch.randn(rows, heads, dim, device="cuda", generator=g).to(dtype)
    tok = torch.arange(n - rows, n, device="cuda")
    want = break_ties(torch.relu(torch.einsum("nhd,cd->nhc", q.float(), keys.float())).sum(1) / math.sqrt(dim))
    want = want.masked_fill(torch.arange(n // ratio, device="cuda")[None, :] >= ((tok + 1) // ratio)[:, None],
                            float("-inf"))
    got = qsa_chunk_scores(q, keys, tok, ratio, out=torch.full_like(want, float("nan")))
    assert not torch.isnan(got).any()
    assert torch.equal(got.isneginf(), want.isneginf())
    fin = torch.isfinite(want)
    assert ((got[fin] - want[fin]).abs().max() / want[fin].abs().max()).item() < 1e-5
    k = 64
    assert torch.equal(got.topk(k, dim=-1).indices.sort(-1).values, want.topk(k, dim=-1).indices.sort(-1).values)
