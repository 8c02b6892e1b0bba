"""`voltllm serve [MODEL]`: the OpenAI-compatible server (engine flags from cli_args, server flags here).

Startup: check the server flags -> build the engine config (may fetch the default model; refuses flags
whose capability is not built, exit 2) -> reserve the port -> start the engine process (weights load
there while this process loads the tokenizer) -> serve HTTP. SIGINT / SIGTERM stop HTTP, then the
engine process; the engine also exits by itself if this process dies.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import ssl
import stat
import sys
import time
from typing import Any, Optional

from voltllm.cli_args import json_string_list
from voltllm.cli_config import add_config_args
from voltllm.entrypoints.openai.extra_middleware import resolve_middleware
from voltllm.entrypoints.openai.request_flags import (add_request_args, check_request_flags, lora_modules,
                                                      server_state)
from voltllm.config import ConfigError

logger = logging.getLogger("voltllm")


def add_parser(subparsers: Any, help: str) -> argparse.ArgumentParser:
    from voltllm.cli_args import add_engine_args

    p = subparsers.add_parser(
        "serve", help=help, description="Serve a model over an OpenAI-compatible HTTP API "
        "(/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /v1/models, /tokenize, /detokenize, "
        "/health, /metrics; an embedding model's /v1/embeddings with --runner pooling). "
        "See docs/cli.md for every flag and its status.")
    p.add_argument("model", nargs="?", default=None,
                   help="model path: a Hugging Face directory or a .gguf file (default: the embedded "
                        "SmolLM2-135M-Instruct GGUF, fetched once)")
    add_engine_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all IPv4 interfaces)")
    s.add_argument("--port", type=int, default=8000)
    add_config_args(s)
    s.add_argument("--api-key", nargs="+", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* routes (several keys: any of them)")
    add_request_args(s)
    s.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    s.add_argument("--disable-uvicorn-access-log", action="store_true")
    s.add_argument("--disable-access-log-for-endpoints", default=None,
                   help='comma-separated paths left out of the access log, e.g. "/health,/metrics,/ping"')
    s.add_argument("--log-config-file", default=None,
                   help="a JSON logging configuration (logging.config.dictConfig) for voltllm's and uvicorn's logs")
    s.add_argument("--enable-tokenizer-info-endpoint", action=argparse.BooleanOptionalAction, default=False,
                   help="serve GET /tokenizer_info (the tokenizer's configuration and the chat template)")
    s.add_argument("--disable-log-stats", action="store_true", help="no periodic engine-stats log line")
    s.add_argument("--enable-request-id-headers", action=argparse.BooleanOptionalAction, default=False,
                   help="add X-Request-Id to every response (the request's own, else a new one)")
    s.add_argument("--disable-fastapi-docs", action=argparse.BooleanOptionalAction, default=False,
                   help="no /docs, /redoc or /openapi.json")
    s.add_argument("--enable-server-load-tracking", action=argparse.BooleanOptionalAction, default=False,
                   help="GET /load reports the requests in flight on the model routes (server_load)")
    s.add_argument("--root-path", default="", help="ASGI root path, when behind a path-based proxy")
    s.add_argument("--h11-max-incomplete-event-size", type=int, default=4 * 1024 * 1024,
                   help="bytes of a request's head (request line and headers) the HTTP parser buffers before it "
                        "is complete (vLLM's default, 4 MiB); larger heads are refused")
    s.add_argument("--h11-max-header-count", type=int, default=256,
                   help="header fields a request may have (vLLM's default); more are answered 431")
    s.add_argument("--middleware", action="extend", nargs="+", default=[],
                   help="an extra ASGI middleware class or async HTTP middleware function (request, call_next), as "
                        "an import path; repeat the flag for several (the last is the outermost)")
    s.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the private key (PEM)")
    s.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the certificate chain (PEM)")
    s.add_argument("--ssl-ca-certs", default=None, help="HTTPS: the CA certificates that client certificates are "
                   "checked against (PEM)")
    s.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE), choices=[0, 1, 2],
                   help="HTTPS client certificates (Python's ssl.CERT_*): 0 not asked (default), 1 checked when "
                   "sent, 2 required")
    s.add_argument("--ssl-ciphers", default=None, help="HTTPS cipher suites for TLS 1.2 and below (OpenSSL's list "
                   "format)")
    s.add_argument("--enable-ssl-refresh", action=argparse.BooleanOptionalAction, default=False,
                   help="HTTPS: serve the certificate files again when they change (a renewal), without a restart")
    s.add_argument("--uds", default=None, help="serve on this Unix domain socket path instead of --host / --port")
    s.add_argument("--allowed-origins", type=json_string_list("--allowed-origins"), default=["*"],
                   help='CORS: origins browsers may call from, a JSON list (default ["*"])')
    s.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction, default=False,
                   help="CORS: allow credentials")
    s.add_argument("--allowed-methods", type=json_string_list("--allowed-methods"), default=["*"],
                   help='CORS: a JSON list of methods (default ["*"])')
    s.add_argument("--allowed-headers", type=json_string_list("--allowed-headers"), default=["*"],
                   help='CORS: a JSON list of headers (default ["*"])')
    s.add_argument("--allow-runtime-lora-updating", action=argparse.BooleanOptionalAction, default=False,
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
                   "VLLM_ALLOW_RUNTIME_LORA_UPDATING; needs --enable-lora): clients load adapters from paths on this "
                   "machine")
    s.add_argument("--disable-frontend-multiprocessing", action="store_true",
                   help="accepted for vLLM compatibility: as in vLLM V1, the server holds the engine client and the "
                        "engine runs in its own process either way")
    s.add_argument("--engine-ready-timeout", type=float, default=None,
                   help="seconds to wait for the engine to load before giving up (default: no limit)")
    p.set_defaults(func=run_serve)
    return p


def check_server_flags(args: argparse.Namespace) -> None:
    """Refuse server flags we cannot honour (ConfigError -> exit 2), before any model is loaded."""

    check_request_flags(args)
    if getattr(args, "skip_tokenizer_init", False):
        raise ConfigError("--skip-tokenizer-init is not supported by `voltllm serve`: the server needs the "
                          "tokenizer for chat templates, text prompts and streaming text")
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    if args.api_key is not None and not all(args.api_key):
        raise ConfigError("--api-key must not be empty")
    for flag, words in (("--served-model-name", args.served_model_names), ("--api-key", args.api_key)):
        words = words or []
        if len(words) > 1 and args.model is None and getattr(args, "model_flag", None) is None \
                and _looks_like_model(words[-1]):
            # the option takes every word after it, so `--served-model-name NAME MODEL` made MODEL a second name
            # and would serve the embedded default model (vLLM refuses this order too)
            raise ConfigError(f"{flag} took {words[-1]!r} as a value and no MODEL was given: put MODEL first "
                              f"(`voltllm serve MODEL {flag} ...`) or pass --model")
    resolve_middleware(args.middleware)  # (imported again when the app is built: a bad path fails here, at once)
    for flag, value in (("--h11-max-incomplete-event-size", args.h11_max_incomplete_event_size),
                        ("--h11-max-header-count", args.h11_max_header_count)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if args.ssl_keyfile and not args.ssl_certfile:
        raise ConfigError("--ssl-keyfile needs --ssl-certfile")
    for flag, given in (("--ssl-ca-certs", args.ssl_ca_certs), ("--ssl-ciphers", args.ssl_ciphers),
                        ("--ssl-cert-reqs", args.ssl_cert_reqs != ssl.CERT_NONE),
                        ("--enable-ssl-refresh", args.enable_ssl_refresh)):
        if given and not args.ssl_certfile:
            raise ConfigError(f"{flag} applies to HTTPS: add --ssl-certfile (and --ssl-keyfile)")
    if args.ssl_cert_reqs != ssl.CERT_NONE and not args.ssl_ca_certs:
        raise ConfigError(f"--ssl-cert-reqs {args.ssl_cert_reqs} checks client certificates: add --ssl-ca-certs (the "
                          "CAs they are checked against)")
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile),
                       ("--ssl-ca-certs", args.ssl_ca_certs), ("--log-config-file", args.log_config_file)):
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"{flag} {path}: no such file")
    if args.ssl_ciphers is not None:
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).set_ciphers(args.ssl_ciphers)
        except ssl.SSLError:
            raise ConfigError(f"--ssl-ciphers {args.ssl_ciphers!r}: OpenSSL knows none of these cipher "
                              "suites") from None
    if args.log_config_file is not None:
        log_config(args.log_config_file)  # (ConfigError for a file that is not a JSON logging configuration)
    if args.uds is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.uds))):
        raise ConfigError(f"--uds {args.uds}: its directory does not exist")


def log_config(path: str) -> dict:
    """--log-config-file: vLLM's JSON logging configuration (a logging.config.dictConfig mapping)."""
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--log-config-file {path}: not a JSON file: {e}") from None
    if not isinstance(config, dict) or "version" not in config:
        raise ConfigError(f"--log-config-file {path}: must be a JSON object in logging.config.dictConfig's schema "
                          '(with "version": 1)')
    return config


def _looks_like_model(word: str) -> bool:
    """A path that exists, a .gguf file or an org/name Hub repo id."""
    return os.path.exists(word) or word.endswith(".gguf") or "/" in word


def _say(msg: str) -> None:
    print(f"voltllm: {msg}", file=sys.stderr, flush=True)


def _bind_unix(path: str) -> socket.socket:
    """--uds: listen on a Unix domain socket; a stale socket file (nothing listens on it) is replaced."""
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise ConfigError(f"--uds {path}: exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # (left by a server that was killed)
        else:
            raise ConfigError(f"--uds {path}: another server listens on it")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {path}: {e.strerror or e}") from None
    sock.set_inheritable(False)
    return sock


def _bind(host: str, port: int) -> socket.socket:
    """Reserve the port now, so a busy port fails before the model loads (uvicorn listens on it later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(False)
    return sock


class _Terminate(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C: stop serving, stop the engine, exit 0."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminate()


def run_serve(args: argparse.Namespace) -> int:
    from voltllm.cli_args import engine_args_from
    from voltllm.engine.async_llm import EngineStartError

    check_server_flags(args)
    for name in args.profile or []:
        from voltllm.profiles import load_profile

        _say(f"profile {name}: {load_profile(name).description}")
    if args.api_key is None and os.environ.get("VLLM_API_KEY"):
        # vLLM reads its key from this variable too; voltllm takes configuration only from flags (DESIGN.md), so
        # say loudly that this server will not ask for one
        logger.warning("VLLM_API_KEY is set, but voltllm reads the API key only from --api-key: this server "
                       "requires no key. Pass --api-key to require one.")
    if args.max_log_len is not None and not args.enable_log_requests:
        logger.warning("--max-log-len %d has no effect: requests are logged only with --enable-log-requests",
                       args.max_log_len)
    if args.served_model_names:
        args.served_model_name = args.served_model_names[0]
    ea = engine_args_from(args)
    _say(f"resolving the model ({ea.model or 'embedded default SmolLM2-135M-Instruct'}) ...")
    t0 = time.monotonic()
    try:
        config = ea.create_engine_config()  # ConfigError propagates: printed by voltllm.cli, exit 2
    except RuntimeError as e:  # the default model could not be fetched
        _say(f"error: {e}")
        return 1
    mc = config.model
    length = f"max_model_len {mc.max_model_len}" + (" at most, fitted to the KV cache" if mc.max_model_len_fit else "")
    dp = config.parallel.data_parallel_size
    _say(f"model {mc.model} ({mc.architecture}, {str(mc.dtype).replace('torch.', '')}, {length}) on "
         f"{config.device.device}" + (f", {dp} data-parallel engines" if dp > 1 else "")
         + f"; config in {time.monotonic() - t0:.1f} s")
    names = list(args.served_model_names or [mc.served_model_name])
    loras = lora_modules(config, args, names)  # (ConfigError: exit 2 before the engine starts)
    if args.allow_runtime_lora_updating and config.lora is None:
        raise ConfigError("--allow-runtime-lora-updating loads LoRA adapters at run time: add --enable-lora (and "
                          "--max-lora-rank / --max-loras for the adapters to come)")
    sock = _bind_unix(args.uds) if args.uds else _bind(args.host, args.port)
    holder: dict[str, Any] = {"rc": 0}
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        asyncio.run(_serve(config, args, names, sock, holder, loras))
    except KeyboardInterrupt:
        _say("shutting down")
    except EngineStartError as e:
        _say(f"error: {e}")
        holder["rc"] = 1
    finally:
        engine = holder.get("engine")
        if engine is not None:
            engine.shutdown()
        if holder.get("tracer") is not None:  # (the spans still waiting are sent; os._exit below runs no atexit hook)
            holder["tracer"].shutdown()
        sock.close()
        if args.uds and os.path.exists(args.uds):
            os.unlink(args.uds)
        signal.signal(signal.SIGTERM, previous)
    _say("stopped")
    # Everything this process owns is released above; skip the interpreter's module teardown, which
    # takes seconds with torch and transformers loaded, so that SIGTERM / Ctrl-C exits promptly.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(holder["rc"])


async def _watch_engine(engine: Any, server: Any, holder: dict) -> None:
    """An API server without its engine is useless: when the engine dies, stop serving (exit 1)."""
    while engine.dead is None and engine.is_healthy:
        await asyncio.sleep(0.5)
    if not server.should_exit:
        why = engine.dead or (f"the engine process exited (exit code {engine.proc.exitcode})"
                              if engine.proc is not None and not engine.proc.is_alive() else "the engine stopped")
        _say(f"error: {why}; shutting the server down")
        holder["rc"] = 1
        server.should_exit = True


def spec_summary(extra: dict) -> str:
    """The periodic log's speculation part, as vLLM's: acceptance since start, the mean acceptance length (tokens a
    verification emits) and each draft position's acceptance rate; empty before any draft."""
    drafts = extra.get("spec_draft_tokens", 0)
    if not drafts:
        return ""
    per_pos = ", ".join(f"{a / d:.2f}" for a, d in zip(extra.get("spec_accepted_per_pos", ()),
                                                        extra.get("spec_drafted_per_pos", ())) if d)
    mean = 1 + extra["spec_accepted_tokens"] / extra["spec_drafts"] if extra.get("spec_drafts") else 1.0
    return (f", drafts accepted {extra['spec_accepted_tokens'] / drafts * 100:.1f}% (mean acceptance length "
            f"{mean:.2f}, per position {per_pos})")


async def _log_stats(engine: Any, metrics: Any, every: float = 10.0) -> None:
    last_gen, last_prompt, last_t = 0, 0, time.monotonic()
    last_perf = (0.0, 0.0)  # --enable-mfu-metrics: FLOPs and bytes per GPU at the last line
    while True:
        await asyncio.sleep(every)
        s = engine.stats
        now = time.monotonic()
        gen, prompt = metrics.total_generated, metrics.total_prompt
        if gen == last_gen and prompt == last_prompt and not (s.num_running or s.num_waiting):
            continue
        dt = now - last_t
        rate = s.prefix_cache_hits / s.prefix_cache_queries * 100 if s.prefix_cache_queries else 0.0
        spec = spec_summary(s.extra)
        cpu_queries = s.extra.get("external_prefix_cache_queries")  # --kv-offloading-size (vLLM logs it so)
        cpu = (f", external prefix-cache hit rate {s.extra['external_prefix_cache_hits'] / cpu_queries * 100:.1f}%"
               if cpu_queries else "")
        mfu = ""
        if "estimated_flops_per_gpu" in s.extra:  # (vLLM's MFU line: estimated TF/s and GB/s per GPU)
            perf = (s.extra["estimated_flops_per_gpu"],
                    s.extra["estimated_read_bytes_per_gpu"] + s.extra["estimated_write_bytes_per_gpu"])
            mfu = (f", MFU: {(perf[0] - last_perf[0]) / dt / 1e12:.1f} TF/s/GPU "
                   f"{(perf[1] - last_perf[1]) / dt / 1e9:.1f} GB/s/GPU")
            last_perf = perf
        logger.info("engine: %d running, %d waiting, KV cache %.1f%% used, prefix-cache hit rate %.1f%%%s, "
                    "generation %.1f tok/s, prompt %.1f tok/s (finished prompts)%s%s", s.num_running, s.num_waiting,
                    s.kv_cache_usage * 100, rate, cpu, (gen - last_gen) / dt, (prompt - last_prompt) / dt, spec, mfu)
        last_gen, last_prompt, last_t = gen, prompt, now


async def _serve(config: Any, args: argparse.Namespace, names: list[str], sock: socket.socket,
                 holder: dict, loras: dict) -> None:
    import uvicorn

    from voltllm.engine.data_parallel import make_async_engine
    from voltllm.entrypoints.openai.app import CorsSettings, HttpOptions, build_app
    from voltllm.entrypoints.openai.metrics import engine_metrics
    from voltllm.tracing import make_request_tracer

    engine = make_async_engine(config, log_level=logging.getLogger().getEffectiveLevel() or logging.INFO)
    holder["engine"] = engine
    metrics = engine_metrics(names[0], engine)
    engine.tracer = holder["tracer"] = make_request_tracer(config.otlp_traces, names[0])
    dp = config.parallel.data_parallel_size
    _say(("starting the engine process" if dp == 1 else f"starting {dp} data-parallel engine processes")
         + " and loading the weights there; loading the tokenizer here ...")
    t0 = time.monotonic()
    await engine.start(timeout=args.engine_ready_timeout)
    info = engine.engine_info
    pids = f"pid {info.get('pid')}" if dp == 1 else f"pids {info.get('pids')}"
    _say(f"{'engine' if dp == 1 else f'{dp} engines'} ready in {time.monotonic() - t0:.1f} s ({pids}, "
         f"{info.get('num_blocks')} KV blocks of {info.get('block_size')} tokens, max_model_len "
         f"{engine.max_model_len})")
    state = server_state(config, args, names, engine, loras)
    if args.allow_runtime_lora_updating:
        logger.warning("--allow-runtime-lora-updating: POST /v1/load_lora_adapter reads adapters from any path this "
                       "server can read (require --api-key where clients are not trusted)")
    cors = CorsSettings(tuple(args.allowed_origins), args.allow_credentials, tuple(args.allowed_methods),
                        tuple(args.allowed_headers))
    http = HttpOptions(fastapi_docs=not args.disable_fastapi_docs, request_id_headers=args.enable_request_id_headers,
                       server_load_tracking=args.enable_server_load_tracking,
                       runtime_lora_updating=args.allow_runtime_lora_updating,
                       tokenizer_info=args.enable_tokenizer_info_endpoint, sleep_mode=config.enable_sleep_mode,
                       profiling=config.profiler is not None, middleware=resolve_middleware(args.middleware),
                       max_header_count=args.h11_max_header_count)
    app = build_app(state, metrics, api_key=args.api_key, root_path=args.root_path, cors=cors, http=http)
    tls: dict[str, Any] = {"ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile,
                           "ssl_ca_certs": args.ssl_ca_certs, "ssl_cert_reqs": args.ssl_cert_reqs}
    if args.ssl_ciphers is not None:
        tls["ssl_ciphers"] = args.ssl_ciphers  # (else uvicorn's default list)
    logs: dict[str, Any] = {}
    if args.log_config_file is not None:
        logs["log_config"] = log_config(args.log_config_file)  # (uvicorn applies it: dictConfig)
    uv_config = uvicorn.Config(app, log_level=args.uvicorn_log_level, access_log=not args.disable_uvicorn_access_log,
                               timeout_graceful_shutdown=3, timeout_keep_alive=5, lifespan="off",
                               root_path=args.root_path,
                               h11_max_incomplete_event_size=args.h11_max_incomplete_event_size, **tls, **logs)
    if args.disable_access_log_for_endpoints:
        from voltllm.entrypoints.openai.access_log import quiet_endpoints

        quiet_endpoints(args.disable_access_log_for_endpoints, args.root_path)
    class _Server(uvicorn.Server):
        async def shutdown(self, sockets: Optional[list] = None) -> None:
            # end in-flight requests first, so that open streams close now instead of at the graceful timeout
            n = engine.num_active_requests
            if n:
                _say(f"aborting {n} request(s) in flight")
            engine.abort_all()
            await super().shutdown(sockets)

    server = _Server(uv_config)
    serve_task = asyncio.ensure_future(server.serve(sockets=[sock]))
    stats_task: Optional[asyncio.Task] = None
    tls_task: Optional[asyncio.Task] = None
    watch_task = asyncio.ensure_future(_watch_engine(engine, server, holder))
    try:
        while not server.started and not serve_task.done():
            await asyncio.sleep(0.05)
        if server.started:
            host = args.host if ":" not in args.host else f"[{args.host}]"
            shown = ", ".join(repr(n) for n in [*names, *loras])
            scheme = "https" if args.ssl_certfile else "http"
            where = (f"unix:{args.uds} (OpenAI API base path /v1)" if args.uds else
                     f"{scheme}://{host}:{args.port} (OpenAI API base URL {scheme}://{host}:{args.port}/v1)")
            _say(f"serving {shown} at {where}" + ("; API key required on /v1" if args.api_key else ""))
            if not args.disable_log_stats:
                stats_task = asyncio.ensure_future(_log_stats(engine, metrics))
            if args.enable_ssl_refresh:  # (uvicorn built its SSL context when it started)
                from voltllm.entrypoints.openai.tls_refresh import refresh_tls_on_change

                tls_task = asyncio.ensure_future(refresh_tls_on_change(
                    uv_config.ssl, args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs))
        await serve_task
    finally:
        watch_task.cancel()
        for task in (stats_task, tls_task):
            if task is not None:
                task.cancel()
        if not serve_task.done():
            server.should_exit = True
            serve_task.cancel()
        engine.shutdown()
