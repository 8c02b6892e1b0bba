"""--reasoning-config (vLLM's) and --reasoning-parser: the token ids that open and close a reasoning model's reasoning,
for `thinking_token_budget` and for structured outputs that start after the reasoning (engine/reasoning_state.py).

The strings are vLLM's `reasoning_start_str` / `reasoning_end_str`, tokenized with the model's tokenizer without
special tokens; a string not given comes from --reasoning-parser (qwen3 / deepseek_r1: "<think>" / "</think>").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from voltllm.config import ConfigError, parse_json_object

_KEYS = ("reasoning_start_str", "reasoning_end_str")


@dataclass(frozen=True)
class ReasoningConfig:
    start_str: str
    end_str: str
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    # grammars (structured outputs, forced tool choices) start after the reasoning: with --reasoning-parser unless
    # --structured-outputs-config enable_in_reasoning is true (vLLM's rule: its reasoner comes from the parser; the
    # strings of --reasoning-config alone serve the thinking budget)
    grammar_after_reasoning: bool = False


def _parsed(value: Any) -> dict:
    value = parse_json_object("--reasoning-config", value) or {}
    for key, v in value.items():
        if key == "reasoning_parser":
            raise ConfigError("--reasoning-config reasoning_parser: give it as --reasoning-parser")
        if key not in _KEYS:
            raise ConfigError(f"--reasoning-config {key}: not a key voltllm reads (reasoning_start_str, "
                              "reasoning_end_str)")
        if not isinstance(v, str) or not v:
            raise ConfigError(f"--reasoning-config {key} must be a non-empty string, got {v!r}")
    return value


def check_reasoning_flags(reasoning_parser: Optional[str], reasoning_config: Any) -> tuple[str, str]:
    """The flags' own checks (before the model is read: a built parser, known keys, both strings) and the
    delimiters they give ("" twice: neither flag)."""
    given = _parsed(reasoning_config)
    defaults = _parser_delimiters(reasoning_parser)
    if reasoning_parser is None and not given:
        return "", ""
    start = given.get("reasoning_start_str", defaults[0])
    end = given.get("reasoning_end_str", defaults[1])
    if not start or not end:
        missing = "reasoning_start_str" if not start else "reasoning_end_str"
        raise ConfigError(f"--reasoning-config needs {missing} (or --reasoning-parser, which knows both)")
    return start, end


def _parser_delimiters(reasoning_parser: Optional[str]) -> tuple[str, str]:
    if reasoning_parser is None:
        return "", ""
    from voltllm.entrypoints.openai.parsers import REASONING_PARSERS

    parser = REASONING_PARSERS.get(reasoning_parser)
    if parser is None:
        raise ConfigError(f"--reasoning-parser {reasoning_parser!r} is not built; available: "
                          f"{', '.join(REASONING_PARSERS)}")
    return parser.start_str, parser.end_str


def resolve_reasoning(reasoning_parser: Optional[str], reasoning_config: Any, enable_in_reasoning: bool,
                      skip_tokenizer_init: bool, load_tokenizer: Callable[[], Any]) -> Optional[ReasoningConfig]:
    """The reasoning delimiters as token ids (None: neither flag given); ConfigError for an unknown parser or key, a
    missing string, or one that tokenizes to nothing."""
    start, end = check_reasoning_flags(reasoning_parser, reasoning_config)
    if not start:
        return None
    if skip_tokenizer_init:
        if reasoning_config is not None:
            raise ConfigError("--reasoning-config: its strings are tokenized with the model's tokenizer, which "
                              "--skip-tokenizer-init leaves out; drop one of them")
        return None  # (no tokenizer, no text: nothing reads the reasoning)
    tokenizer = load_tokenizer()
    ids = []
    for key, text in (("reasoning_start_str", start), ("reasoning_end_str", end)):
        tokens = tuple(tokenizer.encode(text, add_special_tokens=False))
        if not tokens:
            raise ConfigError(f"--reasoning-config {key} {text!r} tokenizes to no token with this model's tokenizer")
        ids.append(tokens)
    return ReasoningConfig(start, end, ids[0], ids[1],
                           grammar_after_reasoning=reasoning_parser is not None and not enable_in_reasoning)
