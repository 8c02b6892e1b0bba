"""Runner against a running OpenAI-compatible server (`--base-url`): streaming /v1/completions.

Each request sends its prompt as token ids, forces its length (ignore_eos, min_tokens = max_tokens) and
asks for usage in every chunk (stream_options.continuous_usage_stats), so each chunk tells how many tokens
it carries even when the server merges tokens (partial UTF-8). Times are client-side: TTFT = first chunk
with tokens - send; decode time = last token chunk - first. The server must stream text per token (start
it with a tokenizer); a server without continuous usage stats is counted one token per text chunk, with
the remainder from the final usage put on the last chunk.

Requests with images (--scenario random-mm) go to streaming /v1/chat/completions instead, as vLLM's openai-chat
backend sends them: one user message of a text part (the request's ids decoded with the model's tokenizer) then one
image_url part per image (a JPEG data URL); the prompt tokens each request reports are the server's usage.prompt_tokens
(chat template, text tokenized again, image tokens), its image tokens the model's processor's count for each size.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from voltllm.bench.inprocess import Plan, Workload
from voltllm.bench.metrics import RequestTiming, RunResult
from voltllm.bench.workloads import RequestSource

logger = logging.getLogger("voltllm.bench")


@dataclass
class _Streamed:
    """What one streamed completion brought: a time per token, and where asked for, the token ids and the final
    usage's prompt_tokens_details.cached_tokens (None: not reported)."""

    times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    cached_tokens: Optional[int] = None
    prompt_tokens: Optional[int] = None  # the final usage's


# prefix-cache counters of /metrics (vLLM's names, which a voltllm server also writes): the GPU pool's hits (vLLM's
# older name second) and the CPU tier's (KV connector's), in prompt tokens since the server started
HIT_COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
EXTERNAL_HIT_COUNTER = "vllm:external_prefix_cache_hits_total"
# speculative decoding's counters (vLLM's names, a voltllm server's too): the run's verifications of a request's
# drafts, draft tokens scored and accepted, for the acceptance metrics (bench/metrics.spec_metrics)
SPEC_COUNTERS = {"drafts": "vllm:spec_decode_num_drafts_total",
                 "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
                 "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total"}


def parse_counters(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """The named series of a Prometheus text exposition, summed over their labels (engines)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            rest = line.rsplit("}", 1)[-1] if "{" in line else line[len(name):]
            try:
                out[name] = out.get(name, 0.0) + float(rest.split()[0])
            except (IndexError, ValueError):
                continue  # (a sample this reader does not understand: not counted)
    return out


class ClientRunner:
    def __init__(self, base_url: str, model: Optional[str] = None, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = -1, sampling_seed: int = 0, api_key: Optional[str] = None,
                 transport: Any = None, decode_text: Any = None, image_token_counts: Optional[dict] = None):
        try:
            import httpx
        except ImportError as e:  # httpx ships with the test extras
            raise RuntimeError("--base-url needs the httpx package (pip install httpx)") from e
        self.base_url = base_url.rstrip("/")
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.sampling_seed = sampling_seed
        # random-mm: token ids -> the chat message's text (the model's tokenizer); "HxW" -> an image's prompt tokens
        self.decode_text = decode_text
        self.image_token_counts = image_token_counts or {}
        self.loop = asyncio.new_event_loop()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(base_url=self.base_url, timeout=None, headers=headers, transport=transport,
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
        self.model = model or self.loop.run_until_complete(self._first_model())

    async def _first_model(self) -> str:
        r = await self.client.get("/v1/models")
        r.raise_for_status()
        data = r.json().get("data") or []
        if not data:
            raise RuntimeError(f"{self.base_url}/v1/models lists no model")
        return data[0]["id"]

    def server_platform(self) -> dict:
        """{"gpu", "dtype"} of a voltllm server, from its acceleration report (GET /v1/acceleration); {} when the
        server has none (another engine) or refuses it."""
        async def get() -> dict:
            r = await self.client.get("/v1/acceleration")
            r.raise_for_status()
            d = r.json()
            return {"gpu": d["platform"]["name"], "dtype": d["configuration"]["dtype"]}
        try:
            return self.loop.run_until_complete(get())
        except Exception:  # any failure only leaves the fields to the local machine
            return {}

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.close()

    def payload(self, prompt: list[int], output_len: int, seed: int) -> dict:
        body: dict[str, Any] = {
            "model": self.model, "prompt": prompt, "max_tokens": output_len, "min_tokens": output_len,
            "ignore_eos": True, "temperature": self.temperature, "top_p": self.top_p, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        if self.top_k > 0:
            body["top_k"] = self.top_k
        return body

    def chat_payload(self, text_ids: list[int], images: tuple, output_len: int, seed: int) -> dict:
        """A streaming chat completion of the text then the images (vLLM's openai-chat order)."""
        if self.decode_text is None:
            raise RuntimeError("requests with images need the model's tokenizer to write their text (decode_text)")
        content = [{"type": "text", "text": self.decode_text(text_ids)}]
        content += [{"type": "image_url", "image_url": {"url": im.data_url()}} for im in images]
        body = self.payload(text_ids, output_len, seed)
        del body["prompt"]
        body["messages"] = [{"role": "user", "content": content}]
        return body

    async def _one(self, body: dict, t_send: float) -> RequestTiming:
        got = await self._stream(body)
        times = got.times
        if "messages" not in body:
            return RequestTiming(prompt_tokens=len(body["prompt"]), output_tokens=len(times), arrival=t_send,
                                 first_token=times[0], last_token=times[-1], token_times=times)
        images = body["bench_images"]
        return RequestTiming(prompt_tokens=got.prompt_tokens or 0, output_tokens=len(times), arrival=t_send,
                             first_token=times[0], last_token=times[-1], token_times=times, images=len(images),
                             image_tokens=sum(self.image_token_counts.get(f"{im.height}x{im.width}", 0)
                                              for im in images))

    async def _stream(self, body: dict) -> _Streamed:
        got = _Streamed()
        times = got.times
        final_total: Optional[int] = None
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        body = {k: v for k, v in body.items() if k != "bench_images"}
        async with self.client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise RuntimeError(f"POST {path} -> {resp.status_code}: {text[:500]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    continue  # read on to the end of the stream so the connection closes cleanly
                now = time.monotonic()
                obj = json.loads(data)
                if "error" in obj:
                    raise RuntimeError(f"server error while streaming: {obj['error']}")
                choices = obj.get("choices") or []
                usage = obj.get("usage") or {}
                total = usage.get("completion_tokens")
                if not choices:  # the final usage-only chunk
                    final_total = total if total is not None else final_total
                    got.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                    got.prompt_tokens = usage.get("prompt_tokens", got.prompt_tokens)
                    continue
                got.token_ids.extend(choices[0].get("token_ids") or [])
                if total is not None:
                    k = total - len(times)
                else:  # (a completion's text, a chat chunk's delta content)
                    k = 1 if choices[0].get("text") or (choices[0].get("delta") or {}).get("content") else 0
                times.extend([now] * max(k, 0))
        if final_total is not None and final_total > len(times) and times:
            times.extend([times[-1]] * (final_total - len(times)))
        if not times:
            raise RuntimeError("the server streamed no tokens (does it stream text? start it with a tokenizer)")
        return got

    async def _sent_at(self, body: dict, at: float) -> RequestTiming:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        return await self._one(body, at)

    async def _batch(self, bodies: list[dict], offsets: list[float]) -> tuple[float, list[RequestTiming], float]:
        t0 = time.monotonic()
        reqs = await asyncio.gather(*(self._sent_at(b, t0 + dt) for b, dt in zip(bodies, offsets)))
        return t0, list(reqs), time.monotonic()

    def __call__(self, plan: Plan, run: str, work: Workload | RequestSource) -> RunResult:
        if isinstance(work, RequestSource):
            return self.loop.run_until_complete(self._run_source(plan, run, work))
        if work.images is None:
            bodies = [self.payload(p, n, self.sampling_seed + i)
                      for i, (p, n) in enumerate(zip(work.prompts, work.output_lens))]
        else:  # (the images are encoded here, before the run's clock starts)
            bodies = [{**self.chat_payload(p, ims, n, self.sampling_seed + i), "bench_images": ims}
                      for i, (p, ims, n) in enumerate(zip(work.prompts, work.images, work.output_lens))]
        offsets = [work.arrival(i) for i in range(len(bodies))]
        before = self.loop.run_until_complete(self._server_counters())
        t0, reqs, _ = self.loop.run_until_complete(self._batch(bodies, offsets))
        after = self.loop.run_until_complete(self._server_counters())
        for r, n in zip(reqs, work.output_lens):
            if r.output_tokens != n:
                raise RuntimeError(f"the server made {r.output_tokens} tokens, not the forced {n} "
                                   "(does it honour ignore_eos and min_tokens?)")
        end = max(r.last_token for r in reqs)
        result = RunResult(plan.scenario, plan.concurrency, run, plan.input_len, plan.output_len, t0, end, reqs,
                           side="client", range_ratio=plan.range_ratio, request_rate=plan.request_rate,
                           spec=spec_from_server(before, after))
        if work.images is not None:
            result.images = plan.images.describe()
        return result

    # -- the prefix-cache scenarios: a RequestSource with C requests in flight -------------------------------------
    async def _server_counters(self) -> Optional[dict[str, float]]:
        """The prefix-cache hit and speculation counters of GET /metrics; None when the server has no /metrics."""
        try:
            r = await self.client.get("/metrics")
            r.raise_for_status()
        except Exception:  # noqa: BLE001 - no counters: the hit rate is then unknown, not an error
            return None
        return parse_counters(r.text, HIT_COUNTERS + (EXTERNAL_HIT_COUNTER,) + tuple(SPEC_COUNTERS.values()))

    async def _run_source(self, plan: Plan, run: str, source: RequestSource) -> RunResult:
        """C workers each send the source's next request as soon as theirs ends (a multi-turn conversation's next
        turn waits for its answer: a worker with none ready waits for another's to end; a request with an arrival
        time waits for it)."""
        before = await self._server_counters()
        ready = asyncio.Condition()
        done: list[tuple[RequestTiming, Optional[int]]] = []
        t0 = time.monotonic()

        async def worker() -> None:
            while True:
                async with ready:
                    req = source.next()
                    while req is None and not source.exhausted:
                        await ready.wait()
                        req = source.next()
                if req is None:
                    return
                if req.not_before is not None:  # (--request-rate: not before its arrival time)
                    await asyncio.sleep(max(0.0, t0 + req.not_before - time.monotonic()))
                body = self.payload(req.prompt, req.output_len, self.sampling_seed + req.seed)
                if source.wants_answers:
                    body["return_token_ids"] = True
                sent = time.monotonic()
                got = await self._stream(body)
                if len(got.times) != req.output_len:
                    raise RuntimeError(f"the server made {len(got.times)} tokens, not the forced {req.output_len} "
                                       "(does it honour ignore_eos and min_tokens?)")
                if source.wants_answers and len(got.token_ids) != req.output_len:
                    raise RuntimeError(f"the server returned {len(got.token_ids)} token ids for {req.output_len} "
                                       "tokens: a multi-turn conversation resends them (request field "
                                       "return_token_ids)")
                timing = RequestTiming(prompt_tokens=len(req.prompt), output_tokens=len(got.times), arrival=sent,
                                       first_token=got.times[0], last_token=got.times[-1], token_times=got.times,
                                       cached_tokens=got.cached_tokens or 0, index=req.index, group=req.group,
                                       turn=req.turn)
                done.append((timing, got.cached_tokens))
                async with ready:
                    source.done(req, got.token_ids)
                    ready.notify_all()

        try:
            async with asyncio.TaskGroup() as tasks:  # (one failing cancels the others)
                for _ in range(plan.concurrency):
                    tasks.create_task(worker())
        except ExceptionGroup as group:  # the first client's error, as the other scenarios raise theirs
            raise group.exceptions[0] from None
        after = await self._server_counters()
        reqs = sorted((t for t, _ in done), key=lambda t: t.index)
        result = RunResult(plan.scenario, plan.concurrency, run, plan.input_len, plan.output_len, t0,
                           max(r.last_token for r in reqs), reqs, side="client", workload=plan.workload(),
                           range_ratio=plan.range_ratio, request_rate=plan.request_rate,
                           spec=spec_from_server(before, after))
        _cache_hits_from_server(result, [c for _, c in done], before, after)
        return result


def spec_from_server(before: Optional[dict], after: Optional[dict]) -> Optional[dict]:
    """The speculation counters' growth over a run (bench/metrics.spec_delta's form), from /metrics read before and
    after it; None for a server that does not speculate (or exports no counters). Other clients' requests in the
    meantime count too, as for the cache counters."""
    if before is None or after is None or not all(name in after for name in SPEC_COUNTERS.values()):
        return None
    return {key: int(after[name] - before.get(name, 0.0)) for key, name in SPEC_COUNTERS.items()}


def _cache_hits_from_server(result: RunResult, reported: list[Optional[int]], before: Optional[dict],
                            after: Optional[dict]) -> None:
    """The run's cache hits: each request's usage cached_tokens where the server reports them (vLLM with
    --enable-prompt-tokens-details; it leaves out a count of 0, so one request's count is enough to read the others'
    absence as 0), else the /metrics counters' growth over the run (GPU pool + CPU tier); the CPU tier's share from
    /metrics where the server exports it."""
    def grew(name: str) -> Optional[float]:
        if before is None or after is None or name not in after:
            return None
        return after[name] - before.get(name, 0.0)

    gpu = next((g for g in (grew(n) for n in HIT_COUNTERS) if g is not None), None)
    ext = grew(EXTERNAL_HIT_COUNTER)
    result.external_cache_hit_tokens = int(ext) if ext is not None else None
    if any(c is not None for c in reported):
        result.cache_hits_source = "requests"
    elif gpu is not None:
        result.cache_hits_source, result.cache_hit_tokens = "metrics", int(gpu + (ext or 0.0))
    else:
        result.cache_hits_source = "none"
