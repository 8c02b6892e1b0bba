"""Which runner an engine is (vLLM's --runner / --convert / older --task) and, for a pooling engine, its pooler
(--pooler-config, the checkpoint's sentence-transformers files, defaults), resolved once at start-up.

As in vLLM, one engine runs one runner: a generate engine serves generation only, a pooling engine embeddings (or,
a classifier, classification / scores) only. Every architecture voltllm builds is a causal LM, so a pooling engine is
one "converted" (vLLM's --convert embed / classify): the final norm's hidden state is pooled (LAST token, MEAN over
the prompt, or the first token, CLS) and, by default, L2-normalized (embed), or put through a classification head and
its activation (classify: classifier.py).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

from voltllm.pooling.classifier import ClassifierConfig, ClassifierConfigError, resolve_classifier
from voltllm.pooling.params import PoolingParams, PoolingParamsError

logger = logging.getLogger("voltllm")

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
_NOT_BUILT = ("reward models are not built: voltllm serves generative models, embedding models (--runner pooling, "
              "--convert embed) and sequence classifiers / rerankers (--convert classify)")
# vLLM's --task values: the runner (and conversion) each one asks for
_TASKS = {"auto": (None, None), "generate": ("generate", None), "embed": ("pooling", "embed"),
          "embedding": ("pooling", "embed"), "classify": ("pooling", "classify"), "score": ("pooling", "classify")}
_UNBUILT_TASKS = {"reward": _NOT_BUILT,
                  "transcription": "speech-to-text models are not built",
                  "draft": "the draft runner belongs to speculative decoding: give the drafter in --speculative-config"}
# architecture name suffixes and the runner they default to (vLLM's table, first match wins; a bare "...Model" is an
# encoder saved without its LM head: an embedding model)
_ARCH_DEFAULTS = (("ForCausalLM", "generate"), ("ForConditionalGeneration", "generate"), ("ChatModel", "generate"),
                  ("LMHeadModel", "generate"), ("ForTextEncoding", "embed"), ("EmbeddingModel", "embed"),
                  ("ForSequenceClassification", "classify"), ("ClassificationModel", "classify"),
                  ("ForRewardModeling", "reward"), ("RewardModel", "reward"), ("Model", "embed"))
# --pooler-config keys that belong to other pooling tasks (refused: not built), and ones accepted at their default
_OTHER_TASK_KEYS = ("softmax", "activation", "logit_bias", "logit_scale", "logit_mean", "logit_sigma", "step_tag_id",
                    "returned_token_ids", "tok_pooling_type")
_DEFAULT_ONLY = {"enable_chunked_processing": (False, "embedding inputs longer than --max-model-len in chunks is not "
                                                      "built (they are refused, or cut by truncate_prompt_tokens)"),
                 "max_embed_len": (None, "inputs longer than --max-model-len are not built")}


class PoolerConfigError(ValueError):
    """A runner / pooler setting voltllm cannot run (config.py turns it into a ConfigError)."""


@dataclass(frozen=True)
class PoolerConfig:
    """A pooling engine's pooler. `normalize` and `dimensions` are the defaults of its embedding requests;
    `classifier` makes the engine a classifier (vLLM's classify / score tasks) instead of an embedding model."""

    pooling_type: str = "LAST"
    normalize: bool = True
    dimensions: Optional[int] = None
    hidden_size: int = 0
    # matryoshka models (HF config `is_matryoshka` / `matryoshka_dimensions`): embeddings may be cut to a prefix
    matryoshka: bool = False
    matryoshka_dimensions: Optional[tuple[int, ...]] = None
    classifier: Optional[ClassifierConfig] = None

    @property
    def task(self) -> str:
        """The engine's pooling task: classify (a classifier, which also scores pairs) or embed."""
        return "classify" if self.classifier is not None else "embed"

    @property
    def reads_every_token(self) -> bool:
        """MEAN / CLS pool tokens other than the last: each one must be computed here (no prefix-cache hits)."""
        return self.pooling_type != "LAST"

    def resolve(self, params: Optional[PoolingParams], model_name: str) -> PoolingParams:
        """A request's params with this pooler's defaults filled in (normalize a bool), its dimensions checked as
        vLLM checks them (matryoshka models only) and against the embedding's size. A classifier's requests are
        classify / score ones (use_activation a bool), an embedding model's embed ones."""
        params = params or PoolingParams()
        if self.classifier is not None:
            task = params.task or "classify"
            if task not in ("classify", "score"):
                raise PoolingParamsError(f"task {task!r}: model {model_name!r} is a classifier: it serves the classify "
                                         "and score tasks (LLM.classify / score, POST /classify, /score, /rerank)")
            PoolingParams(normalize=params.normalize, dimensions=params.dimensions, task=task)  # (their checks)
            return PoolingParams(truncate_prompt_tokens=params.truncate_prompt_tokens, task=task,
                                 use_activation=True if params.use_activation is None else params.use_activation)
        if params.task not in (None, "embed"):
            raise PoolingParamsError(f"task {params.task!r}: model {model_name!r} is an embedding model: it serves "
                                     "the embed task only (a classifier or reranker needs --convert classify or a "
                                     "...ForSequenceClassification architecture)")
        normalize = params.normalize_asked
        dims = params.dimensions
        if dims is not None:
            self.check_dimensions(dims, model_name)
        else:
            dims = self.dimensions
        return PoolingParams(truncate_prompt_tokens=params.truncate_prompt_tokens, dimensions=dims, task="embed",
                             normalize=self.normalize if normalize is None else normalize)

    def check_dimensions(self, dims: int, model_name: str) -> None:
        if not self.matryoshka:
            raise PoolingParamsError(f"dimensions: model {model_name!r} does not support matryoshka representation "
                                     "(its config has no is_matryoshka / matryoshka_dimensions): a shortened "
                                     "embedding would be a poor one")
        if self.matryoshka_dimensions is not None and dims not in self.matryoshka_dimensions:
            raise PoolingParamsError(f"dimensions: model {model_name!r} supports the matryoshka dimensions "
                                     f"{list(self.matryoshka_dimensions)} only, got {dims}")
        if dims < 1:
            raise PoolingParamsError(f"dimensions must be greater than 0, got {dims}")
        if dims > self.hidden_size:
            raise PoolingParamsError(f"dimensions: the model's embeddings have {self.hidden_size} values, got {dims}")

    def describe(self) -> str:
        if self.classifier is not None:
            return f"{self.pooling_type} pooling, a classifier: {self.classifier.describe()}"
        return (f"{self.pooling_type} pooling, {'normalized' if self.normalize else 'not normalized'}"
                + (f", {self.dimensions} dimensions" if self.dimensions else ""))


def resolve_runner(task: Optional[str], runner: str, convert: str, hf_config: Any, model_path: str
                   ) -> tuple[str, Optional[str]]:
    """(runner, pooling task): 'generate' (task None) or 'pooling' with 'embed' or 'classify', from --task /
    --runner / --convert and the model, as vLLM resolves them: --runner auto is pooling for a sentence-transformers
    checkpoint (modules.json with a Pooling module), an architecture named as an encoder (Qwen3Model,
    ...EmbeddingModel) or a sequence classifier (...ForSequenceClassification, e.g. a reranker through
    --hf-overrides), or --convert embed / classify, else generate. A pooling runner's task follows --convert, else
    the architecture (a ...ForSequenceClassification classifies, any other embeds)."""
    if runner not in RUNNERS:
        if runner == "draft":
            raise PoolerConfigError(f"--runner draft: {_UNBUILT_TASKS['draft']}")
        raise PoolerConfigError(f"--runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if convert not in CONVERTS:
        if convert == "reward":
            raise PoolerConfigError(f"--convert {convert}: {_NOT_BUILT}")
        raise PoolerConfigError(f"--convert must be one of {', '.join(CONVERTS)}, got {convert!r}")
    if task is not None:
        if task in _UNBUILT_TASKS:
            raise PoolerConfigError(f"--task {task}: {_UNBUILT_TASKS[task]}")
        if task not in _TASKS:
            raise PoolerConfigError(f"--task must be one of {', '.join([*_TASKS, *_UNBUILT_TASKS])}, got {task!r}")
        task_runner, task_convert = _TASKS[task]
        if task_runner is not None and runner not in ("auto", task_runner):
            raise PoolerConfigError(f"--task {task} (vLLM's older flag, --runner {task_runner}) contradicts --runner "
                                    f"{runner}: give --runner alone")
        if task_convert is not None and convert not in ("auto", task_convert):
            raise PoolerConfigError(f"--task {task} contradicts --convert {convert}: give --runner / --convert alone")
        logger.warning("--task is vLLM's older flag: give --runner %s%s instead", task_runner or "auto",
                       f" --convert {task_convert}" if task_convert else "")
        runner = task_runner or runner
        convert = task_convert or convert
    if runner == "auto":
        runner = ("pooling" if convert in ("embed", "classify")
                  or _architecture_kind(hf_config, model_path) in ("embed", "classify") else "generate")
        if runner == "pooling":
            logger.info("--runner auto: pooling (an embedding or classification model); pass --runner explicitly")
    if runner == "generate":
        if convert in ("embed", "classify"):
            raise PoolerConfigError(f"--convert {convert} turns the model into a pooling model: it needs --runner "
                                    "pooling (or auto), not generate")
        return runner, None
    if convert == "none":
        raise PoolerConfigError("--runner pooling --convert none: voltllm's architectures are causal LMs, run as "
                                "pooling models by conversion; use --convert embed or classify (or auto)")
    if convert == "auto":
        convert = "classify" if _architecture_kind(hf_config, model_path) == "classify" else "embed"
    return runner, convert


def _architecture_kind(hf_config: Any, model_path: str) -> str:
    """What the checkpoint is by vLLM's rules: generate, embed, classify (reward: refused, not built)."""
    if sentence_transformers_pooling(model_path) is not None:
        return "embed"
    for arch in getattr(hf_config, "architectures", None) or ():
        for suffix, kind in _ARCH_DEFAULTS:
            if arch.endswith(suffix):
                if kind == "reward":
                    raise PoolerConfigError(f"architecture {arch}: {_NOT_BUILT}")
                return kind
    return "generate"


def resolve_pooler_config(value: Any, model_path: str, hf_config: Any, task: str = "embed",
                          tokenizer_path: Optional[str] = None, trust_remote_code: bool = False) -> PoolerConfig:
    """--pooler-config (a JSON object or dict; None) over the checkpoint's sentence-transformers pooler over the
    defaults (LAST, normalized), as vLLM layers them. task classify: a classifier (its head: classifier.py)."""
    user = _parse_user(value)
    if user.get("task", task) != task and not (task == "classify" and user.get("task") == "score"):
        raise PoolerConfigError(f"--pooler-config task {user['task']!r}: this engine's pooling task is {task}")
    if task == "classify":
        for key in ("normalize", "dimensions"):
            if user.get(key) is not None:
                raise PoolerConfigError(f"--pooler-config {key}: applies to embedding models, not to a classifier")
        try:
            classifier = resolve_classifier(hf_config, tokenizer_path, trust_remote_code)
        except ClassifierConfigError as e:
            raise PoolerConfigError(str(e)) from None
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        return PoolerConfig(pooling_type=user.get("pooling_type") or "LAST", normalize=False,
                            hidden_size=int(getattr(text, "hidden_size", 0) or 0), classifier=classifier)
    st = sentence_transformers_pooling(model_path) or {}
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    mds = getattr(hf_config, "matryoshka_dimensions", None)
    cfg = PoolerConfig(
        pooling_type=user.get("pooling_type") or st.get("pooling_type") or "LAST",
        normalize=next(v for v in (user.get("normalize"), st.get("normalize"), True) if v is not None),
        dimensions=user.get("dimensions"), hidden_size=hidden,
        matryoshka=bool(mds) or bool(getattr(hf_config, "is_matryoshka", False)),
        matryoshka_dimensions=tuple(int(d) for d in mds) if mds else None)
    if cfg.dimensions is not None:
        try:
            cfg.check_dimensions(cfg.dimensions, "this")
        except PoolingParamsError as e:
            raise PoolerConfigError(f"--pooler-config {e}") from None
    return cfg


def _parse_user(value: Any) -> dict:
    if value is None:  # (a JSON string is parsed by EngineArgs)
        return {}
    if not isinstance(value, dict):
        raise PoolerConfigError(f"--pooler-config must be a JSON object, got {type(value).__name__}")
    out: dict = {}
    for key, v in value.items():
        if key in ("pooling_type", "seq_pooling_type"):
            if v is None:
                continue
            if not isinstance(v, str) or v.upper() not in POOLING_TYPES:
                hint = " (token-level pooling is not built)" if str(v).upper() in ("ALL", "STEP") else ""
                raise PoolerConfigError(f"--pooler-config {key}: one of {', '.join(POOLING_TYPES)}, got {v!r}{hint}")
            if out.get("pooling_type", v.upper()) != v.upper():
                raise PoolerConfigError("--pooler-config: pooling_type and seq_pooling_type disagree: give one")
            out["pooling_type"] = v.upper()
        elif key in ("normalize", "use_activation"):
            if v is None:
                continue
            if not isinstance(v, bool):
                raise PoolerConfigError(f"--pooler-config {key} must be true or false, got {v!r}")
            if out.get("normalize", v) != v:
                raise PoolerConfigError("--pooler-config: normalize and use_activation name one switch: give one")
            out["normalize"] = v
        elif key == "dimensions":
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise PoolerConfigError(f"--pooler-config dimensions must be an integer, got {v!r}")
            out["dimensions"] = v
        elif key == "task":
            if v not in (None, "embed", "classify", "score"):
                raise PoolerConfigError(f"--pooler-config task {v!r}: embed, classify or score ({_NOT_BUILT})")
            if v is not None:
                out["task"] = v
        elif key in _DEFAULT_ONLY:
            default, why = _DEFAULT_ONLY[key]
            if v != default:
                raise PoolerConfigError(f"--pooler-config {key} {json.dumps(v)}: {why}")
        elif key in _OTHER_TASK_KEYS:
            if v is not None:
                raise PoolerConfigError(f"--pooler-config {key}: a setting of another pooling task; {_NOT_BUILT}")
        else:
            raise PoolerConfigError(f"--pooler-config: unknown key {key!r} (built: pooling_type, normalize / "
                                    "use_activation, dimensions)")
    return out


# sentence-transformers' pooling modes (1_Pooling/config.json): the first word after "pooling_mode_" names it
_ST_MODES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST", "last": "LAST"}


def sentence_transformers_pooling(model_path: str) -> Optional[dict]:
    """{"pooling_type", "normalize"} from a sentence-transformers checkpoint (modules.json listing a Pooling module,
    its config.json's pooling mode, and whether a Normalize module follows), None when there is none. A pooling mode
    that is not built (max, weighted mean) is left out, with a warning: the default then applies."""
    modules = _read_json(os.path.join(model_path, "modules.json")) if os.path.isdir(model_path) else None
    if not isinstance(modules, list):
        return None
    pooling = next((m for m in modules if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling")), None)
    if pooling is None:
        return None
    dense = [m.get("path") for m in modules if isinstance(m, dict) and str(m.get("type", "")).endswith(".Dense")]
    if dense:  # (their projection changes the embedding: without it the result would be silently wrong)
        raise PoolerConfigError(f"this sentence-transformers checkpoint projects its embeddings with Dense modules "
                                f"({', '.join(map(str, dense))}), which are not built in voltllm")
    normalize = any(isinstance(m, dict) and str(m.get("type", "")).endswith(".Normalize") for m in modules)
    out: dict = {"normalize": normalize}
    settings = _read_json(os.path.join(model_path, str(pooling.get("path", "")), "config.json")) or {}
    modes = [v for k, v in settings.items() if k == "pooling_mode" and isinstance(v, str)]
    modes += [k for k, v in settings.items() if k.startswith("pooling_mode_") and v is True]
    for mode in modes:
        word = mode.removeprefix("pooling_mode_").split("_", 1)[0].lower()
        if word in _ST_MODES:
            out["pooling_type"] = _ST_MODES[word]
        else:
            logger.warning("sentence-transformers pooling mode %r is not built; the default (LAST) applies unless "
                           "--pooler-config sets pooling_type", mode)
    return out


def _read_json(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)
