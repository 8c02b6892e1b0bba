"""Draft-model speculation, configuration time: find the draft model and check that it can draft for the target.

The draft proposes token ids that the target scores, so both must mean the same thing by every id: the same
vocabulary size, and (where both come with a tokenizer) the same token -> id map. Its KV lives in the target's
paged blocks (worker/draft_runner.py), which needs an attention-only draft too; it must also hold the target's
context length.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from voltllm.engine.speculative import SpeculativeConfig, SpeculativeConfigError

logger = logging.getLogger("voltllm")


def _vocab_size(hf_config: Any) -> int:
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return int(getattr(text, "vocab_size", 0) or 0)


def _tokenizer_vocab(path: str) -> Optional[dict[str, int]]:
    """The token -> id map of the tokenizer at `path` (a model directory or .gguf file); None without one."""
    from voltllm.model.loader import load_tokenizer

    try:
        return load_tokenizer(path).get_vocab()
    except Exception:  # noqa: BLE001 - a checkpoint without tokenizer files: the vocabulary size alone is checked
        return None


def check_vocabularies(target_vocab: int, draft_vocab: int, target_tokens: Optional[dict[str, int]],
                       draft_tokens: Optional[dict[str, int]]) -> None:
    """Raise SpeculativeConfigError unless the draft's token ids mean the target's."""
    if target_vocab != draft_vocab:
        raise SpeculativeConfigError(f"--speculative-config: the draft model's vocabulary ({draft_vocab} ids) differs "
                                     f"from the target's ({target_vocab}); a draft must share the target's tokenizer")
    if target_tokens is None or draft_tokens is None or target_tokens == draft_tokens:
        return
    by_id = {i: t for t, i in target_tokens.items()}
    diff = sorted(i for t, i in draft_tokens.items() if by_id.get(i) != t) or sorted(set(by_id) - set(
        draft_tokens.values()))
    raise SpeculativeConfigError(f"--speculative-config: the draft model's tokenizer differs from the target's "
                                 f"({len(diff)} ids map to other tokens, first id {diff[0]}); a draft must share the "
                                 "target's tokenizer")


def resolve_draft(spec: SpeculativeConfig, target_hf_config: Any, target_tokenizer: Optional[str],
                  download_dir: Optional[str] = None, token: Any = None,
                  trust_remote_code: bool = False) -> SpeculativeConfig:
    """spec with the draft's local path and HF config, after the checks above (SpeculativeConfigError if one
    fails). target_tokenizer: the target's tokenizer path (None: --skip-tokenizer-init, sizes only)."""
    from voltllm.model.loader import ModelLoadError, load_hf_config, resolve_model
    from voltllm.model.models.registry import attention_only

    try:
        source = resolve_model(spec.model, spec.revision, download_dir, token, trust_remote_code)
        hf_config = load_hf_config(source, trust_remote_code=trust_remote_code)
    except (ModelLoadError, OSError, ValueError) as e:
        raise SpeculativeConfigError(f"--speculative-config: cannot load the draft model {spec.model!r}: {e}") from None
    if not attention_only(hf_config):
        raise SpeculativeConfigError(f"--speculative-config: the draft model must be attention-only (llama / qwen2 / "
                                     f"qwen3), not {getattr(hf_config, 'model_type', None)!r}")
    tokens = (None, None)
    if target_tokenizer is not None:
        tokens = (_tokenizer_vocab(target_tokenizer), _tokenizer_vocab(source.tokenizer_path))
    check_vocabularies(_vocab_size(target_hf_config), _vocab_size(hf_config), *tokens)
    logger.info("draft model %s (%s, %d layers)", source.path, getattr(hf_config, "model_type", "?"),
                getattr(hf_config, "num_hidden_layers", 0))
    return spec.with_draft(source.path, hf_config)

