"""The Anthropic Messages API's pieces without a server: the translation of requests into chat requests, the
output shaping (content blocks, stop reasons, usage) and the streamed block events fed with fixed model text
through the chat path's parsers (qwen3 reasoning, hermes tools, forced tool choice), the refusals, and the
API-key middleware on /v1/messages (x-api-key, Anthropic's 401 body)."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from tiny_models import CHATML

from voltllm.engine.outputs import CompletionOutput, RequestOutput
from voltllm.entrypoints.openai.app import AuthAndCountMiddleware
from voltllm.entrypoints.openai.errors import OpenAIError
from voltllm.entrypoints.openai.messages_errors import anthropic_error_body, anthropic_sse_error, is_messages_path
from voltllm.entrypoints.openai.messages_protocol import CountTokensRequest, MessagesRequest
from voltllm.entrypoints.openai.serving_chat import ChatPlan, ChoiceView
from voltllm.entrypoints.openai.serving_messages import (BlockStreamer, content_blocks, message_usage, stop_reason,
                                                         tool_input)
from voltllm.entrypoints.openai.tool_choice import forced_tool_choice

WEATHER = {"name": "get_weather", "description": "current weather",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
PING = {"name": "ping", "input_schema": {"type": "object"}}


def _req(**kw) -> MessagesRequest:
    kw.setdefault("model", "m")
    kw.setdefault("max_tokens", 16)
    kw.setdefault("messages", [{"role": "user", "content": "hi"}])
    return MessagesRequest.model_validate(kw)


# -- translation --------------------------------------------------------------------------------------
def test_conversation_with_tools_becomes_chat_messages():
    req = _req(system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
                       {"type": "text", "text": "Use tools."}],
               messages=[
                   {"role": "user", "content": [{"type": "text", "text": "Weather in Paris"},
                                                {"type": "text", "text": "and Rome?"}]},
                   {"role": "assistant", "content": [
                       {"type": "thinking", "thinking": "I should call the tool", "signature": "x"},
                       {"type": "text", "text": "Checking."},
                       {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                       {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}]},
                   {"role": "user", "content": [
                       {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                       {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                        "content": [{"type": "text", "text": "timeout"}]},
                       {"type": "text", "text": "Summarize."}]},
               ], tools=[WEATHER])
    assert req.chat_messages() == [
        {"role": "system", "content": "Be brief.\nUse tools."},
        {"role": "user", "content": "Weather in Paris\nand Rome?"},
        {"role": "assistant", "content": "Checking.", "reasoning": "I should call the tool", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout", "name": "get_weather"},
        {"role": "user", "content": "Summarize."},
    ]
    chat = req.chat_request()
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather", "description": "current weather",
                                                            "parameters": WEATHER["input_schema"]}}]
    assert chat.add_generation_prompt and not chat.continue_final_message


def test_sampling_fields_and_prefill():
    req = _req(messages=[{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi"}],
               stop_sequences=["\n\n", "END"], temperature=0.2, top_p=0.9, top_k=5, metadata={"user_id": "u"})
    chat = req.chat_request()
    params = chat.sampling_params(req.max_tokens, None)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (16, 0.2, 0.9, 5)
    assert list(params.stop) == ["\n\n", "END"]
    assert chat.continue_final_message and not chat.add_generation_prompt  # the last assistant turn is a prefill


def test_tool_choice_and_thinking_mapping():
    tools = [WEATHER, PING]
    assert _req(tools=tools, tool_choice={"type": "auto"}).chat_tool_choice() == ("auto", True)
    assert _req(tools=tools, tool_choice={"type": "none"}).chat_tool_choice() == ("none", True)
    assert _req(tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True}
                ).chat_tool_choice() == ("required", False)
    named = _req(tools=tools, tool_choice={"type": "tool", "name": "ping"}).chat_request()
    forced = forced_tool_choice(named.tools, named.tool_choice, named.parallel_tool_calls)
    assert (forced.mode, forced.name) == ("named", "ping")
    required = _req(tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True}).chat_request()
    forced = forced_tool_choice(required.tools, required.tool_choice, required.parallel_tool_calls)
    assert forced.mode == "required" and forced.schema["maxItems"] == 1
    assert _req().template_kwargs() is None
    assert _req(thinking={"type": "enabled", "budget_tokens": 2048}).chat_request().chat_template_kwargs == {
        "enable_thinking": True}
    assert _req(thinking={"type": "disabled"}).template_kwargs() == {"enable_thinking": False}


def test_thinking_budget_tokens_caps_the_reasoning_when_the_server_can():
    """thinking.budget_tokens becomes thinking_token_budget on a server that knows the reasoning's delimiters; without
    them it is ignored (Claude Code sends it on every request); a budget that is no positive integer is a 400."""
    enabled = {"type": "enabled", "budget_tokens": 2048}
    assert _req(thinking=enabled).chat_request(thinking_budgets=True).thinking_token_budget == 2048
    assert _req(thinking=enabled).chat_request().thinking_token_budget is None
    assert _req(thinking={"type": "disabled"}).chat_request(thinking_budgets=True).thinking_token_budget is None
    assert _req(thinking={"type": "adaptive"}).chat_request(thinking_budgets=True).thinking_token_budget is None
    for bad in (0, -5, "2048", 1.5, True):
        with pytest.raises(OpenAIError, match="thinking.budget_tokens must be a positive integer"):
            _req(thinking={"type": "enabled", "budget_tokens": bad}).chat_request(thinking_budgets=True)


@pytest.mark.parametrize("kw, param, words", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}]},
     "messages", "image"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages", "document"),
    ({"messages": [{"role": "ctx", "content": "x"}]}, "messages", "role"),  # vLLM maps no other role either
    ({"messages": [{"role": "system", "content": "x"}]}, "messages", "no content"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "tool_reference"}]}]}]}, "messages", "tool_name"),
    ({"thinking": {"type": "adaptive", "display": "full"}}, "thinking", "display"),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort", "effort"),
    ({"output_config": {"format": {"type": "xml"}}}, "output_config.format", "json_schema"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format", "schema"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}}, "output_config.format",
     "schema"),
    ({"output_format": {"type": "json_schema", "schema": {"type": "object"}}, "output_config": {"effort": "high"}},
     "output_format", "once"),
    ({"tools": [WEATHER], "tool_choice": {"type": "any"},
      "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "output_config.format",
     "tool_choice"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools", "server tools"),
    ({"tools": [{"name": "f"}]}, "tools", "input_schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "sometimes"}}, "tool_choice", "tool_choice"),
    ({"thinking": {"type": "maybe"}}, "thinking", "thinking"),
    ({"messages": [{"role": "user", "content": []}]}, "messages", "no content"),
])
def test_refusals_in_translation(kw, param, words):
    with pytest.raises(OpenAIError) as e:
        _req(**kw).chat_request()
    assert e.value.status == 400 and e.value.param == param and words in e.value.message


@pytest.mark.parametrize("kw, param", [({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]},
                                        "mcp_servers"), ({"container": "c1"}, "container"), ({"messages": []},
                                                                                             "messages")])
def test_refused_fields(kw, param):
    with pytest.raises(OpenAIError) as e:
        _req(**kw).check()
    assert e.value.status == 400 and e.value.param == param


# -- Claude Code's newer request shapes (as vLLM serves them) ---------------------------------------------
def test_system_messages_open_or_stay_in_place():
    top = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.160; cch=1;"},
           {"type": "text", "text": "Top."}]
    req = _req(system=top, messages=[
        {"role": "system", "content": "Lead."},
        {"role": "user", "content": "Q"},
        {"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1;"},
                                       {"type": "text", "text": "Inline."}]},
        {"role": "system", "content": "x-anthropic-billing-header: only"}])
    expected_tail = [{"role": "user", "content": "Q"}]
    assert req.chat_messages() == [{"role": "system", "content": "Top.\n\nLead."}, *expected_tail,
                                   {"role": "system", "content": "Inline."}]
    assert req.chat_messages("fold") == [{"role": "system", "content": "Top.\n\nLead."},
                                         {"role": "user", "content": "Q\n\nInline."}]
    # "preserve" folds too without any system text (vLLM: templates may render the tools at the first system turn)
    bare = _req(messages=[{"role": "user", "content": "Q"}, {"role": "system", "content": "S"}])
    assert bare.chat_messages() == [{"role": "user", "content": "Q\n\nS"}]
    assert bare.chat_request().add_generation_prompt


def test_folded_system_messages_keep_tool_runs_whole():
    call = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "18 C"}]}
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": [call]},
                {"role": "system", "content": "S1"},  # between the call and its result: moves after the result
                {"role": "user", "content": [result]}, {"role": "system", "content": "S2"},
                {"role": "assistant", "content": "A"}, {"role": "system", "content": "S3"},
                {"role": "user", "content": [{"type": "text", "text": "Q2"}]}, {"role": "system", "content": "S4"},
                {"role": "assistant", "content": "B"}]
    head = [{"role": "system", "content": "Top."}, {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}]
    tool = {"role": "tool", "tool_call_id": "t1", "name": "get_weather"}
    req = _req(system="Top.", messages=messages)
    assert req.chat_messages("fold") == [
        *head, {**tool, "content": "18 C\n\nS1\n\nS2"}, {"role": "assistant", "content": "A"},
        {"role": "user", "content": "S3\n\nQ2\n\nS4"}, {"role": "assistant", "content": "B"}]
    assert req.chat_messages("preserve") == [
        *head, {**tool, "content": "18 C"}, {"role": "system", "content": "S1"}, {"role": "system", "content": "S2"},
        {"role": "assistant", "content": "A"}, {"role": "system", "content": "S3"}, {"role": "user", "content": "Q2"},
        {"role": "system", "content": "S4"}, {"role": "assistant", "content": "B"}]
    assert req.chat_request("fold").continue_final_message  # the last assistant turn stays a prefill


def test_tool_reference_results_deferred_tools_and_adaptive_thinking():
    search = {"name": "ToolSearch", "input_schema": {"type": "object"}}
    deferred = {**WEATHER, "defer_loading": True}
    req = _req(tools=[search, deferred], tool_choice={"type": "none"}, thinking={"type": "adaptive",
                                                                                  "display": "omitted"},
               output_config={"effort": "high"}, messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch",
                                           "input": {"query": "select:get_weather"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "Loaded."}, {"type": "tool_reference", "tool_name": "get_weather"}]}]}])
    chat = req.chat_request()
    assert chat.messages[-2:] == [
        {"role": "tool", "tool_call_id": "t1", "content": "Loaded.", "name": "ToolSearch"},
        {"role": "tool", "tool_call_id": "t1", "name": "ToolSearch",
         "content": '[{"type": "tool_reference", "name": "get_weather"}]'}]
    assert [t["function"].get("defer_loading") for t in chat.tools] == [None, True]
    # adaptive pins nothing (the template's default, as vLLM does); the effort reaches the template
    assert chat.chat_template_kwargs == {"reasoning_effort": "high"}
    assert _req(thinking={"type": "adaptive"}).template_kwargs() is None
    assert _req(thinking={"type": "disabled"}, output_config={"effort": "low"}).template_kwargs() == {
        "enable_thinking": False}  # disabled wins over the effort, as in vLLM
    assert chat.constraint() is None


def test_output_config_format_is_a_json_schema_constraint():
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    for body in ({"output_config": {"format": {"type": "json_schema", "schema": schema}, "effort": "low"}},
                 {"output_format": {"type": "json_schema", "schema": schema}}):
        chat = _req(**body).chat_request()
        assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
        chat.check()
        params = chat.sampling_params(16, None)
        assert params.structured_outputs.kind == "json" and params.structured_outputs.json == schema
    # with tools the model may still call ("auto" / "none") the format applies as in chat
    assert _req(tools=[WEATHER], tool_choice={"type": "none"},
                output_config={"format": {"type": "json_schema", "schema": schema}}).chat_request().constraint()
    assert _req(output_config={"effort": "max"}).chat_request().response_format is None


_TURN = "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
_GEN = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


@pytest.mark.parametrize("template, mode, why", [
    (CHATML, "preserve", "system turns of their own"),
    ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}{{ raise_exception('System message "
     "must be at the beginning.') }}{% endif %}" + _TURN + "{% endfor %}" + _GEN, "fold", "refuses"),  # Qwen3.5's
    ("{% for m in messages %}{% if m['role'] != 'system' or loop.first %}" + _TURN + "{% endif %}{% endfor %}"
     + _GEN, "fold", "drops"),
    ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}<|im_start|>user\n{{ m['content'] }}"
     "<|im_end|>\n{% else %}" + _TURN + "{% endif %}{% endfor %}" + _GEN, "fold", "user message"),
    ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}{{ m['content'] }}{% else %}" + _TURN
     + "{% endif %}{% endfor %}" + _GEN, "fold", "role marker"),
])
def test_inline_system_probe(tmp_path, template, mode, why):
    from tiny_models import make_tokenizer

    from voltllm.entrypoints.openai.messages_system_probe import inline_system_mode, probe
    from voltllm.entrypoints.openai.serving_common import ServerState

    state = ServerState(engine=SimpleNamespace(tokenizer=make_tokenizer(str(tmp_path))), served_model_names=["m"],
                        max_model_len=256, model_path=str(tmp_path), chat_template=template)
    found, reason = probe(state)
    assert found == mode and why in reason, reason
    assert inline_system_mode(state) == mode


def test_count_tokens_body_needs_no_max_tokens():
    req = CountTokensRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    req.check()
    assert req.chat_request().max_tokens is None
    with pytest.raises(Exception):
        MessagesRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(Exception):
        _req(max_tokens=0)


# -- output shaping -----------------------------------------------------------------------------------
def _state(**kw):
    base = dict(reasoning_parser=None, tool_call_parser=None, enable_prompt_tokens_details=False,
                grammar_after_reasoning=False, reasoning_delimiters=None)
    base.update(kw)
    return SimpleNamespace(**base)


def _plan(prompt="", use_tools=False, forced=None):
    return ChatPlan("msg_x", "m", 0, prompt, use_tools, forced, 1, None)


def _chat_tools(*tools):
    return _req(tools=list(tools)).chat_tools()


MODEL_TEXT = ('<think>The user wants weather.</think>Let me check.'
              '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')


def test_blocks_from_reasoning_text_and_auto_tool_call():
    state = _state(reasoning_parser="qwen3", tool_call_parser="hermes")
    tools = _chat_tools(WEATHER)
    reasoning, text, calls = ChoiceView(state, _plan(use_tools=True), tools, streaming=False).view(MODEL_TEXT, True)
    blocks = content_blocks(reasoning, text, calls)
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    assert blocks[0] == {"type": "thinking", "thinking": "The user wants weather.", "signature": ""}
    assert blocks[1] == {"type": "text", "text": "Let me check."}
    assert blocks[2]["name"] == "get_weather" and blocks[2]["input"] == {"city": "Paris"}
    assert blocks[2]["id"].startswith("toolu_") and len(blocks[2]["id"]) > 10
    assert stop_reason(CompletionOutput(0, MODEL_TEXT, [1], finish_reason="stop"), True) == ("tool_use", None)


def _stream(state, plan, tools, text, step=3):
    """Feed text's growing prefixes through the chat view and the block streamer, as a stream would."""
    view = ChoiceView(state, plan, tools, streaming=True)
    streamer = BlockStreamer()
    events = []
    for end in list(range(step, len(text), step)) + [len(text)]:
        events += streamer.update(*view.view(text[:end], end == len(text)))
    return events + streamer.close()


def _replay(events):
    """Rebuild the blocks from start/delta/stop events, checking their order and indices."""
    blocks, open_index = [], None
    for name, data in events:
        assert data["type"] == name
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(blocks)
            open_index = data["index"]
            blocks.append(dict(data["content_block"], _json=""))
        elif name == "content_block_delta":
            assert data["index"] == open_index
            d, b = data["delta"], blocks[open_index]
            kind = {"thinking_delta": "thinking", "text_delta": "text", "input_json_delta": "tool_use"}[d["type"]]
            assert b["type"] == kind
            if kind == "tool_use":
                b["_json"] += d["partial_json"]
            else:
                b[kind] += d[kind]
        else:
            assert name == "content_block_stop" and data["index"] == open_index
            open_index = None
    assert open_index is None
    for b in blocks:
        if b["type"] == "tool_use":
            assert b["input"] == {}
            b["input"] = json.loads(b["_json"])
        del b["_json"]
    return blocks


@pytest.mark.parametrize("step", [1, 3, 17])
def test_streamed_blocks_add_up_to_the_whole(step):
    state = _state(reasoning_parser="qwen3", tool_call_parser="hermes")
    tools = _chat_tools(WEATHER)
    events = _stream(state, _plan(use_tools=True), tools, MODEL_TEXT, step)
    blocks = _replay(events)
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    assert blocks[0]["thinking"] == "The user wants weather." and blocks[1]["text"] == "Let me check."
    assert blocks[2]["name"] == "get_weather" and blocks[2]["input"] == {"city": "Paris"}
    # no tag text leaks into a delta
    assert not any("<" in json.dumps(d["delta"]) for n, d in events if n == "content_block_delta"
                   and d["delta"]["type"] != "input_json_delta")


def test_qwen3_coder_call_opened_in_the_thinking_streams_its_input_per_parameter():
    """Qwen3.5's call before "</think>" is a tool_use block (the reasoning ends at it), whose input_json_delta pieces
    come a parameter at a time and add up to the input."""
    state = _state(reasoning_parser="qwen3", tool_call_parser="qwen3_coder")
    text = ("Need weather.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=unit>\nC\n</parameter>\n</function>\n</tool_call>")
    events = _stream(state, _plan(prompt="<|im_start|>assistant\n<think>\n", use_tools=True),
                     _chat_tools(WEATHER), text, step=1)
    blocks = _replay(events)
    assert [b["type"] for b in blocks] == ["thinking", "tool_use"] and blocks[0]["thinking"] == "Need weather.\n"
    assert blocks[1]["name"] == "get_weather" and blocks[1]["input"] == {"city": "Paris", "unit": "C"}
    pieces = [d["delta"]["partial_json"] for n, d in events
              if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    assert pieces == ["{", '"city": "Paris"', ', "unit": "C"', "}"]


def test_thinking_blocks_of_earlier_turns_reach_the_template():
    """As vLLM: an assistant turn's thinking blocks become its `reasoning` (joined), redacted_thinking is dropped;
    the template gets it as reasoning_content (Qwen3's templates render it for turns after the last user query)."""
    from voltllm.entrypoints.openai.serving_common import normalize_messages

    req = _req(messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Call the tool. ", "signature": "s1"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "thinking", "thinking": "With Paris.", "signature": "s2"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}]}],
        tools=[WEATHER])
    assistant = req.chat_messages()[1]
    assert assistant["reasoning"] == "Call the tool. With Paris."
    assert normalize_messages(req.chat_messages())[1]["reasoning_content"] == "Call the tool. With Paris."
    only_redacted = _req(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": "ok"}]},
        {"role": "user", "content": "y"}])
    assert "reasoning" not in only_redacted.chat_messages()[1]
    with pytest.raises(OpenAIError) as e:
        _req(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": [
            {"type": "thinking", "thinking": 5}]}]).chat_messages()
    assert "thinking must be a string" in e.value.message


def test_prompt_opened_thinking_and_plain_text():
    state = _state(reasoning_parser="qwen3")
    events = _stream(state, _plan(prompt="<|im_start|>assistant\n<think>\n"), None, "hmm, 2+2\n</think>\n\nIt is 4.")
    assert _replay(events) == [{"type": "thinking", "thinking": "hmm, 2+2\n", "signature": ""},
                               {"type": "text", "text": "It is 4."}]
    assert _replay(_stream(_state(), _plan(), None, "just text")) == [{"type": "text", "text": "just text"}]
    assert _stream(_state(), _plan(), None, "") == []


def test_forced_required_calls_stream_as_growing_input_json():
    tools = _chat_tools(WEATHER, PING)
    forced = forced_tool_choice(tools, "required", True)
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "ping", "parameters": {}}]'
    events = _stream(_state(reasoning_parser="qwen3"), _plan(forced=forced), tools, text, 2)
    blocks = _replay(events)
    assert [(b["type"], b["name"], b["input"]) for b in blocks] == [
        ("tool_use", "get_weather", {"city": "Oslo"}), ("tool_use", "ping", {})]
    deltas = [d["delta"]["partial_json"] for n, d in events if n == "content_block_delta"]
    assert len(deltas) > 4  # the first call's arguments went in pieces
    whole = ChoiceView(_state(), _plan(forced=forced), tools, streaming=False).view(text, True)
    assert [b["input"] for b in content_blocks(*whole)] == [{"city": "Oslo"}, {}]


def test_forced_calls_follow_the_reasoning_when_grammars_start_after_it():
    """--reasoning-parser without enable_in_reasoning: a forced choice's grammar starts after the reasoning, so its
    output is reasoning, then the calls; with enable_in_reasoning the JSON comes at once (no reasoning split)."""
    tools = _chat_tools(WEATHER)
    forced = forced_tool_choice(tools, {"type": "function", "function": {"name": "get_weather"}}, True)
    text = 'Oslo, then.</think>{"city": "Oslo"}'
    after = _state(reasoning_parser="qwen3", grammar_after_reasoning=True)
    for streaming in (False, True):
        reasoning, content, calls = ChoiceView(after, _plan(prompt="<think>", forced=forced), tools,
                                               streaming=streaming).view(text, True)
        assert (reasoning, content, calls[0]["function"]["arguments"]) == ("Oslo, then.", "", '{"city": "Oslo"}')
    reasoning, _, calls = ChoiceView(_state(reasoning_parser="qwen3"), _plan(prompt="<think>", forced=forced), tools,
                                     streaming=False).view('{"city": "Oslo"}', True)
    assert reasoning is None and calls[0]["function"]["arguments"] == '{"city": "Oslo"}'


def test_named_call_cut_short():
    tools = _chat_tools(WEATHER)
    forced = forced_tool_choice(tools, {"type": "function", "function": {"name": "get_weather"}}, True)
    _, text, calls = ChoiceView(_state(), _plan(forced=forced), tools, streaming=False).view('{"city": "Pa', True)
    assert text == "" and content_blocks(None, text, calls)[0]["input"] == {}  # not JSON yet: {}
    c = CompletionOutput(0, '{"city": "Pa', [1, 2], finish_reason="length")
    assert stop_reason(c, True) == ("max_tokens", None)
    assert tool_input('{"a": [1]}') == {"a": [1]} and tool_input('"s"') == {} and tool_input({"b": 2}) == {"b": 2}


@pytest.mark.parametrize("finish, matched, expected", [
    ("length", None, ("max_tokens", None)), ("stop", None, ("end_turn", None)), ("stop", 7, ("end_turn", None)),
    ("stop", "END", ("stop_sequence", "END"))])
def test_stop_reasons(finish, matched, expected):
    assert stop_reason(CompletionOutput(0, "x", [1], finish_reason=finish, stop_reason=matched), False) == expected


def test_usage_with_and_without_cache_details():
    out = RequestOutput("r", None, list(range(10)), [CompletionOutput(0, "ab", [1, 2], finish_reason="stop")], True,
                        num_cached_tokens=4)
    assert message_usage(_state(), out) == {"input_tokens": 10, "output_tokens": 2}
    assert message_usage(_state(enable_prompt_tokens_details=True), out) == {
        "input_tokens": 6, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4, "output_tokens": 2}


# -- errors and auth ----------------------------------------------------------------------------------
def test_error_shapes():
    assert anthropic_error_body("nope", 404) == {"type": "error", "error": {"type": "not_found_error",
                                                                            "message": "nope"}}
    kinds = {s: anthropic_error_body("x", s)["error"]["type"] for s in (400, 401, 413, 429, 500, 503, 529)}
    assert kinds == {400: "invalid_request_error", 401: "authentication_error", 413: "request_too_large",
                     429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}
    ev = anthropic_sse_error(OpenAIError("engine died", 503))
    assert ev.startswith("event: error\ndata: ") and json.loads(ev.split("data: ", 1)[1])["error"]["type"] == \
        "overloaded_error"
    assert is_messages_path("/v1/messages") and is_messages_path("/v1/messages/count_tokens")
    assert is_messages_path("/api/v1/messages") and not is_messages_path("/v1/models")


def _call(mw, path, headers, root_path=""):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": headers, "root_path": root_path}
    asyncio.run(mw(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body) if body else None


def test_api_key_middleware_on_messages_routes():
    async def ok_app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    mw = AuthAndCountMiddleware(ok_app, "k1", None)
    assert _call(mw, "/v1/messages", [(b"x-api-key", b"k1"), (b"anthropic-version", b"2023-06-01")])[0] == 200
    assert _call(mw, "/v1/messages", [(b"authorization", b"Bearer k1")])[0] == 200
    status, body = _call(mw, "/v1/messages", [(b"x-api-key", b"wrong")])
    assert status == 401 and body["type"] == "error" and body["error"]["type"] == "authentication_error"
    assert "x-api-key" in body["error"]["message"]
    status, body = _call(mw, "/v1/messages/count_tokens", [])
    assert status == 401 and body["error"]["type"] == "authentication_error"
    # the other routes keep the OpenAI body
    status, body = _call(mw, "/v1/chat/completions", [])
    assert status == 401 and body["error"]["code"] == "invalid_api_key" and "type" in body["error"]
    assert _call(AuthAndCountMiddleware(ok_app, None, None), "/v1/messages", [])[0] == 200  # no key: open
    several = AuthAndCountMiddleware(ok_app, ["k1", "k2"], None)  # --api-key K1 K2: either one
    for key, status in ((b"k1", 200), (b"k2", 200), (b"k3", 401), (b"", 401)):
        assert _call(several, "/v1/models", [(b"authorization", b"Bearer " + key)])[0] == status, key


def test_api_key_checked_behind_a_root_path():
    """uvicorn's --root-path puts the prefix in front of scope["path"]: the key is still required."""
    from voltllm.entrypoints.openai.app import route_path

    async def ok_app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    mw = AuthAndCountMiddleware(ok_app, "k1", None)
    for path in ("/api/v1/chat/completions", "/api/v1/models", "/api/v1/messages"):
        assert _call(mw, path, [], root_path="/api")[0] == 401, path
        assert _call(mw, path, [(b"authorization", b"Bearer k1")], root_path="/api")[0] == 200, path
    assert _call(mw, "/api/health", [], root_path="/api")[0] == 200  # outside /v1: open, as in vLLM
    assert route_path({"path": "/api/v1/x", "root_path": "/api"}) == "/v1/x"
    assert route_path({"path": "/apiv1/x", "root_path": "/api"}) == "/apiv1/x"  # not the prefix: unchanged
    assert route_path({"path": "/api", "root_path": "/api"}) == "/"
    assert route_path({"path": "/v1/x"}) == "/v1/x"


def test_error_after_the_stream_started_is_an_error_event():
    from voltllm.engine.async_llm import EngineDeadError, RequestAbortedError
    from voltllm.entrypoints.openai.messages_errors import anthropic_sse_error
    from voltllm.entrypoints.openai.serving_common import sse_body
    from voltllm.entrypoints.openai.serving_messages import event

    class Watcher:
        def __init__(self, gone=False):
            self.disconnected, self.stopped = gone, False

        def stop(self):
            self.stopped = True

    class Stream:
        closed = False

        def close(self):
            self.closed = True

    async def run(exc, gone=False):
        async def events():
            yield event("message_start", {"type": "message_start"})
            raise exc

        w, s = Watcher(gone), Stream()
        out = [e async for e in sse_body(events(), [s], w, "msg_x", done=None, error_event=anthropic_sse_error)]
        assert w.stopped and s.closed
        return out

    out = asyncio.run(run(EngineDeadError("boom")))
    assert len(out) == 2 and out[0].startswith("event: message_start\n")
    name, data = out[1].split("\n")[:2]
    assert name == "event: error" and json.loads(data[6:]) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "the engine is not available: boom"}}
    out = asyncio.run(run(OpenAIError("bad grammar", 400)))
    assert json.loads(out[1].split("\n")[1][6:])["error"] == {"type": "invalid_request_error",
                                                              "message": "bad grammar"}
    assert len(asyncio.run(run(RequestAbortedError("gone"), gone=True))) == 1  # nobody listens: no error event
    out = asyncio.run(run(RuntimeError("bug")))
    assert json.loads(out[1].split("\n")[1][6:])["error"]["type"] == "api_error"
