"""The FastAPI app: routes, API-key check, CORS, OpenAI-style error bodies, HTTP counters."""
from __future__ import annotations

import hmac
import json
import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Type, TypeVar, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from voltllm import __version__
from voltllm.entrypoints.openai.chat_images import prepare_chat_images
from voltllm.entrypoints.openai.embeddings_protocol import EmbeddingRequest
from voltllm.entrypoints.openai.pooling_protocol import PoolingRequest
from voltllm.entrypoints.openai.errors import OpenAIError, bad_request, error_body, error_response, status_phrase
from voltllm.entrypoints.openai.messages_errors import (MESSAGES_ROUTES, anthropic_error_body,
                                                        anthropic_error_response, is_messages_path)
from voltllm.entrypoints.openai.messages_protocol import CountTokensRequest, MessagesRequest
from voltllm.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from voltllm.entrypoints.openai.model_cards import ModelCards
from voltllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                 TokenizeRequest)
from voltllm.entrypoints.openai.responses_background import BackgroundRuns
from voltllm.entrypoints.openai.responses_protocol import ResponsesRequest
from voltllm.entrypoints.openai.responses_store import ResponseStore
from voltllm.entrypoints.openai.serving_chat import create_chat_completion
from voltllm.entrypoints.openai.extra_middleware import wrap_middleware
from voltllm.entrypoints.openai.server_middleware import (HeaderCountLimit, RequestIdHeaderMiddleware, ServerLoad,
                                                          ServerLoadMiddleware)
from voltllm.entrypoints.openai.serving_common import ServerState, render_chat
from voltllm.entrypoints.openai.serving_completion import create_completion
from voltllm.entrypoints.openai.serving_embedding import create_embedding
from voltllm.entrypoints.openai.serving_pooling import create_pooling
from voltllm.entrypoints.openai.scoring_protocol import SCORE_FORMS, ClassificationRequest, RerankRequest, ScoreRequest
from voltllm.entrypoints.openai.serving_score import create_classify, create_rerank, create_score
from voltllm.entrypoints.openai.serving_messages import count_message_tokens, create_message
from voltllm.entrypoints.openai.serving_responses import create_response, get_response
from voltllm.entrypoints.openai.tokenizer_info import tokenizer_info_of

logger = logging.getLogger("voltllm")
M = TypeVar("M", bound=BaseModel)

_ROUTES = {"/health", "/ping", "/invocations", "/version", "/load", "/metrics", "/tokenize", "/detokenize",
           "/tokenizer_info",
           "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
           "/v1/acceleration", "/v1/sm70/acceleration", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank",
           "/classify", "/pooling", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/sleep", "/wake_up",
           "/is_sleeping", "/start_profile", "/stop_profile"}
_POOLING_ROUTES_BUILT = ("embedding models serve POST /v1/embeddings, /score, /rerank and /pooling, classifiers "
                         "/score, /rerank, /classify and /pooling, with --runner pooling")
_TEXT_ONLY = "voltllm serves text models (text in, text out)"
# vLLM's routes that are not built: refused by name on every server (path -> (what, what is served instead))
_UNBUILT_ROUTES = {"/v2/embed": ("Cohere's embed API", _POOLING_ROUTES_BUILT),
                   "/v1/audio/transcriptions": ("speech-to-text (transcription)", _TEXT_ONLY),
                   "/v1/audio/translations": ("speech-to-text (translation)", _TEXT_ONLY),
                   "/v1/audio/speech": ("text-to-speech", _TEXT_ONLY),
                   "/v1/realtime": ("the realtime (speech) API", _TEXT_ONLY)}
# the pooling routes of serving_score.py: path -> (request model, handler, what it does); /classify on classifiers only,
# the others on every pooling server (an embedding model scores by cosine similarity, as vLLM's bi-encoders)
_SCORING_ROUTES = {"/score": (ScoreRequest, create_score, "scoring"),
                      "/v1/score": (ScoreRequest, create_score, "scoring"),
                      "/rerank": (RerankRequest, create_rerank, "reranking"),
                      "/v1/rerank": (RerankRequest, create_rerank, "reranking"),
                      "/v2/rerank": (RerankRequest, create_rerank, "reranking"),
                      "/classify": (ClassificationRequest, create_classify, "classification")}
_PREFIXES = (("/v1/models/", "/v1/models/{model}"), ("/v1/responses/", "/v1/responses/{response_id}"))
# behind --api-key besides /v1/*: SageMaker's /invocations generates as /v1/* does (vLLM guards it; /ping stays open),
# and the scoring routes and /pooling outside /v1 run the model as much as /v1/score does
# (and /sleep, /wake_up: they take the whole engine away from every client; /start_profile, /stop_profile: they slow
# it down and write files on the server)
_GUARDED_ROUTES = ("/invocations", "/score", "/rerank", "/v2/rerank", "/classify", "/pooling", "/sleep", "/wake_up",
                   "/start_profile", "/stop_profile")


def route_path(scope: dict) -> str:
    """The path the routes see: uvicorn puts --root-path in front of the request's path (scope["path"] is
    root_path + path), and the router strips it again, so the key check must strip it too (else /api/v1/... passes
    unchecked)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("/", ""):
        return path[len(root):] or "/"
    return path


class AuthAndCountMiddleware:
    """Pure ASGI (streaming- and disconnect-safe): Bearer key check on /v1/*, /invocations and the scoring
    routes, per-route HTTP counters."""

    def __init__(self, app: Any, api_key: Union[None, str, Sequence[str]], metrics: Optional[ServerMetrics]):
        """api_key: one key or several (any of them is accepted, as vLLM's --api-key K1 K2)."""
        self.app = app
        keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
        self.api_keys = [k.encode() for k in keys if k]
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        status = {"code": 500}

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            guarded = path.startswith("/v1") or path in _GUARDED_ROUTES
            if self.api_keys and guarded and scope.get("method") != "OPTIONS":
                if not self._authorized(scope):
                    if is_messages_path(path):  # Anthropic clients send 'x-api-key', and want their error shape
                        body = anthropic_error_body("invalid or missing API key: send it as 'x-api-key: <key>' or "
                                                    "'Authorization: Bearer <key>'", 401)
                    else:
                        msg = "invalid or missing API key: send it as 'Authorization: Bearer <key>'"
                        body = error_body(msg, 401, code="invalid_api_key")
                    resp = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                    await resp(scope, receive, send_wrapper)
                    return
            await self.app(scope, receive, send_wrapper)
        finally:
            if self.metrics is not None:
                label = path if path in _ROUTES or path in MESSAGES_ROUTES else next(
                    (name for prefix, name in _PREFIXES if path.startswith(prefix)), "other")
                self.metrics.on_http(scope.get("method", ""), label, status["code"])

    def _authorized(self, scope: dict) -> bool:
        token = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                token = value[7:].strip()
                break
            if name == b"x-api-key":
                token = value.strip()
        # every key compared (no early exit), each in constant time
        return sum(hmac.compare_digest(token, key) for key in self.api_keys) > 0


async def parse_body(request: Request, model: Type[M]) -> M:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json")
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errs = e.errors()
        first = errs[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        more = f" (and {len(errs) - 1} more problem{'s' if len(errs) > 2 else ''})" if len(errs) > 1 else ""
        param = str(first["loc"][0]) if first.get("loc") else None
        raise bad_request(f"{loc}: {first.get('msg', 'invalid value')}{more}", param)


async def _invocation(state: ServerState, request: Request) -> Any:
    """SageMaker's POST /invocations, dispatched as vLLM does: the body is tried as a chat completion request,
    then as a completion request, and the first it validates as is served (so `messages` -> chat, `prompt` ->
    completion); one that is neither is a 400 naming both problems. A pooling server's is, by the body's fields (as
    vLLM tries its request types in turn): rerank (`query`), score (a pair of score inputs, `text_1` / `text_2`,
    ...), else an embedding model's embeddings and a classifier's classify."""
    if state.runner == "pooling":
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None  # (parse_body below answers the 400)
        fields = set(body) if isinstance(body, dict) else set()
        if "query" in fields:
            kind = "/rerank"
        elif not fields & {"input", "messages"} and any(set(f) <= fields for f in SCORE_FORMS):
            kind = "/score"
        elif state.classifier is None:
            return await create_embedding(state, await parse_body(request, EmbeddingRequest), request)
        else:
            kind = "/classify" if "input" in fields else "/score"
        model, serve, _ = _SCORING_ROUTES[kind]
        return await serve(state, await parse_body(request, model), request)
    problems = []
    for kind, model, serve in (("chat completion", ChatCompletionRequest, create_chat_completion),
                               ("completion", CompletionRequest, create_completion)):
        try:
            req = await parse_body(request, model)
        except OpenAIError as e:
            if e.code == "invalid_json":
                raise
            problems.append(f"as a {kind} request: {e}")
            continue
        return await serve(state, req, request)
    raise bad_request("the body is neither a chat completion request (with 'messages') nor a completion request "
                      f"(with 'prompt'): {'; '.join(problems)}", code="invalid_invocation")


@dataclass(frozen=True)
class CorsSettings:
    """Cross-origin access for browser clients (vLLM's --allowed-origins / --allow-credentials /
    --allowed-methods / --allowed-headers, same defaults: any origin, method and header, no credentials)."""
    allowed_origins: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)


@dataclass(frozen=True)
class HttpOptions:
    """vLLM's HTTP-level server flags: --disable-fastapi-docs, --enable-request-id-headers,
    --enable-server-load-tracking, --allow-runtime-lora-updating, --enable-tokenizer-info-endpoint."""
    fastapi_docs: bool = True  # /docs, /redoc, /openapi.json
    request_id_headers: bool = False  # X-Request-Id on every response
    server_load_tracking: bool = False  # GET /load counts the requests in flight
    runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (serving_lora.py)
    tokenizer_info: bool = False  # GET /tokenizer_info (--enable-tokenizer-info-endpoint)
    sleep_mode: bool = False  # POST /sleep, POST /wake_up, GET /is_sleeping (--enable-sleep-mode; sleep_routes.py)
    profiling: bool = False  # POST /start_profile, POST /stop_profile (--profiler-config; profile_routes.py)
    middleware: tuple = ()  # --middleware's classes / functions, outermost last (extra_middleware.py)
    max_header_count: Optional[int] = None  # --h11-max-header-count: more header fields get a 431 (None: any)


def build_app(state: ServerState, metrics: Optional[ServerMetrics] = None,
              api_key: Union[None, str, Sequence[str]] = None,
              root_path: str = "", cors: CorsSettings = CorsSettings(), http: HttpOptions = HttpOptions()) -> Any:
    docs = http.fastapi_docs
    app = FastAPI(title="voltllm OpenAI-compatible server", version=__version__, root_path=root_path,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None)
    app.state.server = state
    load = ServerLoad()

    def _shaped(request: Request, exc: OpenAIError) -> JSONResponse:
        # /v1/messages* answer in Anthropic's error shape, every other route in OpenAI's
        return anthropic_error_response(exc) if is_messages_path(request.url.path) else error_response(exc)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return _shaped(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _shaped(request, bad_request(str(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else status_phrase(exc.status_code)
        if exc.status_code == 404:
            detail = f"no route {request.method} {request.url.path}"
        return _shaped(request, OpenAIError(detail, exc.status_code))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return _shaped(request, OpenAIError(f"internal server error: {type(exc).__name__}: {exc}", 500))

    @app.get("/health")
    async def health() -> Response:
        if state.engine.is_healthy:
            return Response(status_code=200)
        why = state.engine.dead or "the engine is not running"
        return error_response(OpenAIError(why, 503))

    # SageMaker's health check: /health's answer (one route per method: a shared one repeats its OpenAPI operation id)
    app.add_api_route("/ping", health, methods=["GET"], operation_id="ping_get")
    app.add_api_route("/ping", health, methods=["POST"], operation_id="ping_post")

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/load")
    async def server_load() -> dict:
        # vLLM's route: always there; it counts only with --enable-server-load-tracking
        return {"server_load": load.value}

    @app.get("/metrics")
    async def metrics_route() -> Response:
        if metrics is None:
            raise OpenAIError("metrics are disabled", 404)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    model_cards = ModelCards(state)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return model_cards.listing()

    if http.runtime_lora_updating:  # (without it the routes do not exist, as in vLLM: 404)
        from voltllm.entrypoints.openai.serving_lora import (LoadLoRAAdapterRequest, RuntimeLoRAs,
                                                             UnloadLoRAAdapterRequest)

        runtime_loras = RuntimeLoRAs(state)

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request) -> Response:
            return PlainTextResponse(await runtime_loras.load(await parse_body(request, LoadLoRAAdapterRequest)))

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request) -> Response:
            return PlainTextResponse(await runtime_loras.unload(await parse_body(request, UnloadLoRAAdapterRequest)))

    from voltllm.entrypoints.openai.sleep_routes import add_sleep_routes

    add_sleep_routes(app, state, http.sleep_mode)
    from voltllm.entrypoints.openai.profile_routes import add_profile_routes

    add_profile_routes(app, state, http.profiling)

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict:
        if not state.serves(model):
            raise OpenAIError(f"The model `{model}` does not exist", 404, "model", "model_not_found")
        return model_cards.card(model)

    def generation_only(request: Request) -> None:
        """vLLM serves the generation routes from generate engines only (one runner per engine): a pooling server
        answers them 404, saying what it serves."""
        if state.runner == "pooling":
            serves = ("/score, /v1/score, /rerank, /v1/rerank, /v2/rerank, /classify and /pooling"
                      if state.classifier is not None
                      else "/v1/embeddings, /score, /v1/score, /rerank, /v1/rerank, /v2/rerank and /pooling")
            raise OpenAIError(f"{request.method} {request.url.path}: this server runs a pooling model (--runner "
                              f"pooling), which generates nothing; it serves POST {serves}", 404)

    @app.post("/v1/messages")  # the Anthropic Messages API (serving_messages.py)
    async def messages(request: Request) -> Any:
        generation_only(request)
        return await create_message(state, await parse_body(request, MessagesRequest), request)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request) -> dict:
        generation_only(request)
        return await count_message_tokens(state, await parse_body(request, CountTokensRequest))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        generation_only(request)
        req = await parse_body(request, ChatCompletionRequest)
        return await create_chat_completion(state, req, request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        generation_only(request)
        req = await parse_body(request, CompletionRequest)
        return await create_completion(state, req, request)

    @app.post("/v1/embeddings")  # pooling servers (serving_embedding.py)
    async def embeddings(request: Request) -> Any:
        if state.runner != "pooling":
            raise OpenAIError("POST /v1/embeddings: this server runs a generative model, which computes no "
                              "embeddings; serve an embedding model with --runner pooling (a causal LM: "
                              "--convert embed)", 404)
        if state.classifier is not None:
            raise OpenAIError("POST /v1/embeddings: this server runs a classifier (a reranker), which computes no "
                              "embeddings; it serves POST /score, /v1/score, /rerank, /v1/rerank, /v2/rerank, "
                              "/classify and /pooling", 404)
        return await create_embedding(state, await parse_body(request, EmbeddingRequest), request)

    @app.post("/pooling")  # vLLM's generic pooling route, on pooling servers (serving_pooling.py)
    async def pooling(request: Request) -> Any:
        if state.runner != "pooling":
            raise OpenAIError("POST /pooling: this server runs a generative model, which pools nothing; vLLM serves "
                              "/pooling from pooling models (--runner pooling: an embedding model, or a classifier "
                              "through --convert classify)", 404)
        return await create_pooling(state, await parse_body(request, PoolingRequest), request)

    def _scoring_route(path: str, model: Any, serve: Any, what: str) -> Any:
        async def route(request: Request) -> Any:
            if state.runner != "pooling":
                raise OpenAIError(f"POST {path}: {what} is served by pooling models (--runner pooling: an embedding "
                                  "model scores by cosine similarity, a classifier / reranker such as a "
                                  "...ForSequenceClassification model or a causal LM through --hf-overrides "
                                  "classifier_from_token by its output); this server runs a generative model", 404)
            if path == "/classify" and state.classifier is None:
                raise OpenAIError(f"POST {path}: {what} is served by classifiers (a ...ForSequenceClassification "
                                  "model, or a causal LM reranker through --hf-overrides classifier_from_token, with "
                                  "--runner pooling); this server runs an embedding model", 404)
            return await serve(state, await parse_body(request, model), request)
        return route

    for path, (model, serve, what) in _SCORING_ROUTES.items():
        app.add_api_route(path, _scoring_route(path, model, serve, what), methods=["POST"],
                          operation_id=path.strip("/").replace("/", "_"))

    def _unbuilt_route(path: str, what: str, instead: str) -> Any:
        async def refuse(request: Request) -> None:
            raise OpenAIError(f"{request.method} {path}: {what} is not built in voltllm ({instead})", 404)
        return refuse

    for path, (what, instead) in _UNBUILT_ROUTES.items():
        # (GET too: /v1/realtime is a WebSocket upgrade, which arrives as a GET)
        app.add_api_route(path, _unbuilt_route(path, what, instead), methods=["GET", "POST"], include_in_schema=False,
                          operation_id=f"unbuilt_{path.strip('/').replace('/', '_')}")

    @app.post("/invocations")  # SageMaker's one generation route (below)
    async def invocations(request: Request) -> Any:
        return await _invocation(state, request)

    responses = ResponseStore()
    background = BackgroundRuns(responses)

    @app.post("/v1/responses")
    async def create_responses(request: Request) -> Any:
        generation_only(request)
        return await create_response(state, responses, await parse_body(request, ResponsesRequest), request,
                                     background)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request) -> dict:
        generation_only(request)
        return get_response(responses, response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, request: Request) -> dict:
        generation_only(request)
        return background.cancel(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict:
        generation_only(request)
        return background.delete(response_id)

    async def _acceleration() -> dict:
        from voltllm.engine.async_llm import EngineDeadError

        try:
            report = await state.engine.acceleration_report()
        except EngineDeadError as e:
            raise OpenAIError(str(e), 503)
        if "error" in report and "routes" not in report:
            raise OpenAIError(f"the engine could not build the acceleration report: {report['error']}", 500)
        return report

    @app.get("/v1/acceleration")
    async def acceleration() -> dict:
        return await _acceleration()

    @app.get("/v1/sm70/acceleration")  # the seed system's path; same body
    async def acceleration_sm70() -> dict:
        return await _acceleration()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        req = await parse_body(request, TokenizeRequest)
        state.model_name(req.model)
        tok = state.tokenizer
        if req.messages is not None:
            image_urls: list[str] = []  # (a server that takes images: each one's tokens, as the chat route's prompt)
            video_urls: list[str] = []
            text = render_chat(state, state.template_messages(req.messages, req.chat_template, req.tools, image_urls,
                                                              video_urls),
                               chat_template=req.chat_template,
                               kwargs=req.chat_template_kwargs, add_generation_prompt=req.add_generation_prompt,
                               continue_final_message=req.continue_final_message, tools=req.tools)
            # vLLM's: the messages form takes add_special_tokens too, default false (the template wrote them)
            given = "add_special_tokens" in req.model_fields_set
            ids = tok.encode(text, add_special_tokens=req.add_special_tokens if given else False)
            if image_urls or video_urls:
                ids, _ = await prepare_chat_images(state, ids, image_urls, video_urls)
        elif req.prompt is not None:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise bad_request("give either 'prompt' or 'messages'", "prompt")
        body = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = tok.convert_ids_to_tokens(ids)
        return body

    if http.tokenizer_info:
        @app.get("/tokenizer_info")  # vLLM's: may expose the chat template, hence behind its own flag
        async def tokenizer_info() -> dict:
            return tokenizer_info_of(state.tokenizer, state.chat_template)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req = await parse_body(request, DetokenizeRequest)
        state.model_name(req.model)
        vocab = state.engine.vocab_size
        bad = [t for t in req.tokens if t < 0 or t >= vocab]
        if bad:
            raise bad_request(f"token ids must be in [0, {vocab}), got {bad[:5]}", "tokens")
        return {"prompt": state.tokenizer.decode(req.tokens)}

    # CORS outermost: a browser's preflight (OPTIONS) is answered before the API-key check, as in vLLM; request ids
    # outside the key check (a 401 carries one too); load counted for authorized requests only
    inner: Any = ServerLoadMiddleware(app, load, route_path) if http.server_load_tracking else app
    outer: Any = AuthAndCountMiddleware(inner, api_key, metrics)
    if http.request_id_headers:
        outer = RequestIdHeaderMiddleware(outer)
    outer = CORSMiddleware(outer, allow_origins=list(cors.allowed_origins),
                           allow_credentials=cors.allow_credentials, allow_methods=list(cors.allowed_methods),
                           allow_headers=list(cors.allowed_headers))
    outer = wrap_middleware(outer, http.middleware)
    return outer if http.max_header_count is None else HeaderCountLimit(outer, http.max_header_count)
