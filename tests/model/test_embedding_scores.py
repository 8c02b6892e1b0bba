"""LLM.score on an embedding model (vLLM's bi-encoder scoring, LLM(runner="pooling")): each pair's score is the cosine
similarity of the two texts' LLM.embed embeddings; 1:1, 1:N and N:N pairing, the usage tokens as vLLM counts them,
truncation, and the refusals."""
import pytest
import torch
import torch.nn.functional as F

from tiny_models import make_model
from voltllm import LLM, PoolingParams
from voltllm.pooling.params import PoolingParamsError
from voltllm.pooling.scoring import ScoreInputError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "def add(a, b): return a + b", "The quick brown fox jumps over the dog."]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_model(str(tmp_path_factory.mktemp("embed_score")), "qwen3", max_position_embeddings=256)
    return LLM(path, runner="pooling", block_size=4, max_num_batched_tokens=16)


def _embedding(llm, text, **kw):
    return torch.tensor(llm.embed(text, use_tqdm=False, **kw)[0].outputs.embedding)


def _cosine(a, b):
    return F.cosine_similarity(a, b, dim=0).item()


def test_one_to_n_scores_are_the_cosines_of_the_embeddings(llm):
    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    assert len(outs) == len(DOCS)
    q = _embedding(llm, QUERY)
    pad = llm.get_tokenizer().pad_token_id
    q_ids = llm.get_tokenizer().encode(QUERY)
    for doc, out in zip(DOCS, outs):
        assert out.finished and isinstance(out.outputs.score, float)
        assert out.outputs.score == pytest.approx(_cosine(q, _embedding(llm, doc)), abs=1e-5)
        # vLLM's pair tokens: both texts' tokens, the pad token between them
        assert out.prompt_token_ids == q_ids + [pad] + llm.get_tokenizer().encode(doc)
    assert len({round(o.outputs.score, 6) for o in outs}) == len(DOCS)  # (distinct texts, distinct scores)
    llm.engine.check_integrity()
    assert llm.engine.kv.usage() == 0.0


def test_n_to_n_and_one_to_one(llm):
    queries = [QUERY, "Who wrote this function?", "A fox"]
    for q, d, out in zip(queries, DOCS, llm.score(queries, DOCS, use_tqdm=False)):
        assert out.outputs.score == pytest.approx(_cosine(_embedding(llm, q), _embedding(llm, d)), abs=1e-5)
    one = llm.score(QUERY, DOCS[0], use_tqdm=False)
    assert len(one) == 1
    assert one[0].outputs.score == pytest.approx(_cosine(_embedding(llm, QUERY), _embedding(llm, DOCS[0])), abs=1e-5)
    same = llm.score(DOCS[1], DOCS[1], use_tqdm=False)[0].outputs.score
    assert same == pytest.approx(1.0, abs=1e-5)


def test_normalization_does_not_change_the_cosine_and_truncation_applies_per_text(llm):
    raw = llm.score(QUERY, DOCS[:2], pooling_params=PoolingParams(normalize=False), use_tqdm=False)
    normed = llm.score(QUERY, DOCS[:2], use_tqdm=False)
    assert [o.outputs.score for o in raw] == pytest.approx([o.outputs.score for o in normed], abs=1e-5)
    cut = llm.score(QUERY, DOCS[0], truncate_prompt_tokens=3, use_tqdm=False)[0]
    want = _cosine(_embedding(llm, QUERY, truncate_prompt_tokens=3), _embedding(llm, DOCS[0], truncate_prompt_tokens=3))
    assert cut.outputs.score == pytest.approx(want, abs=1e-5)
    assert len(cut.prompt_token_ids) == 3 + 1 + 3


def test_max_tokens_per_query_and_doc_cut_each_text_before_it_is_embedded(llm):
    """PoolingParams(extra_kwargs=...) (vLLM's offline max_tokens_per_query / max_tokens_per_doc): each text embedded
    as its first N tokens; the usage tokens are the cut texts'."""
    tok = llm.get_tokenizer()

    def first(text, n):
        return text[:tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"][n - 1][1]]

    params = PoolingParams(extra_kwargs={"max_tokens_per_query": 3, "max_tokens_per_doc": 4})
    outs = llm.score(QUERY, DOCS[:2], pooling_params=params, use_tqdm=False)
    q = first(QUERY, 3)
    for doc, out in zip(DOCS, outs):
        d = first(doc, 4)
        assert out.outputs.score == pytest.approx(_cosine(_embedding(llm, q), _embedding(llm, d)), abs=1e-5)
        assert out.prompt_token_ids == tok.encode(q) + [tok.pad_token_id] + tok.encode(d)
    whole = llm.score(QUERY, DOCS[0], pooling_params=PoolingParams(extra_kwargs={"max_tokens_per_doc": 100}),
                      use_tqdm=False)[0]
    assert whole.outputs.score == pytest.approx(llm.score(QUERY, DOCS[0], use_tqdm=False)[0].outputs.score, abs=1e-6)
    llm.engine.check_integrity()


def test_refusals(llm):
    with pytest.raises(ScoreInputError, match="data_1 has 2 texts and data_2 3"):
        llm.score(["a", "b"], DOCS, use_tqdm=False)
    with pytest.raises(ScoreInputError, match="data_2: at least one text"):
        llm.score("a", [], use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_params task 'score' contradicts pooling_task 'embed'"):
        llm.score("a", "b", pooling_params=PoolingParams(task="score"), use_tqdm=False)
    with pytest.raises(ValueError, match=r"LLM.classify\(\) is for classifiers"):
        llm.classify("a", use_tqdm=False)
    with pytest.raises(PoolingParamsError, match="task 'score': model .* is an embedding model"):
        llm.encode("a", pooling_task="score", use_tqdm=False)
    llm.engine.check_integrity()
    assert llm.engine.kv.usage() == 0.0
