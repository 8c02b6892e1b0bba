"""What chat and completion serving share: server state, model-name checks, message validation and
chat templating, submitting requests, merging streams, disconnect watching, logprob and usage shapes."""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, Mapping, Optional, Union

from fastapi.responses import StreamingResponse

from voltllm.engine.async_llm import (AsyncLLM, EngineDeadError, InvalidRequestError, RequestAbortedError,
                                      RequestStream)
from voltllm.engine.frontend import InvalidPromptError
from voltllm.engine.outputs import Logprob, RequestOutput
from voltllm.engine.request_checks import kept_prompt
from voltllm.entrypoints.chat_content_format import resolve_content_format
from voltllm.entrypoints.openai.errors import OpenAIError, bad_request, error_body
from voltllm.entrypoints.openai.request_log import OutputLoggingStream
from voltllm.entrypoints.openai.stream_interval import IntervalStream
from voltllm.multimodal.media import MediaSettings
from voltllm.sampling.params import SamplingParams, SamplingParamsError
from voltllm.tracing import trace_headers_of

logger = logging.getLogger("voltllm")

LOGPROB_FLOOR = -9999.0  # JSON has no -inf
TEXT_ONLY = "this server serves a text-only model (no image, audio or video input)"
IMAGE_ROUTES = ("images are taken by /v1/chat/completions, /v1/responses, /v1/messages (and its count_tokens) and "
                "/tokenize, videos by /v1/chat/completions and /tokenize, not by this route (it renders the messages "
                "alone)")


@dataclass
class ServerState:
    engine: AsyncLLM
    served_model_names: list[str]
    max_model_len: int
    model_path: str
    chat_template: Optional[str] = None
    default_chat_template_kwargs: dict = field(default_factory=dict)
    response_role: str = "assistant"
    max_logprobs: int = 20  # -1: no limit (a request's -1 asks for the whole vocabulary), as vLLM's
    reasoning_parser: Optional[str] = None
    # grammars (structured outputs, forced tool choices) start after the reasoning (--reasoning-parser without
    # --structured-outputs-config enable_in_reasoning true): a forced choice's output is reasoning, then its calls
    grammar_after_reasoning: bool = False
    # the engine knows the reasoning's delimiters (--reasoning-parser / --reasoning-config): thinking budgets apply
    thinking_budgets: bool = False
    # (start, end) strings of the reasoning when --reasoning-config names them: the parser splits on these too
    reasoning_delimiters: Optional[tuple[str, str]] = None
    tool_call_parser: Optional[str] = None
    enable_auto_tool_choice: bool = False
    enable_prompt_tokens_details: bool = False
    enable_prompt_embeds: bool = False  # /v1/completions' prompt_embeds (engine/prompt_embeds.py)
    enable_force_include_usage: bool = False
    log_requests: bool = False
    max_log_len: Optional[int] = None  # prompt / output characters (or token ids) in the request log
    log_outputs: bool = False  # log each finished choice's text (with log_requests)
    log_deltas: bool = True  # and, streamed, each chunk's new text (--enable-log-deltas, with log_outputs)
    chat_template_content_format: str = "auto"  # auto | string | openai (chat_content_format.py)
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:N"
    stream_interval: int = 1  # --stream-interval: tokens per streamed chunk (stream_interval.py)
    exclude_tools_when_tool_choice_none: bool = False  # the template gets no tools under tool_choice "none"
    generation_defaults: dict = field(default_factory=dict)  # from generation_config.json
    runner: str = "generate"  # generate | pooling (one runner per engine, as vLLM): which model routes answer
    # a pooling engine's classification head (voltllm.pooling.classifier.ClassifierConfig; None: embeddings): the
    # score / rerank / classify routes answer on a classifier, /v1/embeddings on an embedding model
    classifier: Any = None
    # --lora-modules and the adapters /v1/load_lora_adapter loaded (--allow-runtime-lora-updating): adapter name ->
    # LoRARequest (voltllm.lora); a request naming one as its model runs with it
    lora_modules: dict = field(default_factory=dict)
    # image and video input: the model's processor when the engine takes them (multimodal/processor.py), else None
    # and image_refusal says why (multimodal/support.py); most images / videos per request (--limit-mm-per-prompt);
    # what media URLs may be read (--allowed-local-media-path, --allowed-media-domains)
    images: Any = None
    image_refusal: str = TEXT_ONLY
    image_limit: int = 999
    video_limit: int = 999
    media: MediaSettings = field(default_factory=MediaSettings)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def serves(self, name: str) -> bool:
        """Whether `name` is a served model name or a LoRA adapter loaded now."""
        return name in self.served_model_names or name in self.lora_modules

    def model_name(self, requested: Optional[str]) -> str:
        """The name to answer with; a 404 (OpenAI's and vLLM's status) for a model this server does not serve."""
        if requested is None or requested == "" or self.serves(requested):
            return requested or self.served_model_names[0]
        raise self._model_not_found(requested)

    def _model_not_found(self, requested: str) -> OpenAIError:
        return OpenAIError(f"The model `{requested}` does not exist; this server serves "
                           f"{', '.join(repr(n) for n in [*self.served_model_names, *self.lora_modules])}", 404,
                           "model", "model_not_found")

    def lora_request(self, model: Optional[str]) -> Any:
        """The LoRARequest a request naming `model` runs with (None: the base model); the 404 of model_name for an
        adapter unloaded since the request's name was checked (it must not run on the base model instead)."""
        if not model or model in self.served_model_names:
            return None
        lora = self.lora_modules.get(model)
        if lora is None:
            raise self._model_not_found(model)
        return lora

    def template_messages(self, messages: Any, chat_template: Optional[str], tools: Optional[list],
                          image_urls: Optional[list] = None, video_urls: Optional[list] = None) -> list[dict]:
        """normalize_messages in the content format the applied template takes (--chat-template-content-format).
        image_urls / video_urls: lists the image / video parts' URLs are appended to, in order, by a route that sends
        them on (with a server that takes them); without them such parts are refused, saying why."""
        fmt = resolve_content_format(self.chat_template_content_format, self.tokenizer,
                                     chat_template or self.chat_template, tools)
        if self.images is None:
            return normalize_messages(messages, fmt, refusal=self.image_refusal)
        if image_urls is None:
            return normalize_messages(messages, fmt, refusal=IMAGE_ROUTES)
        return normalize_messages(messages, fmt, image_urls=image_urls, video_urls=video_urls)

    def tokens_as_ids(self, req: Any) -> bool:
        """Whether logprob tokens are written "token_id:N": the request's return_tokens_as_token_ids, else the
        server's --return-tokens-as-token-ids."""
        asked = getattr(req, "return_tokens_as_token_ids", None)
        return self.return_tokens_as_token_ids if asked is None else bool(asked)

    def check_logprobs(self, n: Optional[int], param: str) -> Optional[int]:
        """A request's logprobs count as the engine takes it (vLLM's -1: the whole vocabulary, with --max-logprobs
        -1 only); a 400 for a count above --max-logprobs."""
        if n is None:
            return None
        unlimited = self.max_logprobs == -1
        if n == -1 and unlimited:
            return self.engine.vocab_size
        if n < 0 or (not unlimited and n > self.max_logprobs):
            whole = " (-1, the whole vocabulary, needs --max-logprobs -1)" if n == -1 else ""
            most = "the vocabulary size, or -1" if unlimited else f"{self.max_logprobs} (--max-logprobs)"
            raise bad_request(f"{param} must be between 0 and {most}, got {n}{whole}", param)
        return n


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# -- chat messages ------------------------------------------------------------------------------------
_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


def normalize_messages(messages: Any, content_format: str = "string", image_urls: Optional[list] = None,
                       refusal: str = TEXT_ONLY, video_urls: Optional[list] = None) -> list[dict]:
    """Validate chat messages. Content for the template (--chat-template-content-format): `string` flattens text
    parts to one string; `openai` makes every content a list of {"type": "text", "text"} parts (a string content one
    part, an assistant turn with only tool calls none), as vLLM passes them. Image parts (OpenAI's image_url, its url
    in an object or a bare string, as vLLM takes both) are taken only given `image_urls`: each becomes
    {"type": "image"} in place (vLLM's part for the template) and its URL is appended; video parts (vLLM's
    video_url, the same two forms) likewise as {"type": "video"} given `video_urls` too; else they, and every other
    multimodal part, are refused with `refusal`."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object with 'role' and 'content'", "messages")
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(sorted(_ROLES))}, got {role!r}", "messages")
        msg = dict(m)
        content = m.get("content")
        media: dict[int, str] = {}  # the indexes in texts that stand for image / video parts -> "image" / "video"
        if isinstance(content, list):
            texts: list[str] = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or "type" not in part:
                    raise bad_request(f"{where}.content[{j}] must be an object with a 'type'", "messages")
                if part["type"] in ("text", "input_text", "output_text"):
                    if not isinstance(part.get("text"), str):
                        raise bad_request(f"{where}.content[{j}].text must be a string", "messages")
                    texts.append(part["text"])
                elif part["type"] == "refusal":
                    texts.append(str(part.get("refusal", "")))
                elif part["type"] == "image_url" and image_urls is not None:
                    image_urls.append(_image_url(part, f"{where}.content[{j}]", content_format))
                    media[len(texts)] = "image"
                    texts.append("")
                elif part["type"] == "video_url" and video_urls is not None:
                    video_urls.append(_image_url(part, f"{where}.content[{j}]", content_format, "video"))
                    media[len(texts)] = "video"
                    texts.append("")
                elif image_urls is not None:
                    takes = "images and videos (image_url, video_url parts)" if video_urls is not None else \
                        "images (image_url parts) but no video on this route (/v1/chat/completions and /tokenize " \
                        "take videos)"
                    raise bad_request(f"{where}.content[{j}] has type {part['type']!r}: this server takes {takes}, "
                                      "no audio or file input", "messages", "unsupported_content")
                else:
                    raise bad_request(f"{where}.content[{j}] has type {part['type']!r}: {refusal}", "messages",
                                      "unsupported_content")
        elif content is None:
            if role not in ("assistant", "tool"):
                raise bad_request(f"{where}.content is missing", "messages")
            texts = []  # an assistant turn that only called tools; a tool result with nothing in it (as vLLM)
        elif isinstance(content, str):
            texts = [content]
        else:
            raise bad_request(f"{where}.content must be a string or a list of content parts", "messages")
        if content_format == "openai":
            msg["content"] = [{"type": media[i]} if i in media else {"type": "text", "text": t}
                              for i, t in enumerate(texts)]
        else:
            msg["content"] = "\n".join(texts)
        if role == "assistant":
            _history_reasoning(m, msg, where)
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise bad_request(f"{where}.tool_calls must be a list", "messages")
            fixed = []
            for c in calls:
                c = dict(c) if isinstance(c, dict) else c
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad_request(f"{where}.tool_calls entries need function.name", "messages")
                args = fn.get("arguments")
                if isinstance(args, str):  # templates expect a mapping
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        pass
                c["function"] = {**fn, "arguments": args}
                fixed.append(c)
            msg["tool_calls"] = fixed
        out.append(msg)
    return out


def _image_url(part: dict, where: str, content_format: str, kind: str = "image") -> str:
    if content_format != "openai":
        raise bad_request(f"{where}: a{'n' if kind == 'image' else ''} {kind} cannot be placed in a chat template that "
                          "takes message content as one string; start the server with --chat-template-content-format "
                          f"openai (with a template that loops over the content parts, placing {{\"type\": "
                          f"\"{kind}\"}} ones)", "messages", "unsupported_content")
    image = part.get(f"{kind}_url")
    url = image.get("url") if isinstance(image, dict) else image
    if not isinstance(url, str) or not url:
        raise bad_request(f"{where}.{kind}_url must be a URL string or an object with a 'url' string", "messages")
    return url


def _history_reasoning(m: dict, msg: dict, where: str) -> None:
    """An earlier assistant turn's reasoning, sent as `reasoning` (vLLM's name) or `reasoning_content` (the older
    one, which vLLM's docs keep accepting), reaches the template under both names: Qwen3 / Qwen3.5 templates read
    `reasoning_content` (and render it for the turns after the last user query). `reasoning` wins, as vLLM's."""
    reasoning = m.get("reasoning")
    if reasoning is None:
        reasoning = m.get("reasoning_content")
    if reasoning is None:
        return
    if not isinstance(reasoning, str):
        raise bad_request(f"{where}.reasoning must be a string", "messages")
    msg["reasoning"] = msg["reasoning_content"] = reasoning


def message_text(message: dict) -> str:
    """A normalized message's content as one string, in either content format."""
    content = message.get("content")
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content if part["type"] == "text")
    return content or ""


def render_chat(state: ServerState, messages: list[dict], *, chat_template: Optional[str],
                kwargs: Optional[dict], add_generation_prompt: bool, continue_final_message: bool,
                tools: Optional[list]) -> str:
    from jinja2 import TemplateError

    from voltllm.entrypoints.llm import apply_chat_template

    merged = dict(state.default_chat_template_kwargs)
    merged.update(kwargs or {})
    for reserved in ("messages", "tools", "chat_template", "tokenize", "add_generation_prompt"):
        if reserved in merged:
            raise bad_request(f"chat_template_kwargs must not set {reserved!r}", "chat_template_kwargs")
    if continue_final_message:
        if messages[-1].get("role") != "assistant":
            raise bad_request("continue_final_message needs the last message to be from the assistant",
                              "continue_final_message")
        merged["continue_final_message"] = True
    try:
        return apply_chat_template(state.tokenizer, messages, chat_template or state.chat_template,
                                   add_generation_prompt, tools, **merged)
    except TemplateError as e:
        raise bad_request(f"the chat template failed on these messages: {e}", "messages", "chat_template_error")
    except (ValueError, TypeError, KeyError) as e:
        raise bad_request(f"could not apply the chat template: {e}", "messages", "chat_template_error")


# -- prompts ------------------------------------------------------------------------------------------
def truncated(ids: list[int], keep: Optional[int], max_model_len: int, side: Optional[str] = None) -> list[int]:
    """request_checks.kept_prompt, its error a 400."""
    try:
        return kept_prompt(ids, keep, max_model_len, side)
    except InvalidRequestError as e:
        raise bad_request(str(e), e.param) from None


# -- submitting ---------------------------------------------------------------------------------------
def make_params(build) -> SamplingParams:
    try:
        return build()
    except SamplingParamsError as e:
        name = str(e).split(" ", 1)[0]  # (a field of an object field is dotted: repetition_detection.min_count)
        raise bad_request(str(e), name if all(part.isidentifier() for part in name.split(".")) else None)
    except (TypeError, ValueError) as e:
        raise bad_request(str(e))


def request_trace_headers(state: ServerState, raw_request: Any) -> Optional[dict[str, str]]:
    """The HTTP request's W3C trace headers, the parent of its requests' spans (tracing.py); None without them, or
    when the server does not trace (then the first request that has them logs a warning)."""
    return trace_headers_of(getattr(raw_request, "headers", None), getattr(state.engine, "tracer", None) is not None)


def submit(state: ServerState, request_ids: list[str], prompts: list[Any], params: SamplingParams,
           cache_salt: Optional[str], priority: int = 0, model: Optional[str] = None,
           interval: int = 1, multi_modal: Any = None, streamed: bool = False,
           trace_headers: Optional[Mapping[str, str]] = None) -> list[RequestStream]:
    """Add one engine request per prompt (with the adapter `model` names, if it is a --lora-modules one); on any
    failure abort those already added and raise a 400. interval: a stream's tokens per output (stream_interval.py).
    multi_modal: a chat prompt's images (multimodal/inputs.py MultiModalPrompt; one prompt). streamed: the response
    streams (--enable-log-deltas logs its chunks). trace_headers: request_trace_headers'."""
    lora = state.lora_request(model)
    images = {} if multi_modal is None else {"multi_modal": multi_modal}
    streams = start_streams(state, (functools.partial(state.engine.add_request, rid, prompt, params, cache_salt,
                                                      priority, lora_request=lora, trace_headers=trace_headers,
                                                      **images)
                                    for rid, prompt in zip(request_ids, prompts)), streamed)
    return streams if interval == 1 else [IntervalStream(s, interval) for s in streams]


def start_streams(state: ServerState, starts: Iterable[Callable[[], Any]], streamed: bool = False) -> list[Any]:
    """Call each start (it submits to the engine and returns the stream); if one fails, close the streams already
    started (aborting their engine work) and raise the failure as its HTTP error."""
    streams: list[Any] = []
    try:
        for start in starts:
            stream = start()
            streams.append(OutputLoggingStream(stream, state.max_log_len, streamed and state.log_deltas)
                           if state.log_outputs else stream)
    except BaseException as e:
        for s in streams:
            s.close()
        err = submission_error(e)
        if err is e:
            raise
        raise err
    return streams


def submission_error(e: BaseException) -> BaseException:
    """The HTTP error for a request the engine refused at submission (`e` itself when it is not one of those)."""
    if isinstance(e, InvalidRequestError):
        code = "context_length_exceeded" if "context length" in str(e) else None
        return bad_request(str(e), e.param or "prompt", code)
    if isinstance(e, InvalidPromptError):
        return bad_request(str(e), e.param)
    if isinstance(e, SamplingParamsError):
        return bad_request(str(e), "prompt")
    if isinstance(e, EngineDeadError):
        return OpenAIError(f"the engine is not available: {e}", 503)
    return e


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (stream index, output) from several request streams as outputs arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                queue.put_nowait((i, out))
            queue.put_nowait((i, done))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()


async def collect(streams: list[RequestStream]) -> list[RequestOutput]:
    finals: list[Optional[RequestOutput]] = [None] * len(streams)
    async for i, out in merge_streams(streams):
        finals[i] = out
    if any(f is None for f in finals):
        raise RequestAbortedError("the request ended without output")
    return finals  # type: ignore[return-value]


def engine_error(e: BaseException) -> OpenAIError:
    if isinstance(e, InvalidRequestError):
        return bad_request(str(e))
    if isinstance(e, RequestAbortedError):
        return OpenAIError(str(e), 503, code="request_aborted")
    if isinstance(e, EngineDeadError):
        return OpenAIError(f"the engine is not available: {e}", 503)
    return OpenAIError(f"internal error: {type(e).__name__}: {e}", 500)


# -- disconnects --------------------------------------------------------------------------------------
class DisconnectWatcher:
    """Aborts the given requests as soon as the HTTP client goes away (also while they wait in queue)."""

    def __init__(self, request: Any, state: ServerState, request_ids: list[str]):
        self.request = request
        self.state = state
        self.request_ids = request_ids
        self.disconnected = False
        self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        try:
            while True:
                message = await self.request.receive()
                if message.get("type") == "http.disconnect":
                    break
        except Exception:  # noqa: BLE001 - receive channel closed: treat as gone
            pass
        self.disconnected = True
        for rid in self.request_ids:
            self.state.engine.abort(rid)
        if self.state.log_requests:
            logger.info("client disconnected; aborted %s", ", ".join(self.request_ids))

    def stop(self) -> None:
        self._task.cancel()


async def collect_or_gone(streams: list[RequestStream], watcher: DisconnectWatcher) -> Optional[list[RequestOutput]]:
    """The final outputs of non-streamed requests; None when the client went away (answer 499, nobody listens).
    Engine failures become OpenAIErrors; the watcher stops however it ends."""
    try:
        return await collect(streams)
    except BaseException as e:
        if isinstance(e, RequestAbortedError) and watcher.disconnected:
            return None
        if isinstance(e, Exception):
            raise engine_error(e) from e
        raise
    finally:
        watcher.stop()


def event_stream(body: AsyncIterator[str]) -> StreamingResponse:
    """The HTTP response of a streamed answer: server-sent events, not cached or buffered by proxies."""
    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def sse_body(events: AsyncIterator[str], streams: list[RequestStream], watcher: DisconnectWatcher,
                   label: str, done: Optional[str] = "[DONE]",
                   error_event: Callable[[OpenAIError], str] = lambda e: sse_error(e)) -> AsyncIterator[str]:
    """A streamed response's body: the events, then [DONE] (`done`; None for none, as in the Responses API). The
    status line is already sent, so a failure is reported in-band as an error event (`error_event`; none once the
    client is gone); the watcher and the output streams are released however it ends."""
    tail = [sse(done)] if done is not None else []
    try:
        async for event in events:
            yield event
        for t in tail:
            yield t
    except RequestAbortedError as e:
        if not watcher.disconnected:
            yield error_event(engine_error(e))
            for t in tail:
                yield t
    except OpenAIError as e:
        yield error_event(e)
        for t in tail:
            yield t
    except Exception as e:  # noqa: BLE001 - report in-band
        logger.exception("streaming %s failed", label)
        yield error_event(engine_error(e))
        for t in tail:
            yield t
    finally:
        await events.aclose()
        watcher.stop()
        for st in streams:
            st.close()


# -- output shapes ------------------------------------------------------------------------------------
def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR) if value == value else LOGPROB_FLOOR


def _token_str(lp: Optional[Logprob], tokenizer: Any, tid: int, as_id: bool = False) -> str:
    if as_id:  # vLLM's --return-tokens-as-token-ids: names tokens whose text is not valid UTF-8 on its own
        return f"token_id:{tid}"
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([tid])


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int,
                  tokenizer: Any, as_ids: bool = False) -> list[dict]:
    """`logprobs.content` of a chat choice; as_ids: tokens as "token_id:N" (their `bytes` are that string's, as in
    vLLM)."""
    content = []
    for tid, pos in zip(token_ids, logprobs):
        chosen = pos.get(tid)
        tok = _token_str(chosen, tokenizer, tid, as_ids)
        ranked = sorted(pos.items(), key=lambda kv: -kv[1].logprob)[:top_n]
        content.append({
            "token": tok, "logprob": _lp(chosen.logprob if chosen else float("-inf")),
            "bytes": list(tok.encode("utf-8")),
            "top_logprobs": [{"token": (s := _token_str(lp, tokenizer, t, as_ids)), "logprob": _lp(lp.logprob),
                              "bytes": list(s.encode("utf-8"))} for t, lp in ranked],
        })
    return content


def completion_logprobs(token_ids: list[int], logprobs: list[Optional[dict[int, Logprob]]], top_n: int,
                        tokenizer: Any, text_offset: int, as_ids: bool = False) -> dict:
    """A completion choice's `logprobs`; as_ids: tokens (and the top_logprobs keys) as "token_id:N", text_offset
    counting those strings, as vLLM's."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, pos in zip(token_ids, logprobs):
        chosen = pos.get(tid) if pos else None
        tok = _token_str(chosen, tokenizer, tid, as_ids)
        tokens.append(tok)
        offsets.append(text_offset)
        text_offset += len(tok)
        if pos is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(_lp(chosen.logprob) if chosen else LOGPROB_FLOOR)
        # as OpenAI's and vLLM's: the sampled token and the top N (N + 1 entries, N when the sampled token is among
        # them); the engine's order puts the sampled token first
        tops.append({_token_str(lp, tokenizer, t, as_ids): _lp(lp.logprob) for t, lp in list(pos.items())[:top_n + 1]})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_json(prompt_ids: list[int], positions: Optional[list[Optional[dict[int, Logprob]]]],
                         top_n: int) -> Optional[list]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first) {token id: {logprob, rank, decoded_token}}
    with the top_n most likely tokens and the prompt's own, each with its vocabulary rank (the engine may have ranked
    more than top_n, for echo)."""
    if positions is None:
        return None
    out: list[Optional[dict]] = []
    for tid, pos in zip(prompt_ids, positions):
        if pos is None:
            out.append(None)
            continue
        ranked = sorted(pos.items(), key=lambda kv: -kv[1].logprob)
        out.append({str(t): {"logprob": _lp(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
                    for r, (t, lp) in enumerate(ranked) if r < top_n or t == tid})
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: Optional[int] = None) -> dict:
    u: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                         "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u


def sse(obj: Union[dict, str]) -> str:
    if isinstance(obj, str):
        return f"data: {obj}\n\n"
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_error(err: OpenAIError) -> str:
    return sse(error_body(err.message, err.status, err.param, err.code, err.type))
