"""Pooling (embedding) engines on the GPU: a tiny random qwen3 embedded through the engine on CUDA (prompt steps
under 512 tokens replay the piecewise prompt graphs, longer ones run eager; several steps in flight) against
transformers' AutoModel last hidden state on the same card, LAST / MEAN / CLS, fp32 and fp16; the blocks are freed."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tiny_models import make_model

pytestmark = pytest.mark.gpu

PROMPTS = ["Hello", "The quick brown fox", "What is the capital of France? The capital is Paris. " * 3,
           "def add(a, b):\n    return a + b\n" * 40]  # the last one over the prompt graphs' 512 tokens


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny")), "qwen3", max_position_embeddings=2048)


@pytest.mark.parametrize("dtype,tol", [("float32", 2e-4), ("float16", 2e-2)])
@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_embeddings_match_transformers_on_cuda(tiny_path, dtype, tol, pooling_type):
    from transformers import AutoModel, AutoTokenizer

    from voltllm import LLM, PoolingParams

    ref = AutoModel.from_pretrained(tiny_path, dtype=getattr(torch, dtype)).cuda().eval()
    tok = AutoTokenizer.from_pretrained(tiny_path)
    llm = LLM(tiny_path, runner="pooling", device="cuda", dtype=dtype, gpu_memory_utilization=0.2,
              max_num_batched_tokens=1024, pooler_config={"pooling_type": pooling_type})
    outs = llm.embed(PROMPTS * 2, pooling_params=PoolingParams(normalize=False), use_tqdm=False)
    for p, out in zip(PROMPTS * 2, outs):
        with torch.no_grad():
            hidden = ref(torch.tensor([tok.encode(p)], device="cuda")).last_hidden_state[0].float()
        want = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]
        got = torch.tensor(out.outputs.embedding, device="cuda")
        assert (got - want).norm() / want.norm() < tol, (p[:20], pooling_type)
        assert torch.isfinite(got).all()
    normed = llm.embed(PROMPTS, use_tqdm=False)
    for a in normed:
        assert abs(F.normalize(torch.tensor(a.outputs.embedding), dim=-1).norm().item() - 1.0) < 1e-3
    llm.engine.check_integrity()
    assert llm.engine.kv.usage() == 0.0


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("float16", 2e-2)])
def test_reranker_scores_match_transformers_on_cuda(tiny_path, dtype, tol):
    """A causal LM converted to a Qwen3-Reranker style classifier (vLLM's --hf-overrides): score =
    sigmoid(logit_yes - logit_no) at the pair prompt's last token, the head applied on the card."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from voltllm import LLM

    tok = AutoTokenizer.from_pretrained(tiny_path)
    no_id, yes_id = 300, 301  # (the tiny tokenizer has no "no" / "yes": two of its tokens stand in)
    no, yes = tok.convert_ids_to_tokens([no_id, yes_id])
    llm = LLM(tiny_path, runner="pooling", device="cuda", dtype=dtype, gpu_memory_utilization=0.2,
              hf_overrides={"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [no, yes],
                            "is_original_qwen3_reranker": True})
    ref = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=getattr(torch, dtype)).cuda().eval()
    query = "query: what is the capital of France? "
    outs = llm.score(query, PROMPTS, use_tqdm=False)
    for doc, out in zip(PROMPTS, outs):
        with torch.no_grad():
            lg = ref(torch.tensor([tok(query + doc)["input_ids"]], device="cuda")).logits[0, -1].float()
        want = torch.sigmoid(lg[yes_id] - lg[no_id]).item()
        assert abs(out.outputs.score - want) < tol, (doc[:20], out.outputs.score, want)
    llm.engine.check_integrity()
    assert llm.engine.kv.usage() == 0.0
