"""Runner against a running OpenAI-compatible server (`--base-url`): streaming /v1/completions.

Each request sends its prompt as token ids, forces its length (ignore_eos, min_tokens = max_tokens) and
asks for usage in every chunk (stream_options.continuous_usage_stats), so each chunk tells how many tokens
it carries even when the server merges tokens (partial UTF-8). Times are client-side: TTFT = first chunk
with tokens - send; decode time = last token chunk - first. The server must stream text per token (start
it with a tokenizer); a server without continuous usage stats is counted one token per text chunk, with
the remainder from the final usage put on the last chunk.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Optional

from voltllm.bench.inprocess import Plan, Workload
from voltllm.bench.metrics import RequestTiming, RunResult

logger = logging.getLogger("voltllm.bench")


class ClientRunner:
    def __init__(self, base_url: str, model: Optional[str] = None, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = -1, sampling_seed: int = 0, api_key: Optional[str] = None,
                 transport: Any = None):
        try:
            import httpx
        except ImportError as e:  # httpx ships with the test extras
            raise RuntimeError("--base-url needs the httpx package (pip install httpx)") from e
        self.base_url = base_url.rstrip("/")
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.sampling_seed = sampling_seed
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

    async def _one(self, body: dict, t_send: float) -> RequestTiming:
        times: list[float] = []
        final_total: Optional[int] = None
        async with self.client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise RuntimeError(f"POST /v1/completions -> {resp.status_code}: {text[:500]}")
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
                    continue
                if total is not None:
                    k = total - len(times)
                else:
                    k = 1 if choices[0].get("text") else 0
                times.extend([now] * max(k, 0))
        if final_total is not None and final_total > len(times) and times:
            times.extend([times[-1]] * (final_total - len(times)))
        if not times:
            raise RuntimeError("the server streamed no tokens (does it stream text? start it with a tokenizer)")
        return RequestTiming(prompt_tokens=len(body["prompt"]), output_tokens=len(times), arrival=t_send,
                             first_token=times[0], last_token=times[-1], token_times=times)

    async def _sent_at(self, body: dict, at: float) -> RequestTiming:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        return await self._one(body, at)

    async def _batch(self, bodies: list[dict], offsets: list[float]) -> tuple[float, list[RequestTiming], float]:
        t0 = time.monotonic()
        reqs = await asyncio.gather(*(self._sent_at(b, t0 + dt) for b, dt in zip(bodies, offsets)))
        return t0, list(reqs), time.monotonic()

    def __call__(self, plan: Plan, run: str, work: Workload) -> RunResult:
        bodies = [self.payload(p, n, self.sampling_seed + i)
                  for i, (p, n) in enumerate(zip(work.prompts, work.output_lens))]
        offsets = [work.arrival(i) for i in range(len(bodies))]
        t0, reqs, _ = self.loop.run_until_complete(self._batch(bodies, offsets))
        for r, n in zip(reqs, work.output_lens):
            if r.output_tokens != n:
                raise RuntimeError(f"the server made {r.output_tokens} tokens, not the forced {n} "
                                   "(does it honour ignore_eos and min_tokens?)")
        end = max(r.last_token for r in reqs)
        return RunResult(plan.scenario, plan.concurrency, run, plan.input_len, plan.output_len, t0, end, reqs,
                         side="client", range_ratio=plan.range_ratio, request_rate=plan.request_rate)
