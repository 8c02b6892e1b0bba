"""thinking_token_budget and structured outputs after the reasoning over HTTP (openai client), on a tiny random qwen3
whose tokenizer has "<think>" / "</think>" as tokens, served with --reasoning-parser qwen3 and a chat template that
opens the reasoning in the prompt (as Qwen3.5's, QwQ's and DeepSeek-R1's do): the budget's forced end, the JSON of a
json_schema response_format and of a forced tool choice in content / tool_calls with the reasoning beside it,
streamed and not; the 400 on a server without a reasoning parser."""
from __future__ import annotations

import json

import openai
import pytest

from server_helpers import ServerProc, free_port
from structured_cases import SCHEMA, check_schema_output
from tiny_models import CHATML, make_model

MESSAGES = [{"role": "user", "content": "Give me a record."}]
RF = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
TOOL = {"type": "function", "function": {"name": "record", "parameters": SCHEMA}}


@pytest.fixture(scope="module")
def think_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("think_server")
    path = make_model(str(d / "model"), "qwen3", added_tokens=("<think>", "</think>"))
    template = d / "template.jinja"
    template.write_text(CHATML.replace("assistant\n{% endif %}", "assistant\n<think>{% endif %}"))
    srv = ServerProc([path, "--device", "cpu", "--block-size", "4", "--served-model-name", "think",
                      "--chat-template", str(template), "--reasoning-parser", "qwen3", "--disable-log-stats",
                      "--disable-uvicorn-access-log"], free_port(), env={"OMP_NUM_THREADS": "1"})
    srv.model_path = path
    try:
        srv.wait_healthy(180)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(think_server):
    return openai.OpenAI(base_url=think_server.base + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def end_id(think_server):
    from transformers import AutoTokenizer

    from voltllm.entrypoints.openai.parsers import THINK_END

    return AutoTokenizer.from_pretrained(think_server.model_path).convert_tokens_to_ids(THINK_END)


def _chat(client, end_id, **kw):
    body = {"return_token_ids": True, **kw.pop("extra_body", {})}
    kw.setdefault("max_tokens", 80)
    kw.setdefault("logit_bias", {str(end_id): -100})  # (the random model would end its reasoning by itself)
    return client.chat.completions.create(model="think", messages=MESSAGES, temperature=0, extra_body=body, **kw)


def test_budget_forces_the_end_of_reasoning(client, end_id):
    choice = _chat(client, end_id, max_tokens=16, extra_body={"thinking_token_budget": 8}).choices[0]
    ids = choice.model_extra["token_ids"]
    assert ids[8] == end_id and end_id not in ids[:8], ids
    assert choice.message.reasoning_content and choice.message.content is not None
    free = _chat(client, end_id, max_tokens=16).choices[0]
    assert end_id not in free.model_extra["token_ids"] and not free.message.content  # (all of it reasoning)
    completion = client.completions.create(model="think", prompt="Hello <think>", max_tokens=8, temperature=0,
                                           logit_bias={str(end_id): -100},
                                           extra_body={"thinking_token_budget": 3, "return_token_ids": True})
    assert completion.choices[0].model_extra["token_ids"][3] == end_id
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        _chat(client, end_id, extra_body={"thinking_token_budget": -5})


def test_json_schema_comes_after_the_reasoning(client, end_id):
    msg = _chat(client, end_id, response_format=RF, extra_body={"thinking_token_budget": 4}).choices[0].message
    assert msg.reasoning_content  # the reasoning stays reasoning, the JSON is the content
    check_schema_output(msg.content)
    chunks = list(_chat(client, end_id, response_format=RF, stream=True, extra_body={"thinking_token_budget": 4}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == msg.content
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == msg.reasoning_content
    # no budget: the model ends its reasoning itself (nudged to, at once), then the schema binds (and masks the nudge)
    natural = _chat(client, end_id, response_format=RF, logit_bias={str(end_id): 100}).choices[0]
    assert natural.model_extra["token_ids"][0] == end_id and natural.message.reasoning_content is None
    check_schema_output(natural.message.content)


def test_forced_tool_choice_after_the_reasoning(client, end_id):
    kw = dict(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "record"}},
              extra_body={"thinking_token_budget": 5})
    choice = _chat(client, end_id, **kw).choices[0]
    assert choice.message.reasoning_content and not choice.message.content
    call = choice.message.tool_calls[0]
    assert call.function.name == "record"
    check_schema_output(call.function.arguments)
    chunks = list(_chat(client, end_id, stream=True, **kw))
    args = "".join(tc.function.arguments or "" for c in chunks if c.choices
                   for tc in c.choices[0].delta.tool_calls or [])
    assert json.loads(args) == json.loads(call.function.arguments)


def test_budget_without_a_reasoning_parser_is_a_400(tiny_server):
    c = openai.OpenAI(base_url=tiny_server.base + "/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                  extra_body={"thinking_token_budget": 8})
    assert "--reasoning-parser" in str(e.value) and e.value.body["param"] == "thinking_token_budget"
