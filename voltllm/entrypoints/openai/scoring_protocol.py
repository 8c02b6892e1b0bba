"""Request bodies of vLLM's scoring routes: POST /score and /v1/score (text pairs: text_1 / text_2, or data_1 / data_2,
queries / documents, queries / items), /rerank, /v1/rerank and /v2/rerank (a query and documents, Jina / Cohere style;
both on classifiers and embedding models), and a classifier's /classify (inputs' class probabilities)."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import ConfigDict, Field, StrictInt, StrictStr, model_validator

from voltllm.entrypoints.openai.protocol import NullMeansDefault

ScoreInputs = Union[StrictStr, list[StrictStr]]
# (first, second) field names of the score forms, vLLM's
SCORE_FORMS = (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"), ("queries", "items"))


class _ClassifierRequest(NullMeansDefault):
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = Field(default=None, ge=-1)  # keep each prompt's last k tokens
    truncation_side: Optional[Literal["left", "right"]] = None  # the end truncate_prompt_tokens cuts (None: left)
    use_activation: Optional[bool] = None  # the classifier's sigmoid / softmax (None: true)
    activation: Optional[bool] = None  # (vLLM's older names of use_activation)
    softmax: Optional[bool] = None
    priority: int = 0
    request_id: Optional[str] = None
    user: Optional[str] = None
    cache_salt: Optional[str] = None  # (vLLM's: salts the prompts' prefix-cache hashes)

    def wants_activation(self) -> Optional[bool]:
        return next((v for v in (self.use_activation, self.activation, self.softmax) if v is not None), None)


class _PairRequest(_ClassifierRequest):
    # vLLM's (Cohere's / Jina's names): each first text (query) / second text (document) cut to its first N tokens
    # before the pair is made (0: no cut); checked in serving_score (0 <= N < the context length)
    max_tokens_per_query: int = 0
    max_tokens_per_doc: int = 0


class ScoreRequest(_PairRequest):
    text_1: Optional[ScoreInputs] = None
    text_2: Optional[ScoreInputs] = None
    data_1: Optional[ScoreInputs] = None
    data_2: Optional[ScoreInputs] = None
    queries: Optional[ScoreInputs] = None
    documents: Optional[ScoreInputs] = None
    items: Optional[ScoreInputs] = None

    @model_validator(mode="after")
    def _one_form(self) -> "ScoreRequest":
        given = [f for f in SCORE_FORMS if getattr(self, f[0]) is not None and getattr(self, f[1]) is not None]
        if len(given) != 1:
            raise ValueError("give one pair of inputs: text_1 and text_2 (or data_1 / data_2, queries / documents, "
                             "queries / items)")
        return self

    def pair(self) -> tuple[tuple[str, str], ScoreInputs, ScoreInputs]:
        names = next(f for f in SCORE_FORMS if getattr(self, f[0]) is not None and getattr(self, f[1]) is not None)
        return names, getattr(self, names[0]), getattr(self, names[1])


class RerankRequest(_PairRequest):
    query: StrictStr
    documents: list[StrictStr]
    top_n: int = 0  # the best top_n results (0, or more than there are: all), as vLLM
    return_documents: bool = True  # each result's document text (vLLM always includes it; Cohere's switch)


class ClassificationRequest(_ClassifierRequest):
    input: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    add_special_tokens: bool = True
