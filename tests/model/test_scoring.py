"""Classifier pooling engines (vLLM's classify / score tasks) on tiny random models: a causal LM converted to a
reranker as vLLM serves Qwen3-Reranker (--hf-overrides architectures / classifier_from_token /
is_original_qwen3_reranker: score = sigmoid(logit_yes - logit_no) at the pair prompt's last token), the
no_post_processing head over a tied embedding, and plain ...ForSequenceClassification checkpoints (score.weight),
each against transformers; batching, chunked prompts, use_activation and the refusals; and under -tp 2 (gloo) the
same scores / probabilities as one rank."""
import pytest
import torch

from tiny_models import make_model
from voltllm import LLM, PoolingParams
from voltllm.pooling.params import PoolingParamsError
from voltllm.pooling.scoring import ScoreInputError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QUERY = "query: what is the capital of France? "
DOCS = ["Paris is the capital of France.", "def add(a, b): return a + b", "The quick brown fox jumps."]
NO_ID, YES_ID = 300, 301  # (the tiny tokenizer has no "no" / "yes" tokens: two of its tokens stand in)


@pytest.fixture(scope="module")
def causal_path(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("rerank")), "qwen3", max_position_embeddings=256)


@pytest.fixture(scope="module")
def tok(causal_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(causal_path)


def _overrides(tok):
    no, yes = tok.convert_ids_to_tokens([NO_ID, YES_ID])
    return {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [no, yes],
            "is_original_qwen3_reranker": True}


@pytest.fixture(scope="module")
def reranker(causal_path, tok):
    # a 16-token step budget: the longer pair prompts are computed in chunks
    return LLM(causal_path, runner="pooling", hf_overrides=_overrides(tok), block_size=4, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def last_logits(causal_path, tok):
    """transformers' causal LM logits at a text's last token (the reranker's reference)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(causal_path, dtype=torch.float32).eval()

    def logits(text: str) -> torch.Tensor:
        with torch.no_grad():
            return ref(torch.tensor([tok(text)["input_ids"]])).logits[0, -1]
    return logits


def _want(last_logits, text):
    lg = last_logits(text)
    return torch.sigmoid(lg[YES_ID] - lg[NO_ID]).item()


def test_qwen3_reranker_scores_match_transformers_yes_no_logits(reranker, last_logits):
    m = reranker.config.model
    assert m.runner == "pooling" and m.pooler.classifier.num_labels == 1
    assert m.pooler.classifier.from_token_ids == (NO_ID, YES_ID)
    outs = reranker.score(QUERY, DOCS, use_tqdm=False)  # 1:N
    assert len(outs) == len(DOCS)
    for doc, out in zip(DOCS, outs):
        assert out.finished and isinstance(out.outputs.score, float)
        assert out.outputs.score == pytest.approx(_want(last_logits, QUERY + doc), abs=2e-5)
    # N:N, position by position, and a lone pair
    queries = [QUERY, "another question? ", "x "]
    for q, d, out in zip(queries, DOCS, reranker.score(queries, DOCS, use_tqdm=False)):
        assert out.outputs.score == pytest.approx(_want(last_logits, q + d), abs=2e-5)
    one = reranker.score(QUERY, DOCS[0], use_tqdm=False)
    assert len(one) == 1 and one[0].outputs.score == pytest.approx(outs[0].outputs.score, abs=1e-6)
    reranker.engine.check_integrity()
    assert reranker.engine.kv.usage() == 0.0


def test_use_activation_false_gives_the_logit_difference_and_classify_the_probs(reranker, last_logits):
    raw = reranker.score(QUERY, DOCS[:2], pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    for doc, out in zip(DOCS, raw):
        lg = last_logits(QUERY + doc)
        assert out.outputs.score == pytest.approx((lg[YES_ID] - lg[NO_ID]).item(), abs=1e-4)
    probs = reranker.classify([QUERY + d for d in DOCS], use_tqdm=False)
    for doc, out in zip(DOCS, probs):
        assert out.outputs.num_classes == 1
        assert out.outputs.probs[0] == pytest.approx(_want(last_logits, QUERY + doc), abs=2e-5)
    enc = reranker.encode(QUERY + DOCS[0], use_tqdm=False)[0]  # the engine's task: classify
    assert enc.outputs.data.shape == (1,)


def test_classifier_refusals(reranker):
    with pytest.raises(ScoreInputError, match="data_1 has 2 texts and data_2 3"):
        reranker.score(["a", "b"], DOCS, use_tqdm=False)
    with pytest.raises(ScoreInputError, match="data_2: at least one text"):
        reranker.score("a", [], use_tqdm=False)
    with pytest.raises(PoolingParamsError, match="task 'embed': model .* is a classifier"):
        reranker.embed("hi", use_tqdm=False)
    with pytest.raises(PoolingParamsError, match="normalize: applies to embeddings"):
        reranker.classify("hi", pooling_params=PoolingParams(normalize=True), use_tqdm=False)
    reranker.engine.check_integrity()


def _first_tokens(tok, text, n):
    """The text cut after its first n tokens (special tokens not counted), as vLLM's max_tokens_per_* keep it."""
    cut = text[:tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"][n - 1][1]]
    assert tok.encode(cut, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)[:n]
    return cut


def test_max_tokens_per_query_and_doc_through_extra_kwargs(reranker, tok, last_logits):
    """vLLM's offline form of the server's max_tokens_per_query / max_tokens_per_doc: PoolingParams(extra_kwargs=...)
    cuts each data_1 / data_2 text to its first N tokens before the pair prompt is made; truncate_prompt_tokens then
    cuts the pair prompt; use_activation still applies."""
    limits = {"max_tokens_per_query": 4, "max_tokens_per_doc": 3}
    outs = reranker.score(QUERY, DOCS, pooling_params=PoolingParams(extra_kwargs=limits), use_tqdm=False)
    q = _first_tokens(tok, QUERY, 4)
    for doc, out in zip(DOCS, outs):
        d = _first_tokens(tok, doc, 3)
        assert out.prompt_token_ids == tok(q + d)["input_ids"]
        assert out.outputs.score == pytest.approx(_want(last_logits, q + d), abs=2e-5)
    only_doc = reranker.score(QUERY, DOCS[0], pooling_params=PoolingParams(extra_kwargs={"max_tokens_per_doc": 2}),
                              use_tqdm=False)[0]
    assert only_doc.prompt_token_ids == tok(QUERY + _first_tokens(tok, DOCS[0], 2))["input_ids"]
    both = reranker.score(QUERY, DOCS[:2], pooling_params=PoolingParams(extra_kwargs=limits), truncate_prompt_tokens=5,
                          use_tqdm=False)
    assert [o.prompt_token_ids for o in both] == [tok(q + _first_tokens(tok, d, 3))["input_ids"][-5:]
                                                  for d in DOCS[:2]]
    raw = reranker.score(QUERY, DOCS[0], pooling_params=PoolingParams(extra_kwargs=limits, use_activation=False),
                         use_tqdm=False)[0]
    lg = last_logits(q + _first_tokens(tok, DOCS[0], 3))
    assert raw.outputs.score == pytest.approx((lg[YES_ID] - lg[NO_ID]).item(), abs=1e-4)
    reranker.engine.check_integrity()


def test_token_limit_refusals(reranker):
    max_len = reranker.config.model.max_model_len
    with pytest.raises(PoolingParamsError, match="extra_kwargs max_tokens_per_doc must be a non-negative integer"):
        PoolingParams(extra_kwargs={"max_tokens_per_doc": -1})
    with pytest.raises(PoolingParamsError, match="extra_kwargs 'compressed_token_type_ids': not built"):
        PoolingParams(extra_kwargs={"compressed_token_type_ids": [1]})
    with pytest.raises(ScoreInputError, match=f"max_tokens_per_query \\({max_len}\\) must be less than max_model_len"):
        reranker.score("a", "b", pooling_params=PoolingParams(extra_kwargs={"max_tokens_per_query": max_len}),
                       use_tqdm=False)
    with pytest.raises(ValueError, match="extra_kwargs max_tokens_per_doc: apply to LLM.score"):
        reranker.classify("hi", pooling_params=PoolingParams(extra_kwargs={"max_tokens_per_doc": 2}), use_tqdm=False)
    reranker.engine.check_integrity()


def test_no_post_processing_over_a_tied_embedding(tmp_path):
    """Three tokens' rows of a tied embedding (a llama with tie_word_embeddings): classify's softmax over the three
    tokens' logits at the last position."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_model(str(tmp_path / "tied"), "llama", max_position_embeddings=256)
    tok = AutoTokenizer.from_pretrained(path)
    ids = [10, 20, 30]
    llm = LLM(path, runner="pooling", convert="classify", block_size=4,
              hf_overrides={"classifier_from_token": tok.convert_ids_to_tokens(ids), "method": "no_post_processing"})
    assert llm.config.model.pooler.classifier.activation == "softmax"
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = llm.classify(DOCS, use_tqdm=False)
    for doc, out in zip(DOCS, outs):
        with torch.no_grad():
            lg = ref(torch.tensor([tok(doc)["input_ids"]])).logits[0, -1]
        torch.testing.assert_close(torch.tensor(out.outputs.probs), lg[ids].softmax(-1), atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="needs a one-label classifier; this one has 3 labels"):
        llm.score("a", "b", use_tqdm=False)


def _sequence_classification_checkpoint(tmp_path, num_labels):
    """A tiny Qwen3ForSequenceClassification checkpoint (a random score.weight) under tmp_path: (path, transformers'
    model, tokenizer)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    causal = make_model(str(tmp_path / "causal"), "qwen3", max_position_embeddings=256)
    tok = AutoTokenizer.from_pretrained(causal)
    ref = AutoModelForSequenceClassification.from_pretrained(causal, num_labels=num_labels, dtype=torch.float32)
    with torch.no_grad():
        ref.score.weight.normal_(0.0, 0.3)
    ref.config.pad_token_id = tok.pad_token_id
    path = str(tmp_path / "seqcls")
    ref.save_pretrained(path)
    tok.save_pretrained(path)
    return path, ref.eval(), tok


@pytest.mark.parametrize("num_labels", [1, 3])
def test_sequence_classification_checkpoints_match_transformers(tmp_path, num_labels):
    """A Qwen3ForSequenceClassification checkpoint (its score.weight): --runner auto makes it a classifier; one label
    scores by sigmoid, several classify by softmax, as vLLM; the pair is the tokenizer's text pair."""
    path, ref, tok = _sequence_classification_checkpoint(tmp_path, num_labels)
    llm = LLM(path, block_size=4)
    assert llm.config.model.runner == "pooling" and llm.config.model.pooler.classifier.num_labels == num_labels

    def hf_logits(ids):
        with torch.no_grad():
            return ref(torch.tensor([ids])).logits[0]

    outs = llm.classify(DOCS, use_tqdm=False)
    for doc, out in zip(DOCS, outs):
        lg = hf_logits(tok(doc)["input_ids"])
        want = torch.sigmoid(lg) if num_labels == 1 else lg.softmax(-1)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), want, atol=2e-5, rtol=1e-4)
    if num_labels == 1:
        for doc, out in zip(DOCS, llm.score(QUERY, DOCS, use_tqdm=False)):
            ids = tok(text=QUERY, text_pair=doc)["input_ids"]
            assert out.outputs.score == pytest.approx(torch.sigmoid(hf_logits(ids)[0]).item(), abs=2e-5)


def test_a_causal_lm_without_a_head_source_is_refused(causal_path):
    with pytest.raises(ValueError, match="the checkpoint has no classification head .*classifier_from_token"):
        LLM(causal_path, runner="pooling", convert="classify", block_size=4)


def _tp2(path, **kw):
    """The same engine at -tp 2 (two gloo processes on the CPU; rank 0 pools and classifies)."""
    return LLM(path, runner="pooling", block_size=4, tensor_parallel_size=2, **kw)


def _assert_same(got, want):  # fp32 on both: only the ranks' all-reduce order differs
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=2e-6, rtol=1e-5)


def test_tensor_parallel_reranker_matches_one_rank(reranker, causal_path, tok):
    """Qwen3-Reranker's overrides at -tp 2: the head is built from the whole checkpoint's yes / no rows (not this
    rank's vocabulary shard) and the scores, raw logits and probabilities are one rank's."""
    two = _tp2(causal_path, hf_overrides=_overrides(tok), max_num_batched_tokens=16)
    try:
        assert two.config.parallel.tensor_parallel_size == 2
        pairs = ([QUERY, "another question? ", "x "], DOCS)
        for a, b in ((reranker.score(QUERY, DOCS, use_tqdm=False), two.score(QUERY, DOCS, use_tqdm=False)),
                     (reranker.score(*pairs, use_tqdm=False), two.score(*pairs, use_tqdm=False))):
            _assert_same([o.outputs.score for o in b], [o.outputs.score for o in a])
        raw = PoolingParams(use_activation=False)
        _assert_same([o.outputs.score for o in two.score(QUERY, DOCS, pooling_params=raw, use_tqdm=False)],
                     [o.outputs.score for o in reranker.score(QUERY, DOCS, pooling_params=raw, use_tqdm=False)])
        texts = [QUERY + d for d in DOCS]
        _assert_same([o.outputs.probs for o in two.classify(texts, use_tqdm=False)],
                     [o.outputs.probs for o in reranker.classify(texts, use_tqdm=False)])
        two.engine.check_integrity()
    finally:
        two.engine.shutdown()


def test_tensor_parallel_three_label_classifier_matches_one_rank(tmp_path):
    """A ForSequenceClassification checkpoint with 3 labels (its score.weight, softmax) at -tp 2: one rank's
    probabilities, batched and with prompts chunked over steps."""
    path, _, _ = _sequence_classification_checkpoint(tmp_path, 3)
    one = LLM(path, block_size=4, max_num_batched_tokens=16)
    two = _tp2(path, max_num_batched_tokens=16)
    try:
        assert two.config.model.pooler.classifier.num_labels == 3
        texts = DOCS + [QUERY * 2]  # (the last over the 16-token step budget: chunked)
        want = [o.outputs.probs for o in one.classify(texts, use_tqdm=False)]
        got = [o.outputs.probs for o in two.classify(texts, use_tqdm=False)]
        assert all(len(p) == 3 for p in got)
        _assert_same(got, want)
    finally:
        two.engine.shutdown()
