"""pooling/scoring.py without a model: vLLM's pairing rule (1:1, 1:N, N:N) and its refusals, and the bi-encoder
scores (cosine similarity of two embeddings, the pair's tokens as vLLM counts them)."""
import pytest
import torch
import torch.nn.functional as F

from voltllm.engine.outputs import PoolingOutput, PoolingRequestOutput, ScoringRequestOutput
from voltllm.pooling.scoring import ScoreInputError, cosine_scores, score_inputs, score_pairs


def _out(rid, data, ids, cached=0):
    return PoolingRequestOutput(rid, PoolingOutput(torch.tensor(data, dtype=torch.float32)), ids, True,
                                num_cached_tokens=cached)


@pytest.mark.parametrize("first,second,want", [
    ("a", "b", [("a", "b")]),
    ("a", ["b", "c"], [("a", "b"), ("a", "c")]),
    (["a"], ["b", "c"], [("a", "b"), ("a", "c")]),
    (["a", "b"], ["c", "d"], [("a", "c"), ("b", "d")]),
])
def test_pairing(first, second, want):
    assert score_pairs(first, second) == want
    firsts, seconds = score_inputs(first, second)
    assert len(firsts) == (1 if isinstance(first, str) else len(first)) and [b for _, b in want] == seconds


@pytest.mark.parametrize("first,second,match", [
    (["a", "b"], ["c", "d", "e"], "text_1 has 2 texts and text_2 3"),
    (["a", "b"], "c", "text_1 has 2 texts and text_2 1"),
    ([], "b", "text_1: at least one text"),
    ("a", [], "text_2: at least one text"),
    ("a", ["b", 3], "text_2: texts only"),
])
def test_pairing_refusals(first, second, match):
    with pytest.raises(ScoreInputError, match=match):
        score_inputs(first, second)


def test_cosine_scores_one_to_n():
    q = _out("q", [1.0, 2.0, 3.0], [5, 6], cached=2)
    docs = [_out("d0", [1.0, 2.0, 3.0], [7]), _out("d1", [-3.0, 0.5, 2.0], [8, 9]), _out("d2", [0.0, 0.0, -1.0], [4])]
    scored = cosine_scores([q], docs, pad_token_id=0)
    assert [s.request_id for s in scored] == ["q_d0", "q_d1", "q_d2"]
    for d, s in zip(docs, scored):
        want = F.cosine_similarity(q.outputs.data, d.outputs.data, dim=0)
        assert s.outputs.data.dtype == torch.float32 and s.outputs.data.shape == ()
        assert torch.equal(s.outputs.data, want) and s.finished
        assert s.prompt_token_ids == [5, 6, 0] + d.prompt_token_ids  # (vLLM's: the pad token between the texts)
        assert ScoringRequestOutput.from_base(s).outputs.score == pytest.approx(want.item())
    assert scored[0].outputs.data.item() == pytest.approx(1.0) and scored[0].num_cached_tokens == 2


def test_cosine_scores_n_to_n_scale_free_and_without_a_pad_token():
    a = [_out("a0", [1.0, 0.0], [1]), _out("a1", [0.0, 2.0], [2])]
    b = [_out("b0", [10.0, 0.0], [3]), _out("b1", [3.0, 3.0], [4])]
    scored = cosine_scores(a, b, pad_token_id=None)
    assert [s.outputs.data.item() for s in scored] == pytest.approx([1.0, 2 ** -0.5])
    assert [s.prompt_token_ids for s in scored] == [[1, 3], [2, 4]]


def test_cosine_scores_refuse_mismatched_or_aborted_outputs():
    with pytest.raises(ValueError, match="2 first embeddings for 3"):
        cosine_scores([_out("a", [1.0], [1])] * 2, [_out("b", [1.0], [1])] * 3, None)
    aborted = PoolingRequestOutput("x", None, [1], True)
    with pytest.raises(ValueError, match="request x has no embedding"):
        cosine_scores([aborted], [_out("b", [1.0], [1])], None)


def test_first_tokens_text_cuts_at_the_nth_tokens_end(tmp_path):
    """vLLM's max_tokens_per_query / max_tokens_per_doc: the text up to the end of its first N tokens, sliced from the
    text itself (no decode round trip); special tokens are not counted; a text that fits is unchanged."""
    from tiny_models import make_tokenizer
    from voltllm.pooling.scoring import first_tokens_text

    tok = make_tokenizer(str(tmp_path))
    text = "The capital of France is Paris, and Paris is large."
    ids = tok.encode(text, add_special_tokens=False)
    for n in (1, 3, len(ids) - 1):
        cut = first_tokens_text(tok, text, n)
        assert text.startswith(cut) and tok.encode(cut, add_special_tokens=False) == ids[:n], n
    assert first_tokens_text(tok, text, len(ids)) == text and first_tokens_text(tok, text, 10**6) == text


def test_first_tokens_text_without_offsets_decodes_the_first_tokens():
    """A tokenizer with no offset mapping (transformers' slow ones raise NotImplementedError): its first N tokens
    decoded."""
    from voltllm.pooling.scoring import first_tokens_text

    class Slow:
        def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False):
            if return_offsets_mapping:
                raise NotImplementedError
            return {"input_ids": [ord(c) for c in text]}

        def decode(self, ids):
            return "".join(map(chr, ids))

    assert first_tokens_text(Slow(), "abcdef", 4) == "abcd" and first_tokens_text(Slow(), "ab", 4) == "ab"


@pytest.mark.parametrize("side,want", [(None, [4, 5, 6]), ("left", [4, 5, 6]), ("right", [1, 2, 3])])
def test_kept_prompt_truncation_side(side, want):
    """vLLM's truncation_side: left (the default) keeps the last k tokens, right the first k; -1 the context."""
    from voltllm.engine.request_checks import kept_prompt

    assert kept_prompt([1, 2, 3, 4, 5, 6], 3, 8, side) == want
    assert kept_prompt([1, 2, 3, 4, 5, 6], -1, 4, side) == ([3, 4, 5, 6] if side != "right" else [1, 2, 3, 4])
    assert kept_prompt([1, 2], None, 8, side) == [1, 2]
