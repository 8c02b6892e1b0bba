"""Structured outputs over HTTP with the openai client, on a `voltllm serve` of a tiny random model: OpenAI's
response_format, vLLM's guided_* and structured_outputs parameters and structural tags, chat and completions,
streamed and not; and the 400s (two constraints, an invalid schema / regex / grammar / structural tag, an unsupported
response_format)."""
from __future__ import annotations

import json

import openai
import pytest

from structured_cases import (CHOICES, GRAMMAR, GRAMMAR_RE, LEGACY_TAG, REGEX, SCHEMA, check_json_object_output,
                              check_regex_output, check_schema_output, check_tagged_output, structural_tag)

MESSAGES = [{"role": "user", "content": "Give me a record."}]


@pytest.fixture(scope="module")
def client(tiny_server):  # (tiny_server: conftest.py, shared with test_tool_choice_server.py)
    return openai.OpenAI(base_url=tiny_server.base + "/v1", api_key="none", max_retries=0, timeout=60)


def _chat(client, **kw):
    kw.setdefault("max_tokens", 80)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny", messages=MESSAGES, **kw)


def _complete(client, prompt="The quick brown fox", **kw):
    kw.setdefault("max_tokens", 80)
    kw.setdefault("temperature", 0)
    return client.completions.create(model="tiny", prompt=prompt, **kw)


def test_chat_json_schema_response_format(client):
    rf = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
    choice = _chat(client, response_format=rf).choices[0]
    check_schema_output(choice.message.content)
    assert choice.finish_reason == "stop"
    sampled = _chat(client, response_format=rf, temperature=1.0, seed=4, n=2)
    for c in sampled.choices:
        check_schema_output(c.message.content)


def test_chat_json_schema_streamed(client):
    rf = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
    stream = _chat(client, response_format=rf, stream=True, temperature=0.7, seed=2)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    check_schema_output(text)


def test_chat_json_object_and_guided_choice(client):
    # a nudge towards closing: any object is allowed, and a random model may otherwise write one key for ever
    bias = {"4": 2.0, "95": 2.0}
    out = _chat(client, response_format={"type": "json_object"}, logit_bias=bias)
    check_json_object_output(out.choices[0].message.content)
    out = _chat(client, extra_body={"guided_choice": CHOICES})
    assert out.choices[0].message.content in CHOICES


def test_completions_guided_parameters(client):
    check_regex_output(_complete(client, extra_body={"guided_regex": REGEX}).choices[0].text)
    check_regex_output(_complete(client, extra_body={"guided_grammar": GRAMMAR}).choices[0].text, GRAMMAR_RE)
    check_schema_output(_complete(client, extra_body={"guided_json": json.dumps(SCHEMA)}).choices[0].text)
    check_schema_output(_complete(client, extra_body={"structured_outputs": {"json": SCHEMA}}).choices[0].text)
    out = _complete(client, prompt=["Hello world!", "0123"], temperature=1.0, seed=9,
                    extra_body={"structured_outputs": {"choice": CHOICES}})
    assert [c.text in CHOICES for c in out.choices] == [True, True]
    # and the unconstrained answer is not one of them: the constraint is what makes them so
    assert _complete(client, prompt="Hello world!", max_tokens=4).choices[0].text not in CHOICES


def _bad(call) -> dict:
    with pytest.raises(openai.BadRequestError) as exc:
        call()
    body = exc.value.response.json()["error"]
    assert body["type"] == "invalid_request_error", body
    return body


def test_two_constraints_are_refused(client):
    body = _bad(lambda: _chat(client, response_format={"type": "json_object"}, extra_body={"guided_regex": REGEX}))
    assert body["param"] == "guided_regex" and "one structured-output constraint" in body["message"], body
    body = _bad(lambda: _complete(client, extra_body={"structured_outputs": {"regex": REGEX, "choice": CHOICES}}))
    assert body["param"] == "structured_outputs", body


def test_invalid_constraints_name_their_parameter(client):
    body = _bad(lambda: _chat(client, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nope"}}}))
    assert body["param"] == "response_format" and "JSON schema" in body["message"], body
    body = _bad(lambda: _complete(client, extra_body={"guided_json": "{not json"}))
    assert body["param"] == "guided_json", body
    body = _bad(lambda: _complete(client, extra_body={"guided_regex": "(abc"}))
    assert body["param"] == "guided_regex" and "regex" in body["message"], body
    body = _bad(lambda: _complete(client, extra_body={"guided_grammar": "root ::= "}))
    assert body["param"] == "guided_grammar" and "grammar" in body["message"], body
    body = _bad(lambda: _complete(client, extra_body={"structured_outputs": {"choice": []}}))
    assert body["param"] == "structured_outputs", body


def test_structural_tags(client):
    """vLLM's response_format structural_tag (xgrammar's form; the older structures + triggers) and
    structured_outputs.structural_tag (JSON text): free text, and a tag after each trigger."""
    forced = structural_tag(at_least_one=True, stop_after_first=True)
    choice = _chat(client, response_format=forced).choices[0]
    assert len(check_tagged_output(choice.message.content)) == 1 and choice.finish_reason == "stop", choice
    stream = _chat(client, response_format=forced, stream=True, temperature=0.8, seed=3)
    assert len(check_tagged_output("".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices))) == 1
    # free text where no trigger comes: what the model says unconstrained, whichever form and parameter
    plain = _complete(client, max_tokens=20).choices[0].text
    assert "<" not in plain
    assert _complete(client, max_tokens=20, extra_body={"response_format": LEGACY_TAG}).choices[0].text == plain
    so = {"structural_tag": json.dumps(LEGACY_TAG)}
    out = _complete(client, max_tokens=20, extra_body={"structured_outputs": so})
    assert out.choices[0].text == plain


def test_malformed_structural_tags_name_their_parameter(client):
    for rf, words in [({"type": "structural_tag"}, "needs a format"),
                      ({"type": "structural_tag", "format": {}}, "format"),
                      ({**LEGACY_TAG, "triggers": ["<g"]}, "does not match any trigger")]:
        body = _bad(lambda: _chat(client, response_format=rf))
        assert body["param"] == "response_format" and "invalid structural tag" in body["message"], body
        assert words in body["message"], body
    body = _bad(lambda: _complete(client, extra_body={"structured_outputs": {"structural_tag": "{oops"}}))
    assert body["param"] == "structured_outputs" and "not valid JSON" in body["message"], body


def test_unsupported_response_format(client):
    body = _bad(lambda: _chat(client, response_format={"type": "xml"}))
    assert body["param"] == "response_format" and body["code"] == "unsupported_parameter", body
    assert "'structural_tag'" in body["message"], body
    body = _bad(lambda: _chat(client, response_format={"type": "json_schema", "json_schema": {"name": "x"}}))
    assert body["param"] == "response_format", body
    # the engine is unharmed by all of the above
    assert _complete(client, max_tokens=3).choices[0].finish_reason == "length"
