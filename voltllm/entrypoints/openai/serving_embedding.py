"""POST /v1/embeddings (pooling engines, --runner pooling): each input's pooled hidden state as an OpenAI embedding
object list, floats or base64, with vLLM's extra parameters (embeddings_protocol.py)."""
from __future__ import annotations

import base64
import logging
import time
from typing import Any

import numpy as np
import torch
from fastapi.responses import JSONResponse

from voltllm.engine.async_llm import EngineDeadError, InvalidRequestError, RequestStream
from voltllm.engine.frontend import InvalidPromptError
from voltllm.engine.outputs import PoolingRequestOutput
from voltllm.entrypoints.openai.embeddings_protocol import EmbeddingRequest
from voltllm.entrypoints.openai.errors import OpenAIError, bad_request
from voltllm.entrypoints.openai.request_log import shown
from voltllm.entrypoints.openai.server_middleware import chosen_request_id, engine_request_id
from voltllm.entrypoints.openai.serving_common import (DisconnectWatcher, ServerState, collect_or_gone, new_id,
                                                       render_chat, truncated, usage)
from voltllm.pooling.params import PoolingParams, PoolingParamsError

logger = logging.getLogger("voltllm")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


async def create_embedding(state: ServerState, req: EmbeddingRequest, raw_request: Any) -> JSONResponse:
    req.check()
    model = state.model_name(req.model)
    try:
        params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize, use_activation=req.use_activation,
                               task="embed")
    except PoolingParamsError as e:
        raise bad_request(str(e), _param_of(e))
    prompts = [truncated(ids, req.truncate_prompt_tokens, state.max_model_len) for ids in _token_ids(state, req)]
    chosen_id = chosen_request_id(raw_request, req.request_id)  # vLLM's: embd-<X-Request-Id, else request_id>
    base_id = f"embd-{chosen_id}" if chosen_id is not None else new_id("embd")
    engine_base = engine_request_id(base_id, chosen_id is not None)
    rids = [engine_base if len(prompts) == 1 else f"{engine_base}-{i}" for i in range(len(prompts))]
    streams = _submit(state, rids, prompts, params, req.cache_salt, req.priority)
    if state.log_requests:
        logger.info("request %s: embeddings of %d input(s): %s", engine_base, len(prompts),
                    ", ".join(shown(p, state.max_log_len) for p in prompts))
    created = int(time.time())
    finals = await collect_or_gone(streams, DisconnectWatcher(raw_request, state, rids))
    if finals is None:
        return JSONResponse({}, status_code=499)
    data, prompt_tokens = [], 0
    for i, out in enumerate(finals):
        if out.outputs is None:  # aborted in the engine (a prompt its KV cache can never hold)
            raise OpenAIError(f"input {i} was aborted before it was computed (the KV cache cannot hold it)", 503,
                              code="request_aborted")
        data.append({"index": i, "object": "embedding", "embedding": _encoded(out, req)})
        prompt_tokens += len(out.prompt_token_ids)
    body = {"id": base_id, "object": "list", "created": created, "model": model, "data": data,
            "usage": usage(prompt_tokens, 0)}
    return JSONResponse(body)


def _token_ids(state: ServerState, req: EmbeddingRequest) -> list[list[int]]:
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
            cache_salt: Any, priority: int) -> list[RequestStream]:
    """One engine request per input; on a failure the ones already added are aborted and a 400 names the field."""
    streams: list[RequestStream] = []
    try:
        for rid, ids in zip(request_ids, prompts):
            streams.append(state.engine.add_pooling_request(rid, {"prompt_token_ids": ids}, params, cache_salt,
                                                            priority))
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


def _encoded(out: PoolingRequestOutput, req: EmbeddingRequest) -> Any:
    """The embedding as floats, or (base64) the bytes of embed_dtype values in `endianness` order, base64-encoded
    (float32 native: what the openai client decodes by default)."""
    data = out.outputs.data
    if req.encoding_format == "float":
        return data.tolist()
    values = data.to(_DTYPES[req.embed_dtype])
    if values.dtype == torch.bfloat16:  # (numpy has no bfloat16: its bits as 16-bit integers)
        array = values.view(torch.int16).numpy()
    else:
        array = values.numpy()
    order = {"native": "=", "little": "<", "big": ">"}[req.endianness]
    array = array.astype(array.dtype.newbyteorder(order), copy=False)
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")
