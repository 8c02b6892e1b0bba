"""POST /v1/embeddings (pooling engines, --runner pooling): each input's pooled hidden state as an OpenAI embedding
object list, floats or base64, or (vLLM's encoding_format bytes / bytes_only) as one binary body, with vLLM's extra
parameters (embeddings_protocol.py)."""
from __future__ import annotations

import base64
import json
import logging
import time
from typing import Any, Mapping, Optional

import numpy as np
import torch
from fastapi.responses import JSONResponse, Response

from voltllm.engine.async_llm import EngineDeadError, InvalidRequestError, RequestStream
from voltllm.engine.frontend import InvalidPromptError
from voltllm.engine.outputs import PoolingRequestOutput
from voltllm.entrypoints.openai.embeddings_protocol import EmbeddingRequest
from voltllm.entrypoints.openai.errors import OpenAIError, bad_request
from voltllm.entrypoints.openai.request_log import shown
from voltllm.entrypoints.openai.server_middleware import chosen_request_id, engine_request_id
from voltllm.entrypoints.openai.serving_common import (DisconnectWatcher, ServerState, collect_or_gone, new_id,
                                                       render_chat, request_trace_headers, truncated, usage)
from voltllm.pooling.params import PoolingParams, PoolingParamsError

logger = logging.getLogger("voltllm")

# embed_dtype -> (the values' dtype, the integer dtype whose bits numpy handles: it has no bfloat16 / fp8)
_DTYPES = {"float32": (torch.float32, None), "float16": (torch.float16, None),
           "bfloat16": (torch.bfloat16, torch.int16), "fp8_e4m3": (torch.float8_e4m3fn, torch.uint8),
           "fp8_e5m2": (torch.float8_e5m2, torch.uint8)}


async def create_embedding(state: ServerState, req: EmbeddingRequest, raw_request: Any) -> Response:
    req.check()
    model = state.model_name(req.model)
    try:
        params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize, use_activation=req.use_activation,
                               task="embed")
    except PoolingParamsError as e:
        raise bad_request(str(e), _param_of(e))
    pooled = await pool_inputs(state, req, params, raw_request, "embd", "embeddings")
    if pooled is None:
        return JSONResponse({}, status_code=499)
    base_id, created, finals = pooled
    prompt_tokens = sum(len(out.prompt_token_ids) for out in finals)
    if req.encoding_format in ("bytes", "bytes_only"):
        return bytes_response(finals, req, base_id, created, model, prompt_tokens)
    data = [{"index": i, "object": "embedding", "embedding": encoded(out, req)} for i, out in enumerate(finals)]
    body = {"id": base_id, "object": "list", "created": created, "model": model, "data": data,
            "usage": usage(prompt_tokens, 0)}
    return JSONResponse(body)


async def pool_inputs(state: ServerState, req: Any, params: PoolingParams, raw_request: Any, prefix: str,
                      what: str) -> Optional[tuple[str, int, list[PoolingRequestOutput]]]:
    """An embeddings-shaped request's prompts (its `input` or `messages`, cut to its truncate_prompt_tokens from its
    truncation_side) pooled, one engine request each: (the response id `<prefix>-...`, the creation time, the
    finished outputs in input order); None when the client left first."""
    prompts = [truncated(ids, req.truncate_prompt_tokens, state.max_model_len, req.truncation_side)
               for ids in _token_ids(state, req)]
    chosen_id = chosen_request_id(raw_request, req.request_id)  # vLLM's: <prefix>-<X-Request-Id, else request_id>
    base_id = f"{prefix}-{chosen_id}" if chosen_id is not None else new_id(prefix)
    engine_base = engine_request_id(base_id, chosen_id is not None)
    rids = [engine_base if len(prompts) == 1 else f"{engine_base}-{i}" for i in range(len(prompts))]
    streams = _submit(state, rids, prompts, params, req.cache_salt, req.priority,
                      request_trace_headers(state, raw_request))
    if state.log_requests:
        logger.info("request %s: %s of %d input(s): %s", engine_base, what, len(prompts),
                    ", ".join(shown(p, state.max_log_len) for p in prompts))
    created = int(time.time())
    finals = await collect_or_gone(streams, DisconnectWatcher(raw_request, state, rids))
    if finals is None:
        return None
    for i, out in enumerate(finals):
        if out.outputs is None:  # aborted in the engine (a prompt its KV cache can never hold)
            raise OpenAIError(f"input {i} was aborted before it was computed (the KV cache cannot hold it)", 503,
                              code="request_aborted")
    return base_id, created, finals


def _token_ids(state: ServerState, req: Any) -> list[list[int]]:
    """Every prompt as token ids: text tokenized with add_special_tokens (default true), a chat templated first
    (add_special_tokens default false: the template wrote them), token ids checked against the vocabulary."""
    tok = state.tokenizer
    if req.messages is not None:
        messages = state.template_messages(req.messages, req.chat_template, None)
        text = render_chat(state, messages, chat_template=req.chat_template, kwargs=req.chat_template_kwargs,
                           add_generation_prompt=req.add_generation_prompt,
                           continue_final_message=req.continue_final_message, tools=None)
        special = False if req.add_special_tokens is None else req.add_special_tokens
        return [tok.encode(text, add_special_tokens=special)]
    special = True if req.add_special_tokens is None else req.add_special_tokens
    out = []
    for i, p in enumerate(req.inputs()):
        ids = tok.encode(p, add_special_tokens=special) if isinstance(p, str) else p
        if not ids:
            raise bad_request(f"input {i} is empty", "input")
        out.append(ids)
    return out


def _submit(state: ServerState, request_ids: list[str], prompts: list[list[int]], params: PoolingParams,
            cache_salt: Any, priority: int, trace_headers: Optional[Mapping[str, str]] = None) -> list[RequestStream]:
    """One engine request per input; on a failure the ones already added are aborted and a 400 names the field.
    trace_headers: serving_common.request_trace_headers'."""
    streams: list[RequestStream] = []
    try:
        for rid, ids in zip(request_ids, prompts):
            streams.append(state.engine.add_pooling_request(rid, {"prompt_token_ids": ids}, params, cache_salt,
                                                            priority, trace_headers=trace_headers))
    except BaseException as e:
        for s in streams:
            s.close()
        if isinstance(e, PoolingParamsError):
            raise bad_request(str(e), _param_of(e))
        if isinstance(e, InvalidRequestError):
            code = "context_length_exceeded" if "context length" in str(e) else None
            raise bad_request(str(e), e.param if e.param == "priority" else "input", code)
        if isinstance(e, InvalidPromptError):
            raise bad_request(str(e), "input")
        if isinstance(e, EngineDeadError):
            raise OpenAIError(f"the engine is not available: {e}", 503)
        raise
    return streams


def _param_of(e: PoolingParamsError) -> Any:
    name = str(e).split(" ", 1)[0].rstrip(":")
    return name if name.isidentifier() else None


def embedding_bytes(data: torch.Tensor, embed_dtype: str, endianness: str) -> bytes:
    """The embedding's values as embed_dtype, in `endianness` byte order (native: this machine's)."""
    dtype, bits = _DTYPES[embed_dtype]
    values = data.to(dtype)
    array = (values.view(bits) if bits is not None else values).numpy()
    order = {"native": "=", "little": "<", "big": ">"}[endianness]
    array = array.astype(array.dtype.newbyteorder(order), copy=False)
    return np.ascontiguousarray(array).tobytes()


def encoded(out: PoolingRequestOutput, req: Any) -> Any:
    """The embedding as floats, or (base64) its embedding_bytes base64-encoded (float32 native: what the openai client
    decodes by default)."""
    if req.encoding_format == "float":
        return out.outputs.data.tolist()
    return base64.b64encode(embedding_bytes(out.outputs.data, req.embed_dtype, req.endianness)).decode("ascii")


def bytes_response(finals: list[PoolingRequestOutput], req: Any, base_id: str, created: int,
                    model: str, prompt_tokens: int) -> Response:
    """vLLM's binary answer: the body is every embedding's embedding_bytes, one after another; for `bytes` a
    `metadata` header (JSON) holds the id, created, model, usage and each embedding's place in the body (index,
    embed_dtype, endianness, start and end byte offsets, shape); `bytes_only` sends the body alone."""
    chunks, items, offset = [], [], 0
    for i, out in enumerate(finals):
        chunk = embedding_bytes(out.outputs.data, req.embed_dtype, req.endianness)
        items.append({"index": i, "embed_dtype": req.embed_dtype, "endianness": req.endianness, "start": offset,
                      "end": offset + len(chunk), "shape": list(out.outputs.data.shape)})
        chunks.append(chunk)
        offset += len(chunk)
    headers = None
    if req.encoding_format == "bytes":
        headers = {"metadata": json.dumps({"id": base_id, "created": created, "model": model, "data": items,
                                           "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})}
    return Response(b"".join(chunks), media_type="application/octet-stream", headers=headers)
