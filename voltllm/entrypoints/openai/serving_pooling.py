"""POST /pooling (vLLM's generic pooling route, on pooling engines): each input's raw pooled output under its
engine's one task (pooling_protocol.py), in vLLM's PoolingResponse: an embedding model's embedding (its pooled,
normalized hidden state, as /v1/embeddings gives it), a classifier's class probabilities (its activation applied, as
/classify's `probs`), as floats, base64 or vLLM's binary bytes body."""
from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse, Response

from voltllm.entrypoints.openai.errors import bad_request
from voltllm.entrypoints.openai.pooling_protocol import PoolingRequest
from voltllm.entrypoints.openai.serving_common import ServerState, usage
from voltllm.entrypoints.openai.serving_embedding import _param_of, bytes_response, encoded, pool_inputs
from voltllm.pooling.params import PoolingParams, PoolingParamsError


async def create_pooling(state: ServerState, req: PoolingRequest, raw_request: Any) -> Response:
    req.check()
    model = state.model_name(req.model)
    task = req.check_task("embed" if state.classifier is None else "classify")
    try:
        params = PoolingParams(use_activation=req.activation_switch(), task=task)
    except PoolingParamsError as e:
        raise bad_request(str(e), _param_of(e))
    pooled = await pool_inputs(state, req, params, raw_request, "pool", f"pooling ({task})")  # vLLM's id prefix
    if pooled is None:
        return JSONResponse({}, status_code=499)
    base_id, created, finals = pooled
    prompt_tokens = sum(len(out.prompt_token_ids) for out in finals)
    if req.encoding_format in ("bytes", "bytes_only"):
        return bytes_response(finals, req, base_id, created, model, prompt_tokens)
    data = [{"index": i, "object": "pooling", "data": encoded(out, req)} for i, out in enumerate(finals)]
    return JSONResponse({"id": base_id, "object": "list", "created": created, "model": model, "data": data,
                         "usage": usage(prompt_tokens, 0)})
