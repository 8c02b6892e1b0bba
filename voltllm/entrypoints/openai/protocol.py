"""Request models (pydantic) for the OpenAI-compatible routes, and their mapping to SamplingParams.

Field names follow the OpenAI API plus vLLM's extensions (top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, stop_token_ids, allowed_token_ids, bad_words, skip_special_tokens, include_stop_str_in_output,
chat_template_kwargs, ...).
Unknown fields are accepted and ignored, as OpenAI clients send new fields before servers know them.
Responses are plain dicts built in serving_chat.py / serving_completion.py.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationInfo, field_validator, model_validator

from voltllm.entrypoints.openai.beam_search import check_beam_search
from voltllm.entrypoints.openai.errors import bad_request
from voltllm.entrypoints.openai.structured import structured_outputs_of
from voltllm.entrypoints.openai.tool_choice import forced_tool_choice
from voltllm.sampling.structured import StructuredOutputsParams
from voltllm.sampling.params import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class NullMeansDefault(BaseModel):
    """A JSON null for a field that has a non-null default means that default (clients write `"stream": null`,
    `"n": null`; vLLM's and OpenAI's schemas take them)."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_to_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            nulls = [k for k, v in data.items() if v is None and k in cls.model_fields
                     and cls.model_fields[k].default is not None and not cls.model_fields[k].is_required()]
            if nulls:
                data = {k: v for k, v in data.items() if k not in nulls}
        return data


class _SamplingFields(NullMeansDefault):
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    max_tokens: Optional[int] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    logit_bias: Optional[dict[str, Any]] = None  # checked by SamplingParams (ids, finite values)
    response_format: Optional[dict[str, Any]] = None
    cache_salt: Optional[str] = None
    request_id: Optional[str] = None
    return_tokens_as_token_ids: Optional[bool] = None  # vLLM's: logprob tokens as "token_id:N" (None: the server's)
    best_of: Optional[int] = None
    # structured outputs, vLLM's extra parameters (response_format is OpenAI's): at most one per request
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    structured_outputs: Optional[dict[str, Any]] = None
    # vLLM's: keep the prompt's last k tokens (-1: as many as the context holds); tokenize with special tokens
    truncate_prompt_tokens: Optional[int] = None
    # vLLM's: the end truncate_prompt_tokens cuts: left (None, the default) keeps the last k tokens, right the first k
    truncation_side: Optional[Literal["left", "right"]] = None
    return_token_ids: Optional[bool] = None  # vLLM's: token_ids per choice and the prompt's prompt_token_ids
    # vLLM's: lower is served first under --scheduling-policy priority; under fcfs anything but 0 is a 400 (the
    # engine's check_priority, at submission)
    priority: int = 0
    # vLLM's sampling restrictions, checked by SamplingParams (ids, non-empty) and against the vocabulary
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    # vLLM's beam search (beam_search.py): n is the beam width; length_penalty its score's exponent (None: 1)
    use_beam_search: Optional[bool] = None
    length_penalty: Optional[float] = None
    early_stopping: Optional[Union[bool, str]] = None  # vLLM's older beam-search field: only false / null taken
    # vLLM's: tokens per streamed chunk, raised to the server's --stream-interval (stream_interval.py)
    stream_interval: Optional[int] = None
    # vLLM's: the most tokens the reasoning may hold before its end is forced (-1: no cap); needs the server's
    # --reasoning-parser or --reasoning-config (else a 400 from the Frontend)
    thinking_token_budget: Optional[int] = None
    # vLLM's, not built here: refused unless at the value that asks for nothing (check_unbuilt)
    logits_processors: Optional[list[Any]] = None
    kv_transfer_params: Optional[dict[str, Any]] = None
    ec_transfer_params: Optional[dict[str, Any]] = None
    vllm_xargs: Optional[dict[str, Any]] = None
    logprob_token_ids: Optional[list[int]] = None
    mm_processor_kwargs: Optional[dict[str, Any]] = None
    media_io_kwargs: Optional[dict[str, Any]] = None
    prompt_embeds: Optional[Any] = None
    # vLLM's: finish the request (finish_reason "repetition") when its output ends in a repeated token pattern:
    # {max_pattern_size, min_pattern_size, min_count} (sampling/repetition.py), or vLLM's older flat fields
    repetition_detection: Optional[dict[str, Any]] = None
    max_repetition_pattern_size: Optional[int] = None
    min_repetition_pattern_size: Optional[int] = None
    repetition_min_count: Optional[int] = None

    def constraint(self) -> Optional[StructuredOutputsParams]:
        """The request's one output constraint, or None; a bad or doubled one is a 400 naming its parameter."""
        return structured_outputs_of(self)

    def repetition(self) -> Optional[dict[str, Any]]:
        """repetition_detection's fields, from its object or vLLM's older flat fields (one spelling per request);
        SamplingParams checks them."""
        flat = {"max_pattern_size": self.max_repetition_pattern_size,
                "min_pattern_size": self.min_repetition_pattern_size, "min_count": self.repetition_min_count}
        flat = {k: v for k, v in flat.items() if v is not None}
        if flat and self.repetition_detection is not None:
            raise bad_request("repetition_detection cannot be combined with max_repetition_pattern_size / "
                              "min_repetition_pattern_size / repetition_min_count (vLLM's older spelling of its "
                              "fields): give one of them", "repetition_detection")
        return flat or self.repetition_detection

    def _common_checks(self) -> None:
        self.constraint()
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported", "best_of", "unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if self.cache_salt is not None and not self.cache_salt:
            raise bad_request("cache_salt must be a non-empty string", "cache_salt")
        if self.truncate_prompt_tokens is not None and (self.truncate_prompt_tokens == 0
                                                        or self.truncate_prompt_tokens < -1):
            raise bad_request("truncate_prompt_tokens must be an integer >= 1 (keep the prompt's last k tokens) or "
                              f"-1 (the context length), got {self.truncate_prompt_tokens}", "truncate_prompt_tokens")
        check_unbuilt(self, ("prompt_embeds",) if isinstance(self, CompletionRequest) else ())
        check_beam_search(self)

    def sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int],
                        prompt_logprobs: Optional[int] = None, defaults: Optional[dict] = None) -> SamplingParams:
        """Unset fields take the model's generation_config defaults (--generation-config), then vLLM's."""
        d = defaults or {}

        def pick(name: str, fallback):
            value = getattr(self, name)
            return d.get(name, fallback) if value is None else value

        return SamplingParams(
            n=self.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", -1),
            min_p=pick("min_p", 0.0),
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", 1.0),
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            structured_outputs=self.constraint(),  # (checked in check(); grammars are cached)
            thinking_token_budget=self.thinking_token_budget,
            repetition_detection=self.repetition(),
        )


_MULTIMODAL = ("per-request multimodal settings are not built: the server's --mm-processor-kwargs and "
               "--media-io-kwargs apply to every image and video")
_UNBUILT = {  # vLLM request field -> (asks for nothing when, what voltllm lacks)
    "logits_processors": (lambda v: not v, "per-request logits processors are not built"),
    "kv_transfer_params": (lambda v: v is None, "KV-cache transfer (disaggregated prefill) is not built"),
    "ec_transfer_params": (lambda v: not v, "encoder-cache transfer (multimodal disaggregation) is not built"),
    "vllm_xargs": (lambda v: not v, "extension arguments (vllm_xargs) are not built: no extension reads them"),
    "logprob_token_ids": (lambda v: not v, "logprobs of fixed token ids are not built (use logprobs with "
                                           "top_logprobs / prompt_logprobs)"),
    "mm_processor_kwargs": (lambda v: not v, _MULTIMODAL),
    "media_io_kwargs": (lambda v: not v, _MULTIMODAL),
    # (/v1/completions takes them: CompletionRequest leaves this entry out)
    "prompt_embeds": (lambda v: v is None, "prompt embeddings as input are built for /v1/completions only (with "
                                           "--enable-prompt-embeds), not for this route"),
}


def check_unbuilt(req: Any, taken: tuple = ()) -> None:
    """A 400 naming the first vLLM field that asks for something voltllm does not build (rather than a 200 that
    silently differs); the values that ask for nothing (null, empty, defaults) pass, as vLLM treats them. taken: the
    fields this kind of request does take."""
    for name, (nothing, why) in _UNBUILT.items():
        if name in taken:
            continue
        value = getattr(req, name, None)
        if not nothing(value):
            raise bad_request(f"{name}: {why} in voltllm", name, "unsupported_parameter")


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None  # vLLM's: the prompt tokens' logprobs, in the response's top level
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = True
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    reasoning_effort: Optional[str] = None
    # vLLM's: false leaves the reasoning (--reasoning-parser) out of the answer (it is still generated: a grammar
    # still starts after it)
    include_reasoning: bool = True
    return_prompt_text: Optional[bool] = None  # vLLM's: the templated prompt as prompt_text (streamed: first chunk)
    documents: Optional[list[dict[str, Any]]] = None  # RAG templates' documents, to the chat template (vLLM's)
    add_special_tokens: bool = False  # vLLM's chat default: the template writes the special tokens itself

    def template_kwargs(self) -> Optional[dict[str, Any]]:
        """chat_template_kwargs with what vLLM adds from the request: reasoning_effort (templates that read it use
        it) and, unless the request's chat_template_kwargs set it, enable_thinking = the effort is not "none" (vLLM's
        rule: asking for reasoning turns thinking on, also over --default-chat-template-kwargs), and documents."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        if self.documents is not None:
            kwargs.setdefault("documents", self.documents)
        return kwargs or self.chat_template_kwargs

    def constraint(self) -> Optional[StructuredOutputsParams]:
        # tool_choice "required" / a named function is a constraint too (tool_choice.py): one per request
        own = structured_outputs_of(self)
        forced = forced_tool_choice(self.tools, self.tool_choice, self.parallel_tool_calls)
        if forced is None:
            return own
        if own is not None:
            raise bad_request("tool_choice 'required' or a named function constrains the output itself, so it "
                              "cannot be combined with response_format, guided_* or structured_outputs",
                              "tool_choice")
        return forced.params()

    def check(self) -> None:
        self._common_checks()
        if self.top_logprobs and not self.logprobs:  # 0 asks for nothing: accepted alone, as in vLLM
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise bad_request(f"max_completion_tokens must be an integer >= 1, got {self.max_completion_tokens}",
                              "max_completion_tokens")
        _check_prompt_logprobs(self)
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                              "continue_final_message")

    @property
    def num_logprobs(self) -> Optional[int]:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


def _check_prompt_logprobs(req: Any) -> None:
    if req.prompt_logprobs is not None and req.stream:  # they come with the final response only (vLLM's rule)
        raise bad_request("prompt_logprobs is not available when stream is true", "prompt_logprobs")


PromptInput = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingFields):
    # (or prompt_embeds: --enable-prompt-embeds; both: the embeddings' choices first)
    prompt: Optional[PromptInput] = Field(default=None, validate_default=True)
    echo: bool = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None
    prompt_logprobs: Optional[int] = None
    add_special_tokens: bool = True  # vLLM's completions default (a BOS where the tokenizer adds one)

    @field_validator("prompt")
    @classmethod
    def _given(cls, prompt: Any, info: ValidationInfo) -> Any:
        # (a body without either is no completion request: SageMaker's /invocations then tries no further)
        if prompt is None and info.data.get("prompt_embeds") is None:
            raise ValueError("give prompt (or prompt_embeds)")
        return prompt

    def check(self) -> None:
        self._common_checks()
        _check_prompt_logprobs(self)
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix", "unsupported_parameter")

    def prompts(self) -> list[Union[str, list[int]]]:
        p = self.prompt
        if p is None:  # (prompt_embeds alone: the validator refused neither)
            return []
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        if all(isinstance(x, str) for x in p):
            return list(p)  # type: ignore[arg-type]
        if all(isinstance(x, list) for x in p):
            for x in p:
                if not x:
                    raise bad_request("a token-id prompt must not be empty", "prompt")
            return [list(x) for x in p]  # type: ignore[arg-type]
        raise bad_request("prompt must be a string, a list of strings, a list of token ids, or a list of "
                          "token-id lists", "prompt")


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    tokens: list[int] = Field(default_factory=list)
