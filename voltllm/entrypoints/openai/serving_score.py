"""vLLM's scoring routes on pooling engines: POST /score, /v1/score (each text pair's score), /rerank, /v1/rerank,
/v2/rerank (documents ordered by their score against a query), and a classifier's /classify (each input's class
probabilities). On a classifier (voltllm/pooling/classifier.py, a cross-encoder) a pair is one prompt
(pooling/scoring.py) and the texts carry the model's prompt template, as vLLM's Qwen3-Reranker examples write it; on an
embedding model (a bi-encoder) each text is embedded as /v1/embeddings embeds it and a pair's score is the cosine
similarity of its two embeddings."""
from __future__ import annotations

import logging
import time
from typing import Any

from fastapi.responses import JSONResponse

from voltllm.entrypoints.openai.errors import OpenAIError, bad_request
from voltllm.entrypoints.openai.request_log import shown
from voltllm.entrypoints.openai.scoring_protocol import ClassificationRequest, RerankRequest, ScoreRequest
from voltllm.entrypoints.openai.server_middleware import chosen_request_id, engine_request_id
from voltllm.entrypoints.openai.serving_common import (DisconnectWatcher, ServerState, collect_or_gone, new_id,
                                                       request_trace_headers, truncated, usage)
from voltllm.entrypoints.openai.serving_embedding import _param_of, _submit
from voltllm.pooling.params import PoolingParams, PoolingParamsError
from voltllm.pooling.scoring import (ScoreInputError, check_token_limit, cosine_scores, cut_texts, pair_token_ids,
                                     score_inputs, single_score)

logger = logging.getLogger("voltllm")


def _one_label(state: ServerState, what: str) -> None:
    """vLLM scores with a classifier of one label only (an embedding model scores by cosine similarity)."""
    if state.classifier is not None and state.classifier.num_labels != 1:
        raise bad_request(f"{what} needs a one-label classifier (a reranker); this model has "
                          f"{state.classifier.num_labels} labels: use POST /classify", "model")


def _params(req: Any, task: str) -> PoolingParams:
    try:
        return PoolingParams(use_activation=req.wants_activation(), task=task)
    except PoolingParamsError as e:
        raise bad_request(str(e), _param_of(e))


def _tokenizer(state: ServerState) -> Any:
    if state.tokenizer is None:
        raise bad_request("scoring tokenizes its texts: this server was started with --skip-tokenizer-init")
    return state.tokenizer


def _score_inputs(first: Any, second: Any, names: tuple[str, str]) -> tuple[list[str], list[str]]:
    try:
        return score_inputs(first, second, names)
    except ScoreInputError as e:
        raise bad_request(str(e), str(e).split(":", 1)[0].split(" ", 1)[0])


def _cut_texts(state: ServerState, req: Any, first: list[str], second: list[str]) -> tuple[list[str], list[str]]:
    """Each first text (query) and second text (document) cut to its first max_tokens_per_query /
    max_tokens_per_doc tokens, as vLLM cuts them: the text itself, before the pair prompt (template, special tokens)
    is made and before truncate_prompt_tokens cuts that (as LLM.score does)."""
    limits = []
    for name in ("max_tokens_per_query", "max_tokens_per_doc"):
        try:
            limits.append(check_token_limit(name, getattr(req, name), state.max_model_len))
        except ScoreInputError as e:
            raise bad_request(str(e), name)
    return cut_texts(_tokenizer(state), first, second, *limits)


async def _run(state: ServerState, raw_request: Any, req: Any, prefix: str, prompts: list[list[int]],
               params: PoolingParams, what: str, cache_salt: Any = None) -> tuple[str, list]:
    """The prompts through the engine: (the response id, their finished outputs)."""
    chosen_id = chosen_request_id(raw_request, req.request_id)
    base_id = f"{prefix}-{chosen_id}" if chosen_id is not None else new_id(prefix)
    engine_base = engine_request_id(base_id, chosen_id is not None)
    rids = [engine_base if len(prompts) == 1 else f"{engine_base}-{i}" for i in range(len(prompts))]
    streams = _submit(state, rids, prompts, params, cache_salt, req.priority, request_trace_headers(state, raw_request))
    if state.log_requests:
        logger.info("request %s: %s of %d prompt(s): %s", engine_base, what, len(prompts),
                    ", ".join(shown(p, state.max_log_len) for p in prompts))
    finals = await collect_or_gone(streams, DisconnectWatcher(raw_request, state, rids))
    if finals is None:
        return base_id, []
    for i, out in enumerate(finals):
        if out.outputs is None:  # aborted in the engine (a prompt its KV cache can never hold)
            raise OpenAIError(f"input {i} was aborted before it was computed (the KV cache cannot hold it)", 503,
                              code="request_aborted")
    return base_id, finals


async def _scored(state: ServerState, raw_request: Any, req: Any, prefix: str, first: list[str], second: list[str],
                  names: tuple[str, str], what: str) -> tuple[str, list]:
    """Each (first, second) pair's score, as outputs whose data is the score and whose prompt tokens are what the
    pair counts in the usage: (the response id, the outputs; none when the client left)."""
    tok = _tokenizer(state)
    first, second = _cut_texts(state, req, first, second)
    keep, side = req.truncate_prompt_tokens, req.truncation_side
    if state.classifier is not None:  # a cross-encoder: one prompt per pair
        if len(first) == 1:
            first = first * len(second)
        prompts = [truncated(pair_token_ids(tok, state.classifier, a, b), keep, state.max_model_len, side)
                   for a, b in zip(first, second)]
        return await _run(state, raw_request, req, prefix, prompts, _params(req, "score"), what, req.cache_salt)
    # a bi-encoder: every text embedded once (a single first text too), as /v1/embeddings embeds a string input
    prompts = []
    for name, texts in zip(names, (first, second)):
        for i, text in enumerate(texts):
            ids = tok.encode(text)
            if not ids:
                raise bad_request(f"{name}: text {i} is empty (it has no tokens to embed)", name)
            prompts.append(truncated(ids, keep, state.max_model_len, side))
    base_id, finals = await _run(state, raw_request, req, prefix, prompts, _params(req, "embed"), what,
                                 req.cache_salt)
    if not finals:
        return base_id, []
    return base_id, cosine_scores(finals[:len(first)], finals[len(first):], getattr(tok, "pad_token_id", None))


async def create_score(state: ServerState, req: ScoreRequest, raw_request: Any) -> JSONResponse:
    model = state.model_name(req.model)
    _one_label(state, "scoring")
    names, first, second = req.pair()
    first, second = _score_inputs(first, second, names)
    created = int(time.time())
    base_id, finals = await _scored(state, raw_request, req, "score", first, second, names, "scores")
    if not finals:
        return JSONResponse({}, status_code=499)
    data = [{"index": i, "object": "score", "score": single_score(o.outputs.data, o.request_id)}
            for i, o in enumerate(finals)]
    return JSONResponse({"id": base_id, "object": "list", "created": created, "model": model, "data": data,
                         "usage": usage(sum(len(o.prompt_token_ids) for o in finals), 0)})


async def create_rerank(state: ServerState, req: RerankRequest, raw_request: Any) -> JSONResponse:
    model = state.model_name(req.model)
    _one_label(state, "reranking")
    if not req.documents:
        raise bad_request("documents: at least one document must be given", "documents")
    base_id, finals = await _scored(state, raw_request, req, "rerank", [req.query], list(req.documents),
                                    ("query", "documents"), "reranking")
    if not finals:
        return JSONResponse({}, status_code=499)
    results = []
    for i, (doc, out) in enumerate(zip(req.documents, finals)):
        result: dict[str, Any] = {"index": i, "relevance_score": single_score(out.outputs.data, out.request_id)}
        if req.return_documents:
            result["document"] = {"text": doc}
        results.append(result)
    results.sort(key=lambda r: r["relevance_score"], reverse=True)  # (stable: ties keep the documents' order)
    top_n = req.top_n if req.top_n > 0 else len(results)
    tokens = sum(len(o.prompt_token_ids) for o in finals)
    return JSONResponse({"id": base_id, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                         "results": results[:top_n]})


async def create_classify(state: ServerState, req: ClassificationRequest, raw_request: Any) -> JSONResponse:
    model = state.model_name(req.model)
    value = req.input
    if isinstance(value, str):
        inputs: list = [value]
    elif not value:
        raise bad_request("input must not be empty", "input")
    elif all(isinstance(v, int) for v in value):
        inputs = [list(value)]
    else:
        inputs = list(value)
    prompts = []
    for i, p in enumerate(inputs):
        ids = state.tokenizer.encode(p, add_special_tokens=req.add_special_tokens) if isinstance(p, str) else p
        if not ids:
            raise bad_request(f"input {i} is empty", "input")
        prompts.append(truncated(ids, req.truncate_prompt_tokens, state.max_model_len, req.truncation_side))
    created = int(time.time())
    base_id, finals = await _run(state, raw_request, req, "classify", prompts, _params(req, "classify"),
                                 "classification")
    if not finals:
        return JSONResponse({}, status_code=499)
    data = []
    for i, out in enumerate(finals):
        probs = out.outputs.data.tolist()
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": i, "label": state.classifier.label(best), "probs": probs, "num_classes": len(probs),
                     "object": "classification"})
    return JSONResponse({"id": base_id, "object": "list", "created": created, "model": model, "data": data,
                         "usage": usage(sum(len(o.prompt_token_ids) for o in finals), 0)})
