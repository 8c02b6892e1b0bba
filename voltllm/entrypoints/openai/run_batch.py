"""`voltllm run-batch -i INPUT.jsonl -o OUTPUT.jsonl [MODEL] [flags]`: an OpenAI batch file run offline, as vLLM's
`run-batch`.

Each input line is `{"custom_id", "method": "POST", "url", "body"}` with url one of BATCH_URLS; the file is checked
whole before the model loads (unique custom_ids, no streaming), so a bad line costs no start-up. Each output line,
in the input's order, is `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}`, the
body being what `voltllm serve` would answer, a refusal included (its status code and error body, as OpenAI's batch
output has them). The requests go through the same app as the server, in this process and without a socket
(httpx's ASGI transport), up to WINDOW_PER_SEQ x --max-num-seqs at a time, so that the engine batches them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional, TextIO

from voltllm.config import ConfigError

logger = logging.getLogger("voltllm")

# (/v1/embeddings and the scoring routes: pooling models, --runner pooling; a generative model answers those lines
# 404, as its server does. vLLM's run-batch takes every URL ending in /score or /rerank: these are the ones served)
SCORE_URLS = ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings") + SCORE_URLS
WINDOW_PER_SEQ = 4  # requests in flight per --max-num-seqs: enough to keep every engine slot busy
PROGRESS_EVERY_S = 10.0


@dataclass(frozen=True)
class BatchLine:
    custom_id: str
    url: str
    body: dict


def add_parser(subparsers: Any, help: str) -> argparse.ArgumentParser:
    from voltllm.cli_args import add_engine_args
    from voltllm.cli_config import add_config_args
    from voltllm.entrypoints.openai.request_flags import add_request_args

    p = subparsers.add_parser(
        "run-batch", help=help, description="Run an OpenAI batch file (JSONL: custom_id, method, url, body) through "
        "the model and write one result line per request, in order (vLLM's run-batch). URLs: "
        + ", ".join(BATCH_URLS) + ".")
    p.add_argument("model", nargs="?", default=None, help="model path or Hub repo id (default: the embedded "
                   "SmolLM2-135M-Instruct GGUF)")
    p.add_argument("-i", "--input-file", required=True, help="the batch file (JSONL); - for stdin")
    p.add_argument("-o", "--output-file", required=True, help="where the results go (JSONL); - for stdout")
    add_engine_args(p)
    requests = p.add_argument_group("requests (as `voltllm serve`)")
    add_request_args(requests)
    add_config_args(requests)
    p.set_defaults(func=run_batch)
    return p


def read_batch(stream: TextIO, source: str) -> list[BatchLine]:
    """The batch file's requests, or a ConfigError naming the first bad line."""
    lines: list[BatchLine] = []
    seen: set[str] = set()
    for number, text in enumerate(stream, 1):
        if not text.strip():
            continue
        where = f"{source} line {number}"
        try:
            item = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not JSON: {e}") from None
        if not isinstance(item, dict):
            raise ConfigError(f"{where}: expected an object with custom_id, method, url and body")
        custom_id, method, url, body = (item.get(k) for k in ("custom_id", "method", "url", "body"))
        unknown = set(item) - {"custom_id", "method", "url", "body"}
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        if not isinstance(custom_id, str) or not custom_id:
            raise ConfigError(f"{where}: custom_id must be a non-empty string")
        if custom_id in seen:
            raise ConfigError(f"{where}: custom_id {custom_id!r} is used twice (each request needs its own)")
        if method != "POST":
            raise ConfigError(f"{where}: method must be POST, got {method!r}")
        if url not in BATCH_URLS:
            raise ConfigError(f"{where}: url {url!r} is not served in a batch; one of: {', '.join(BATCH_URLS)}")
        if not isinstance(body, dict):
            raise ConfigError(f"{where}: body must be a JSON object (the request)")
        if body.get("stream"):
            raise ConfigError(f"{where}: a batch request cannot stream (body.stream)")
        if body.get("background"):
            raise ConfigError(f"{where}: a batch request cannot run in the background (body.background)")
        if url == "/v1/embeddings" and body.get("encoding_format") in ("bytes", "bytes_only"):
            raise ConfigError(f"{where}: body.encoding_format {body['encoding_format']!r} answers with a binary body, "
                              "which a JSONL result line cannot hold; use float or base64")
        seen.add(custom_id)
        lines.append(BatchLine(custom_id, url, body))
    return lines


def result_line(line: BatchLine, status: int, body: Any) -> dict:
    """One output line in the OpenAI batch output format."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": f"vllm-batch-{uuid.uuid4().hex}", "body": body},
            "error": None}


def run_batch(args: argparse.Namespace) -> int:
    from voltllm.cli_args import engine_args_from
    from voltllm.entrypoints.openai.request_flags import check_request_flags

    for flag, path in (("--input-file", args.input_file), ("--output-file", args.output_file)):
        if path.startswith(("http://", "https://")):
            raise ConfigError(f"{flag} {path}: URLs are not built; give a local path or -")
    if args.input_file == "-":
        lines = read_batch(sys.stdin, "stdin")
    else:
        try:
            with open(args.input_file) as f:
                lines = read_batch(f, args.input_file)
        except OSError as e:
            raise ConfigError(f"--input-file {args.input_file}: {e.strerror or e}") from None
    check_request_flags(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # (a line per in-process request otherwise)
    config = engine_args_from(args).create_engine_config()
    from voltllm.entrypoints.openai.request_flags import lora_modules

    loras = lora_modules(config, args, list(args.served_model_names or [config.model.served_model_name]))
    out = sys.stdout if args.output_file == "-" else _open_output(args.output_file)
    try:
        return asyncio.run(_run(config, args, lines, out, loras))
    finally:
        if out is not sys.stdout:
            out.close()


def _open_output(path: str) -> TextIO:
    try:
        return open(path, "w")
    except OSError as e:
        raise ConfigError(f"--output-file {path}: {e.strerror or e}") from None


async def _run(config: Any, args: argparse.Namespace, lines: list[BatchLine], out: TextIO,
               loras: Optional[dict] = None) -> int:
    import httpx

    from voltllm.engine.data_parallel import make_async_engine
    from voltllm.entrypoints.openai.app import build_app
    from voltllm.entrypoints.openai.request_flags import server_state
    from voltllm.entrypoints.openai.metrics import engine_metrics
    from voltllm.tracing import make_request_tracer

    engine = make_async_engine(config, log_level=logging.getLogger().getEffectiveLevel() or logging.INFO)
    tracer = None
    try:
        names = list(args.served_model_names or [config.model.served_model_name])
        engine.tracer = tracer = make_request_tracer(config.otlp_traces, names[0])
        await engine.start()
        metrics = engine_metrics(names[0], engine)
        app = build_app(server_state(config, args, names, engine, loras), metrics)
        # requests in flight: enough to keep every engine's batch full
        window = asyncio.Semaphore(WINDOW_PER_SEQ * config.scheduler.max_num_seqs
                                   * config.parallel.data_parallel_size)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://run-batch",
                                     timeout=None) as client:
            async def one(line: BatchLine) -> dict:
                async with window:
                    r = await client.post(line.url, json=line.body)
                try:
                    body = r.json()
                except ValueError:  # (an unexpected non-JSON answer: kept as an error body)
                    body = {"error": {"message": r.text, "type": "InternalServerError", "code": r.status_code}}
                return result_line(line, r.status_code, body)

            tasks = [asyncio.ensure_future(one(line)) for line in lines]
            return await _write_in_order(tasks, out, engine)
    finally:
        engine.shutdown()
        if tracer is not None:  # (the spans still waiting are sent)
            tracer.shutdown()


async def _write_in_order(tasks: list[asyncio.Future], out: TextIO, engine: Any) -> int:
    """Each result as soon as those before it are written; 1 when the engine dies on the way."""
    last_report, done = time.monotonic(), 0
    for task in tasks:
        while not task.done():
            await asyncio.wait([task], timeout=1.0)
            if engine.dead is not None:
                for t in tasks:
                    t.cancel()
                logger.error("run-batch: the engine stopped (%s) after %d of %d requests", engine.dead, done,
                             len(tasks))
                return 1
            if time.monotonic() - last_report > PROGRESS_EVERY_S:
                logger.info("run-batch: %d of %d requests done", sum(t.done() for t in tasks), len(tasks))
                last_report = time.monotonic()
        out.write(json.dumps(task.result(), ensure_ascii=False) + "\n")
        done += 1
    out.flush()
    logger.info("run-batch: %d requests done", done)
    return 0
