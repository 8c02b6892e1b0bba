"""A model's text through serving_chat without an engine: stand-in engine outputs cut into pieces, the SSE chunks
the stream makes of them and the JSON body of the whole text (tool-call and reasoning parser tests)."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Optional

TWO_TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n in ("get_weather", "get_time")]


def chat_pieces(text: str, step: int, tools: list = TWO_TOOLS, parser: str = "hermes",
                reasoning: Optional[str] = None, prompt: str = "prompt") -> tuple[list, dict]:
    """(the SSE chunks as dicts, the non-streamed JSON body) of `text` streamed `step` characters at a time."""
    from voltllm.engine.outputs import CompletionOutput, RequestOutput
    from voltllm.entrypoints.openai.protocol import ChatCompletionRequest
    from voltllm.entrypoints.openai.serving_chat import ChatPlan, _full_response, _stream
    from voltllm.entrypoints.openai.serving_common import ServerState

    outs = []
    for end in list(range(step, len(text), step)) + [len(text)]:
        c = CompletionOutput(0, text[:end], list(range(end)), finish_reason="stop" if end == len(text) else None)
        outs.append(RequestOutput("chatcmpl-1", None, [1, 2], [c], end == len(text)))

    class Stream:
        async def __aiter__(self):
            for o in outs:
                yield o

        def close(self):
            pass

    state = ServerState(engine=SimpleNamespace(tokenizer=None), served_model_names=["m"], max_model_len=64,
                        model_path="m", tool_call_parser=parser, enable_auto_tool_choice=True,
                        reasoning_parser=reasoning)
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools, stream=True)
    plan = ChatPlan("chatcmpl-1", "m", 1, prompt, True, None, 1, None)

    async def go():
        return [e async for e in _stream(state, req, plan, [Stream()])]
    chunks = [json.loads(e[len("data: "):]) for e in asyncio.run(go())]
    return chunks, _full_response(state, req, plan, outs[-1])
