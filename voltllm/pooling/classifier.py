"""Sequence classification (vLLM's classify / score pooling tasks): a pooling engine whose pooled final hidden state
goes through a classification head, [num_labels, hidden], then an activation.

The head comes from the checkpoint's `score.weight` (a `*ForSequenceClassification` checkpoint) or, as vLLM converts
a causal LM reranker online, from rows of its LM head named by the HF config's `classifier_from_token`:
- `method: "from_2_way_softmax"` (what `is_original_qwen3_reranker: true` selects, Qwen3-Reranker): one row,
  w[tokens[1]] - w[tokens[0]], so sigmoid(head . h) = softmax over the two tokens' logits at the second one
  (score = sigmoid(logit_yes - logit_no));
- `method: "no_post_processing"`: the tokens' rows as they are (one label per token).
The activation is vLLM's: the config's problem_type (regression: none, single_label_classification: softmax,
multi_label_classification: sigmoid), else sigmoid for one label and softmax for several.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

logger = logging.getLogger("voltllm")

METHODS = ("from_2_way_softmax", "no_post_processing")
ACTIVATIONS = ("sigmoid", "softmax", "none")


class ClassifierConfigError(ValueError):
    """A classifier setting voltllm cannot run (a ConfigError at start-up)."""


@dataclass(frozen=True)
class ClassifierConfig:
    num_labels: int
    activation: str  # sigmoid | softmax | none
    # rows of the LM head (token ids) the head is built from; None: the checkpoint's score.weight
    from_token_ids: Optional[tuple[int, ...]] = None
    method: Optional[str] = None
    # how a score pair (text_1, text_2) becomes one prompt: "concat" (text_1 + text_2 tokenized as one text: a causal
    # LM used as a reranker, vLLM's use_pad_token false) or "pair" (the tokenizer's text / text_pair encoding)
    pair_form: str = "pair"
    labels: Optional[tuple[str, ...]] = None  # id2label, by label index

    def head_from_vocab(self, weight: torch.Tensor) -> torch.Tensor:
        """The head [num_labels, hidden] (float32) from an LM-head (or tied embedding) weight [vocab, hidden]."""
        if not weight.is_floating_point():
            raise ValueError("classifier_from_token: the LM head is stored quantized; a head built from its rows "
                             "needs a dense checkpoint")
        rows = weight[list(self.from_token_ids)].to(torch.float32)
        if self.method == "from_2_way_softmax":
            return rows[1:2] - rows[0:1]
        return rows

    def label(self, index: int) -> str:
        return self.labels[index] if self.labels and index < len(self.labels) else f"LABEL_{index}"

    def describe(self) -> str:
        src = (f"LM-head rows of {len(self.from_token_ids)} tokens ({self.method})" if self.from_token_ids
               else "the checkpoint's score head")
        return f"{self.num_labels} label(s) from {src}, {self.activation}"


def resolve_classifier(hf_config: Any, tokenizer_path: Optional[str], trust_remote_code: bool = False
                       ) -> ClassifierConfig:
    """The head's shape and source, from the HF config (after --hf-overrides), as vLLM reads it."""
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    tokens = getattr(hf_config, "classifier_from_token", None) or getattr(cfg, "classifier_from_token", None)
    method = getattr(cfg, "method", None) or getattr(hf_config, "method", None)
    if getattr(hf_config, "is_original_qwen3_reranker", False):
        if not (isinstance(tokens, (list, tuple)) and len(tokens) == 2):
            raise ClassifierConfigError("is_original_qwen3_reranker needs classifier_from_token with two tokens "
                                        "(--hf-overrides '{\"classifier_from_token\": [\"no\", \"yes\"], ...}')")
        method = "from_2_way_softmax"
    ids = None
    if method is not None:
        if method not in METHODS:
            raise ClassifierConfigError(f"--hf-overrides method {method!r}: one of {', '.join(METHODS)}")
        if not (isinstance(tokens, (list, tuple)) and tokens and all(isinstance(t, str) for t in tokens)):
            raise ClassifierConfigError(f"method {method}: classifier_from_token must be a list of token strings, "
                                        f"got {tokens!r}")
        if method == "from_2_way_softmax" and len(tokens) != 2:
            raise ClassifierConfigError(f"method from_2_way_softmax takes two tokens (false, true), got {len(tokens)}")
        ids = _token_ids(tokens, tokenizer_path, trust_remote_code)
        num_labels = 1 if method == "from_2_way_softmax" else len(tokens)
        pair_form = "pair" if getattr(cfg, "use_pad_token", False) else "concat"
    else:
        if tokens:
            logger.warning("classifier_from_token is read with a method (from_2_way_softmax, no_post_processing) or "
                           "is_original_qwen3_reranker; without one the checkpoint's score head is used")
        num_labels = int(getattr(cfg, "num_labels", 0) or 0)
        if num_labels < 1:
            raise ClassifierConfigError(f"the model's config gives num_labels {num_labels}: a classifier needs >= 1")
        pair_form = "pair" if getattr(cfg, "use_pad_token", True) else "concat"
    labels = None
    id2label = getattr(cfg, "id2label", None)
    if isinstance(id2label, dict) and method is None:
        labels = tuple(str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(num_labels))
    return ClassifierConfig(num_labels, _activation(cfg, num_labels), ids, method, pair_form, labels)


def _activation(cfg: Any, num_labels: int) -> str:
    problem = getattr(cfg, "problem_type", None)
    if problem == "regression":
        return "none"
    if problem == "single_label_classification":
        return "softmax"
    if problem == "multi_label_classification":
        return "sigmoid"
    return "sigmoid" if num_labels == 1 else "softmax"


def _token_ids(tokens: list, tokenizer_path: Optional[str], trust_remote_code: bool) -> tuple[int, ...]:
    if tokenizer_path is None:
        raise ClassifierConfigError("classifier_from_token needs the model's tokenizer to find the tokens' ids")
    from voltllm.model.loader import load_tokenizer

    tok = load_tokenizer(tokenizer_path, trust_remote_code)
    out = []
    for t in tokens:
        tid = tok.convert_tokens_to_ids(t)
        if tid is None or (tid == tok.unk_token_id and t != tok.unk_token):
            raise ClassifierConfigError(f"classifier_from_token {t!r} is not a token of the model's tokenizer")
        out.append(int(tid))
    return tuple(out)


def activate(logits: torch.Tensor, activation: str) -> torch.Tensor:
    """logits [rows, labels] (float32) -> vLLM's classification outputs."""
    if activation == "sigmoid":
        return torch.sigmoid(logits)
    if activation == "softmax":
        return torch.softmax(logits, dim=-1)
    return logits
