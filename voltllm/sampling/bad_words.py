"""vLLM's bad_words: words a request must never generate, as token-id sequences.

The Frontend (it has the tokenizer; the engine gets ids only) turns each word into token ids: the word as written
(leading spaces dropped) and, where the tokenizer spells it another way after a space (the word inside a text),
that spaced form too. vLLM's rule for the spaced form: only when it starts with another token and has as many
tokens (a longer one, e.g. a space token then the word, is left out). The sampler bans a sequence's last token when
the row's latest generated tokens equal the rest of it; a one-token word is banned at every step.
"""
from __future__ import annotations

from typing import Callable, Sequence

from voltllm.engine.request_checks import InvalidRequestError
from voltllm.sampling.params import MAX_BAD_WORD_SEQUENCES

BadWordIds = tuple[tuple[int, ...], ...]


def bad_words_token_ids(words: Sequence[str], encode: Callable[[str], Sequence[int]]) -> BadWordIds:
    """Each word's token sequences (`encode`: text -> ids without special tokens). InvalidRequestError naming
    bad_words when a word gives no tokens or there are more than MAX_BAD_WORD_SEQUENCES sequences."""
    seqs: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(encode(word.lstrip()))
        if not plain:
            raise InvalidRequestError(f"bad_words entry {word!r} gives no tokens; each must tokenize to at least one",
                                      "bad_words")
        seqs.append(plain)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            seqs.append(spaced)
        if len(seqs) > MAX_BAD_WORD_SEQUENCES:
            raise InvalidRequestError(f"bad_words: too many token sequences after tokenization (more than "
                                      f"{MAX_BAD_WORD_SEQUENCES}); ask for fewer words", "bad_words")
    return tuple(seqs)


def banned_tokens(seqs: BadWordIds, latest: Sequence[int]) -> list[int]:
    """The tokens to ban at this step: each sequence's last token where `latest` (the row's most recent generated
    tokens, at least the longest sequence's length - 1 of them when that many were generated) ends with the rest
    of it. Generated tokens only, as vLLM: a prompt ending in a word's prefix bans nothing."""
    out = []
    for seq in seqs:
        p = len(seq) - 1
        if p == 0 or (p <= len(latest) and tuple(latest[len(latest) - p:]) == seq[:p]):
            out.append(seq[-1])
    return out
