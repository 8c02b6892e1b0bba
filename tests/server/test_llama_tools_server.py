"""--tool-call-parser llama3_json and pythonic over HTTP with the openai client: a tiny random llama served with
--enable-auto-tool-choice and a Llama-3.1-style chat template (tools in the system turn, assistant calls as JSON,
results as ipython turns), once per parser. The random model's output is forced through structured outputs (a
`choice` of one string, beside tool_choice "auto"), so each test knows what the model "wrote": calls with text
before them, several calls, malformed output as content, streamed and not; tool_choice none / named / required; the
template getting the tools and a tool round trip."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from server_helpers import ServerProc, free_port
from tiny_models import make_model

LLAMA31_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\n"
    "{% if tools is not none %}Environment: ipython\n{% endif %}"
    "{{ system_message }}"
    "{%- if tools is not none %}\nTo call a function, respond with JSON in the format "
    "{\"name\": function name, \"parameters\": dictionary of argument name and its value}.\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}{%- endif %}<|eot_id|>"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' and m['tool_calls'] %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for tc in m['tool_calls'] %}{\"name\": \"{{ tc['function']['name'] }}\", \"parameters\": "
    "{{ tc['function']['arguments'] | tojson }}}{%- endfor %}<|eom_id|>"
    "{%- elif m['role'] == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "current weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 3}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, TIME]

# what each parser's model writes: calls with text before them, two calls, and a malformed call
OUTPUTS = {
    "llama3_json": {
        "text_then_call": 'Let me check. {"name": "get_weather", "parameters": {"city": "Par", "unit": "c"}}',
        "two_calls": '{"name": "get_weather", "parameters": {"city": "Par", "unit": "c"}}; '
                     '{"name": "get_time", "parameters": {}}',
        "malformed": '{"name": "get_weather", "parameters": {"city": "Par", }}',
    },
    "pythonic": {
        "text_then_call": "Let me check. [get_weather(city='Par', unit='c')]",
        "two_calls": "[get_weather(city='Par', unit='c'), get_time()]",
        "malformed": "[get_weather('Par', unit='c')]",
    },
}


@pytest.fixture(scope="module", params=["llama3_json", "pythonic"])
def served(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama_tools")
    path = make_model(str(d), "llama")
    template = d / "template.jinja"
    template.write_text(LLAMA31_TEMPLATE)
    srv = ServerProc([path, "--device", "cpu", "--block-size", "4", "--served-model-name", "tiny",
                      "--chat-template", str(template), "--enable-auto-tool-choice", "--tool-call-parser",
                      request.param, "--disable-log-stats", "--disable-uvicorn-access-log"], free_port(),
                     env={"OMP_NUM_THREADS": "1"})
    try:
        srv.wait_healthy(180)
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0, timeout=120)
        yield request.param, srv, client
    finally:
        srv.stop()


def _chat(client, forced_output=None, **kw):
    kw.setdefault("max_tokens", 200)
    kw.setdefault("temperature", 0)
    kw.setdefault("tools", TOOLS)
    if forced_output is not None:
        kw["extra_body"] = {"structured_outputs": {"choice": [forced_output]}}
    return client.chat.completions.create(model="tiny", messages=kw.pop("messages", MESSAGES), **kw)


def _streamed(client, forced_output: str, **kw):
    """(content, [(name, arguments)], finish_reason) as the stream's deltas build them; each call comes whole."""
    content, calls, finish = "", [], None
    for chunk in _chat(client, forced_output, stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                assert d.index == len(calls) and d.id.startswith("call_") and d.type == "function", d
                calls.append((d.function.name, d.function.arguments))
            finish = ch.finish_reason or finish
    return content, calls, finish


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def test_template_gets_the_tools(served):
    _, srv, _ = served
    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS}
    ids = httpx.post(srv.base + "/tokenize", json=body, timeout=60).json()["tokens"]
    prompt = httpx.post(srv.base + "/detokenize", json={"model": "tiny", "tokens": ids}, timeout=60).json()["prompt"]
    assert "Environment: ipython" in prompt and json.dumps(WEATHER["function"]["parameters"]) in prompt, prompt
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize("case, content, names", [
    ("text_then_call", "Let me check. ", ["get_weather"]),
    ("two_calls", None, ["get_weather", "get_time"]),
])
def test_auto_calls_streamed_and_not(served, case, content, names):
    parser, _, client = served
    output = OUTPUTS[parser][case]
    choice = _chat(client, output).choices[0]
    assert choice.message.content == content
    assert [name for name, _ in _calls(choice.message)] == names
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Par", "unit": "c"}
    if len(names) > 1:
        assert json.loads(choice.message.tool_calls[1].function.arguments) == {}
    assert choice.finish_reason == "tool_calls"
    assert _streamed(client, output) == (content or "", _calls(choice.message), "tool_calls")


def test_malformed_output_is_content(served):
    parser, _, client = served
    output = OUTPUTS[parser]["malformed"]
    choice = _chat(client, output).choices[0]
    assert choice.message.content == output and not choice.message.tool_calls and choice.finish_reason == "stop"
    assert _streamed(client, output) == (output, [], "stop")


def test_tool_choice_none_leaves_calls_as_text(served):
    parser, _, client = served
    output = OUTPUTS[parser]["two_calls"]
    choice = _chat(client, output, tool_choice="none").choices[0]
    assert choice.message.content == output and not choice.message.tool_calls and choice.finish_reason == "stop"


def test_named_and_required_need_no_parser(served):
    """As with hermes: the output is constrained to the tools' schemas (structured outputs)."""
    _, _, client = served
    [call] = _chat(client, tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0] \
        .message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
    choice = _chat(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).choices[0]
    assert [name for name, _ in _calls(choice.message)] == ["get_weather"] and choice.finish_reason == "tool_calls"


def test_tool_round_trip(served):
    """An assistant turn with a call (arguments as JSON text) and its result go back through the template."""
    parser, srv, client = served
    first = _chat(client, OUTPUTS[parser]["text_then_call"]).choices[0].message
    call = first.tool_calls[0]
    messages = MESSAGES + [
        {"role": "assistant", "content": first.content, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                            "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    body = {"model": "tiny", "messages": messages, "tools": TOOLS}
    ids = httpx.post(srv.base + "/tokenize", json=body, timeout=60).json()["tokens"]
    prompt = httpx.post(srv.base + "/detokenize", json={"model": "tiny", "tokens": ids}, timeout=60).json()["prompt"]
    assert ('assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Par", "unit": "c"}}'
            '<|eom_id|><|start_header_id|>ipython<|end_header_id|>\n\n{"temperature": 21}<|eot_id|>') in prompt, prompt
    out = _chat(client, "It is 21 degrees.", messages=messages)
    assert out.choices[0].message.content == "It is 21 degrees." and not out.choices[0].message.tool_calls
