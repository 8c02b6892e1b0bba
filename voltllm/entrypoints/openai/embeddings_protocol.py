"""POST /v1/embeddings request (OpenAI's fields plus vLLM's), in its two forms: `input` (a string, strings, token ids
or lists of token ids) or `messages` (vLLM's chat form, templated as a chat completion's prompt)."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import ConfigDict, Field, StrictInt, StrictStr, model_validator

from voltllm.entrypoints.openai.errors import bad_request
from voltllm.entrypoints.openai.protocol import NullMeansDefault

EmbeddingInput = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class EmbeddingRequest(NullMeansDefault):
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    input: Optional[EmbeddingInput] = None
    messages: Optional[list[dict[str, Any]]] = None  # vLLM's chat form (instead of input)
    # float: JSON numbers; base64: each embedding's bytes as base64 text; bytes (vLLM's): the embeddings' bytes as the
    # whole binary body, the rest in a `metadata` header; bytes_only: the body alone
    encoding_format: Literal["float", "base64", "bytes", "bytes_only"] = "float"
    dimensions: Optional[int] = None  # matryoshka models only (else a 400, as vLLM's)
    user: Optional[str] = None
    # vLLM's extra parameters
    truncate_prompt_tokens: Optional[int] = Field(default=None, ge=-1)  # keep the last k tokens (-1: the context)
    truncation_side: Optional[Literal["left", "right"]] = None  # right: truncate_prompt_tokens keeps the first k
    add_special_tokens: Optional[bool] = None  # default: true for input, false for messages (the template writes them)
    normalize: Optional[bool] = None  # (vLLM's older name of use_activation)
    use_activation: Optional[bool] = None  # L2-normalize the embedding (None: the model's default)
    embed_dtype: Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"] = "float32"  # base64's / bytes'
    endianness: Literal["native", "big", "little"] = "native"  # base64's / bytes' byte order
    request_id: Optional[str] = None
    cache_salt: Optional[str] = None
    priority: int = 0  # --scheduling-policy priority: lower first (else only 0: the engine's 400)
    # the chat form's templating (as /v1/chat/completions; add_generation_prompt off by default here, as vLLM's)
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _one_form(self) -> "EmbeddingRequest":
        if (self.input is None) == (self.messages is None):
            raise ValueError("give either 'input' (text or token ids) or 'messages' (a chat)")
        return self

    def check(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                              "continue_final_message")
        if self.messages is None and (self.chat_template is not None or self.chat_template_kwargs):
            raise bad_request("chat_template and chat_template_kwargs apply to the messages form", "chat_template")

    def inputs(self) -> list[Union[str, list[int]]]:
        """The `input` form's prompts: each a string or a list of token ids."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if not value:
            raise bad_request("input must not be empty", "input")
        if all(isinstance(v, int) for v in value):
            return [list(value)]
        return list(value)
