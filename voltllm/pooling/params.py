"""PoolingParams: what one pooling request asks for (vLLM's names and rules: the embed, classify and score tasks)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

TASKS = ("embed", "classify", "score")
# the extra_kwargs keys built (vLLM's offline max_tokens_per_query / max_tokens_per_doc for LLM.score)
EXTRA_KWARGS = ("max_tokens_per_query", "max_tokens_per_doc")
# vLLM's other pooling tasks: named so that asking for one says it is not built
_UNBUILT_TASKS = ("token_embed", "token_classify", "reward", "encode", "plugin")


class PoolingParamsError(ValueError):
    """A bad pooling parameter; the message starts with the parameter's name (an HTTP 400)."""


@dataclass
class PoolingParams:
    """vLLM's PoolingParams for embeddings and classification / scores.

    truncate_prompt_tokens: keep the prompt's last k tokens (-1: as many as the context holds; None: all).
    dimensions: the embedding's first `dimensions` values (matryoshka models only), renormalized when normalized.
    normalize: L2-normalize the embedding (None: the model's default, --pooler-config / its sentence-transformers
    Normalize module, else true). use_activation is vLLM's newer name for it (embed task); for classify / score it
    applies the classifier's activation (sigmoid / softmax; None: true) and normalize / dimensions do not apply.
    task: embed, classify or score; None: the engine's (embed for an embedding model, classify for a classifier).
    extra_kwargs: vLLM's per-request extras; the ones built are LLM.score's max_tokens_per_query / max_tokens_per_doc
    (each query / document text cut to its first N tokens before the pair is made; 0: no cut), as vLLM takes them
    offline. Other keys are refused (nothing here would read them).
    """

    truncate_prompt_tokens: Optional[int] = None
    dimensions: Optional[int] = None
    normalize: Optional[bool] = None
    use_activation: Optional[bool] = None
    task: Optional[str] = None
    extra_kwargs: Optional[dict[str, Any]] = None

    def __post_init__(self) -> None:
        if self.task in _UNBUILT_TASKS:
            raise PoolingParamsError(f"task {self.task!r}: not built (the embed, classify and score tasks are)")
        if self.task is not None and self.task not in TASKS:
            raise PoolingParamsError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or t < -1):
            raise PoolingParamsError(f"truncate_prompt_tokens must be an integer >= -1 (-1: the context length), "
                                     f"got {t!r}")
        if self.dimensions is not None and not _is_int(self.dimensions):
            raise PoolingParamsError(f"dimensions must be an integer, got {self.dimensions!r}")
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise PoolingParamsError(f"{name} must be true or false, got {value!r}")
        if self.task in ("classify", "score"):
            for name in ("normalize", "dimensions"):
                if getattr(self, name) is not None:
                    raise PoolingParamsError(f"{name}: applies to embeddings, not to the {self.task} task (its "
                                             "switch is use_activation)")
        if self.normalize is not None and self.use_activation is not None and self.normalize != self.use_activation:
            raise PoolingParamsError("normalize and use_activation name the same switch for embeddings: give one")
        self._check_extra_kwargs()

    def _check_extra_kwargs(self) -> None:
        extra = self.extra_kwargs
        if extra is None:
            return
        if not isinstance(extra, dict):
            raise PoolingParamsError(f"extra_kwargs must be a dict, got {type(extra).__name__}")
        for key, value in extra.items():
            if key not in EXTRA_KWARGS:
                raise PoolingParamsError(f"extra_kwargs {key!r}: not built (the keys voltllm reads are "
                                         f"{', '.join(EXTRA_KWARGS)}, for LLM.score)")
            if not _is_int(value) or value < 0:
                raise PoolingParamsError(f"extra_kwargs {key} must be a non-negative integer (0: no limit), got "
                                         f"{value!r}")

    def token_limits(self) -> tuple[int, int]:
        """(max_tokens_per_query, max_tokens_per_doc) from extra_kwargs; 0: no cut."""
        extra = self.extra_kwargs or {}
        return extra.get("max_tokens_per_query", 0), extra.get("max_tokens_per_doc", 0)

    @property
    def normalize_asked(self) -> Optional[bool]:
        """The request's normalize, under either name (None: the model's default)."""
        return self.normalize if self.normalize is not None else self.use_activation

    def clone(self, **changes) -> "PoolingParams":
        return replace(self, **changes)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
