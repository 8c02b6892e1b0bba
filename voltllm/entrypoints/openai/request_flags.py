"""The flags that shape how requests are answered (served names, chat template, tool and reasoning parsers, logprobs,
usage, request logs): shared by `voltllm serve` and `voltllm run-batch`, which answer requests with the same app."""
from __future__ import annotations

import argparse
from typing import Any, Optional

from voltllm.cli_args import json_object_arg
from voltllm.config import ConfigError
from voltllm.entrypoints.chat_content_format import CONTENT_FORMATS


def add_request_args(g: Any) -> None:
    """The request flags, into an argparse parser or group."""
    from voltllm.entrypoints.openai.parsers import REASONING_PARSERS, TOOL_PARSERS

    g.add_argument("--served-model-name", dest="served_model_names", nargs="+", default=None,
                   help="model name(s) the API answers to (the first one is reported); default: the model path")
    from voltllm.lora.modules import lora_module_arg

    g.add_argument("--lora-modules", nargs="+", type=lora_module_arg, default=None, metavar="NAME=PATH",
                   help='LoRA adapters served under their own model names: name=path or a JSON object {"name", '
                   '"path", "base_model_name"} (needs --enable-lora)')
    g.add_argument("--default-chat-template-kwargs", type=json_object_arg("--default-chat-template-kwargs"),
                   default=None, help='JSON object passed to the chat template, e.g. \'{"enable_thinking": false}\'; '
                   "a request's chat_template_kwargs override it")
    g.add_argument("--chat-template-content-format", default="auto", choices=CONTENT_FORMATS,
                   help="message content as the chat template gets it: one string, or a list of OpenAI parts "
                   "(openai); auto: parts when the template loops over a message's content")
    g.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=False,
                   help='parse tool calls from the output when a request has tools and tool_choice "auto"')
    g.add_argument("--tool-call-parser", default=None, help=f"one of: {', '.join(TOOL_PARSERS)}")
    g.add_argument("--reasoning-parser", default=None,
                   help=f"one of: {', '.join(REASONING_PARSERS)} (splits <think>...</think> into reasoning_content)")
    g.add_argument("--response-role", default="assistant", help="role of the generated chat message")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="largest logprobs / top_logprobs a request may ask; -1: no limit (a request's -1 asks for "
                   "the whole vocabulary)")
    g.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per streamed chunk (the first chunk and each choice's last are sent at once); a "
                   "request's stream_interval may ask for more")
    g.add_argument("--trust-request-chat-template", action=argparse.BooleanOptionalAction, default=None,
                   help="a request's chat_template is applied (what voltllm always does; the --no- form is refused)")
    g.add_argument("--exclude-tools-when-tool-choice-none", action=argparse.BooleanOptionalAction, default=False,
                   help='the chat template gets no tools when a request\'s tool_choice is "none"')
    g.add_argument("--return-tokens-as-token-ids", action=argparse.BooleanOptionalAction, default=False,
                   help='logprob tokens as "token_id:N" (tokens that are not valid UTF-8 on their own stay '
                   "identifiable); a request's return_tokens_as_token_ids overrides it")
    g.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="log each request's id, sizes and prompt (see --max-log-len)")
    g.add_argument("--disable-log-requests", action="store_true", help="accepted for vLLM compatibility (default)")
    g.add_argument("--max-log-len", type=int, default=None,
                   help="most prompt / output characters (or token ids) in the request log (default: all)")
    g.add_argument("--enable-log-outputs", action=argparse.BooleanOptionalAction, default=False,
                   help="with --enable-log-requests: also log each finished request's generated text")
    g.add_argument("--enable-log-deltas", action=argparse.BooleanOptionalAction, default=True,
                   help="with --enable-log-outputs: also log each streamed chunk's new text as it is sent")
    g.add_argument("--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction, default=False,
                   help="report usage.prompt_tokens_details.cached_tokens (prefix-cache hits)")
    g.add_argument("--enable-force-include-usage", action=argparse.BooleanOptionalAction, default=False,
                   help="send usage in every stream, as if stream_options.include_usage were set")


def check_request_flags(args: argparse.Namespace) -> None:
    """Refuse request flags that cannot be honoured (ConfigError -> exit 2), before any model is loaded."""
    from voltllm.entrypoints.openai.parsers import REASONING_PARSERS, TOOL_PARSERS

    if args.tool_call_parser is not None and args.tool_call_parser not in TOOL_PARSERS:
        raise ConfigError(f"--tool-call-parser {args.tool_call_parser!r} is not built; available: "
                          f"{', '.join(TOOL_PARSERS)}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser")
    if args.reasoning_parser is not None and args.reasoning_parser not in REASONING_PARSERS:
        raise ConfigError(f"--reasoning-parser {args.reasoning_parser!r} is not built; available: "
                          f"{', '.join(REASONING_PARSERS)}")
    if args.max_logprobs < -1:
        raise ConfigError(f"--max-logprobs must be >= 0, or -1 (no limit), got {args.max_logprobs}")
    if args.stream_interval < 1:
        raise ConfigError(f"--stream-interval must be >= 1 (tokens per streamed chunk), got {args.stream_interval}")
    if args.trust_request_chat_template is False:
        raise ConfigError("--no-trust-request-chat-template: refusing a request's chat_template is not built; voltllm "
                          "applies the chat_template a request sends (as --trust-request-chat-template does)")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ConfigError(f"--max-log-len must be >= 0 (characters or token ids), got {args.max_log_len}")
    if args.enable_log_outputs and not args.enable_log_requests:
        raise ConfigError("--enable-log-outputs logs outputs into the request log: add --enable-log-requests")
    if args.served_model_names is not None and any(not n for n in args.served_model_names):
        raise ConfigError("--served-model-name must not be empty")


def lora_modules(config: Any, args: argparse.Namespace, names: list[str]) -> dict:
    """--lora-modules as name -> LoRARequest, each adapter checked against the model (ConfigError), before the engine
    starts."""
    from voltllm.lora.modules import resolve_lora_modules

    return resolve_lora_modules(args.lora_modules, config, names)


def server_state(config: Any, args: argparse.Namespace, names: list[str], engine: Any,
                 loras: Optional[dict] = None) -> Any:
    """The app's ServerState for a started engine (its max_model_len: --max-model-len auto is fitted by then);
    loras: lora_modules' adapters."""
    from voltllm.engine.frontend import generation_defaults
    from voltllm.entrypoints.openai.serving_common import TEXT_ONLY, ServerState
    from voltllm.multimodal.processor import image_processor_for
    from voltllm.multimodal.support import image_input_refusal

    images = image_processor_for(config)
    return ServerState(
        images=images, image_refusal=image_input_refusal(config) or TEXT_ONLY,
        image_limit=config.multimodal.image_limit, video_limit=config.multimodal.video_limit,
        media=config.multimodal.media_settings(),
        engine=engine, served_model_names=names, max_model_len=engine.max_model_len, lora_modules=dict(loras or {}),
        model_path=config.model.model, chat_template=config.model.chat_template,
        default_chat_template_kwargs=dict(args.default_chat_template_kwargs or {}),
        chat_template_content_format=args.chat_template_content_format,
        response_role=args.response_role, max_logprobs=args.max_logprobs,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids, stream_interval=args.stream_interval,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
        grammar_after_reasoning=config.reasoning is not None and config.reasoning.grammar_after_reasoning,
        thinking_budgets=config.reasoning is not None,
        reasoning_delimiters=(config.reasoning.start_str, config.reasoning.end_str) if config.reasoning else None,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_prompt_embeds=config.model.enable_prompt_embeds,
        enable_force_include_usage=args.enable_force_include_usage, log_requests=args.enable_log_requests,
        max_log_len=args.max_log_len, log_outputs=args.enable_log_outputs, log_deltas=args.enable_log_deltas,
        runner=config.model.runner,
        classifier=config.model.pooler.classifier if config.model.pooler is not None else None,
        generation_defaults=generation_defaults(config.model.model, config.model.generation_config,
                                                config.model.override_generation_config))
