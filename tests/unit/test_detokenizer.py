import pytest

from tiny_models import make_tokenizer
from voltllm.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.mark.parametrize("text", ["Hello world! 東京 🙂 héllo", "naïve café — ok", "🙂🙂 a"])
def test_incremental_equals_full_decode(tok, text):
    prompt = tok.encode("The quick")
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, prompt)
    seen = []
    for t in ids:  # one token at a time, as the engine delivers them
        d.add([t])
        seen.append(d.text)
        assert "\ufffd" not in d.text
    assert d.text == tok.decode(ids)
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))


def _first_stop(d: IncrementalDetokenizer, ids: list[int]):
    """Feed one token at a time, as the engine does, until a stop string matches (returned)."""
    for t in ids:
        matched = d.add([t])
        if matched:
            return matched
    return None


def test_stop_strings(tok):
    ids = tok.encode(" capital of France is Paris.")
    d = IncrementalDetokenizer(tok, [], stop=["France", "is"])
    assert _first_stop(d, ids) == "France" and d.text == " capital of "
    d2 = IncrementalDetokenizer(tok, [], stop=["Paris"], include_stop_str_in_output=True)
    assert _first_stop(d2, ids) == "Paris" and d2.text == " capital of France is Paris"
    d3 = IncrementalDetokenizer(tok, [], stop=["Paris"])
    d3.add(ids[:3])
    assert len(d3.visible_text(False)) == max(len(d3.text) - 4, 0)


def test_stop_strings_wait_for_min_tokens(tok):
    """vLLM's rule: a stop string ending within the first min_tokens tokens does not stop the request; one in
    later text does."""
    ids = tok.encode(" apple, apple, apple, pear")
    first_comma = next(i for i in range(1, len(ids) + 1) if "," in tok.decode(ids[:i]))
    d = IncrementalDetokenizer(tok, [], stop=[","], min_tokens=first_comma)
    assert _first_stop(d, ids) == "," and d.text == " apple, apple"
    plain = IncrementalDetokenizer(tok, [], stop=[","])
    assert plain.add(ids) == "," and plain.text == " apple"


def test_backend_decode_only_without_clean_up(tok):
    """A fast tokenizer without clean-up is decoded by its tokenizers backend (the same text, special tokens
    skipped or kept as asked); with clean-up on, transformers' decode (which applies it) is used."""
    ids = tok.encode("<|im_start|>Hello world! 東京 🙂<|im_end|>")
    for skip in (True, False):
        fast = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
        assert fast._backend is tok.backend_tokenizer
        for t in ids:
            fast.add([t])
        assert fast.text == tok.decode(ids, skip_special_tokens=skip)
    calls = []

    class CleaningTokenizer:  # what a tokenizer that cleans up spaces looks like to the detokenizer
        clean_up_tokenization_spaces = True
        backend_tokenizer = tok.backend_tokenizer

        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    slow = IncrementalDetokenizer(CleaningTokenizer(), [])
    assert slow._backend is None
    slow.add(ids[:3])
    assert calls and slow.text == tok.decode(ids[:3], skip_special_tokens=True)
