"""--tool-call-parser hermes streaming over HTTP with the openai client: a tiny random llama served with
--enable-auto-tool-choice, --reasoning-parser qwen3 and grammars over the reasoning too (--structured-outputs-config
enable_in_reasoning), its output forced through a structured-outputs `choice` of one string beside tool_choice
"auto" (as test_llama_tools_server.py does), so the test knows what the model "wrote": reasoning, text, then two
hermes calls, the tags split over several tokens. The stream sends each call's name first, then its arguments in
pieces that add up to the non-streamed answer's."""
from __future__ import annotations

import json

import openai
import pytest

from server_helpers import ServerProc, free_port
from tiny_models import make_model

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "array"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
OUTPUT = ('<think>\nThe user wants {"weather"} and the time.\n</think>\n\nChecking both.<tool_call>\n'
          '{"name": "get_weather", "arguments": {"city": "Paris}", "days": [1, 2.50]}}\n</tool_call>\n<tool_call>\n'
          '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>')
ARGUMENTS = ['{"city": "Paris}", "days": [1, 2.5]}', '{"tz": "Europe/Paris"}']


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = make_model(str(tmp_path_factory.mktemp("tiny_hermes")), "llama")
    srv = ServerProc([path, "--device", "cpu", "--block-size", "4", "--served-model-name", "tiny",
                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                      "--structured-outputs-config", '{"enable_in_reasoning": true}',
                      "--disable-log-stats", "--disable-uvicorn-access-log"], free_port(), env={"OMP_NUM_THREADS": "1"})
    try:
        srv.wait_healthy(180)
        yield openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0, timeout=120)
    finally:
        srv.stop()


def _chat(client, **kw):
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather and time in Paris?"}], tools=TOOLS,
        max_tokens=400, temperature=0, extra_body={"structured_outputs": {"choice": [OUTPUT]}}, **kw)


def test_hermes_calls_stream_name_first_then_argument_pieces(client):
    choice = _chat(client).choices[0]
    message = choice.message
    assert message.model_extra["reasoning_content"] == 'The user wants {"weather"} and the time.\n'
    assert message.content == "Checking both." and choice.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == \
        list(zip(["get_weather", "get_time"], ARGUMENTS))

    reasoning, content, pieces, finish = "", "", {}, None
    for chunk in _chat(client, stream=True):
        for ch in chunk.choices:
            reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                pieces.setdefault(d.index, []).append(d)
            finish = ch.finish_reason or finish
    assert reasoning == message.model_extra["reasoning_content"] and content == message.content
    assert finish == "tool_calls" and sorted(pieces) == [0, 1]
    for k, call in enumerate(message.tool_calls):
        first, rest = pieces[k][0], pieces[k][1:]
        assert first.id.startswith("call_") and first.type == "function"
        assert first.function.name == call.function.name and first.function.arguments == ""  # the name alone
        assert len(rest) > 3 and all(d.id is None and d.function.name is None for d in rest)  # then the arguments
        assert "".join(d.function.arguments for d in pieces[k]) == call.function.arguments
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris}", "days": [1, 2.5]}
