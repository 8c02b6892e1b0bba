"""--chat-template-content-format: vLLM's detection of templates that loop over a message's content parts, and the
two shapes content takes (serving_common.normalize_messages)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from voltllm.entrypoints.chat_content_format import detect_content_format, resolve_content_format
from voltllm.entrypoints.openai.errors import OpenAIError
from voltllm.entrypoints.openai.serving_common import message_text, normalize_messages

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
STRING_TEMPLATES = [
    CHATML,
    # a system message split off first, then a string test on content (Llama 3 style)
    "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] | trim %}"
    "{% set rest = messages[1:] %}{% else %}{% set rest = messages %}{% endif %}"
    "{% for message in rest %}{% if message['content'] is string %}{{ message['content'] }}{% endif %}{% endfor %}",
    # a loop over something else than content
    "{% for message in messages %}{% for call in message.tool_calls %}{{ call.function.name }}{% endfor %}"
    "{{ message.content }}{% endfor %}",
    # a content loop whose message is not a message of `messages`
    "{% for doc in documents %}{% for part in doc.content %}{{ part }}{% endfor %}{% endfor %}",
    "{% for x in %}",  # does not parse: vLLM's default, string
]
OPENAI_TEMPLATES = [
    # Qwen2-VL style
    "{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}",
    # through a slice assigned to another name, attribute access and a filter (Llama 4 / Mistral style)
    "{% set loop_messages = messages[1:] %}{% for m in loop_messages %}"
    "{% for part in m.content | selectattr('type', 'equalto', 'text') %}{{ part.text }}{% endfor %}{% endfor %}",
    # a variable named content
    "{% for message in messages %}{% set content = message['content'] %}{% for item in content %}{{ item.text }}"
    "{% endfor %}{% endfor %}",
    # transformers' generation tag is understood
    "{% for message in messages %}{% generation %}{% for p in message.content %}{{ p.text }}{% endfor %}"
    "{% endgeneration %}{% endfor %}",
]


@pytest.mark.parametrize("template", STRING_TEMPLATES)
def test_string_templates(template):
    assert detect_content_format(template) == "string"


@pytest.mark.parametrize("template", OPENAI_TEMPLATES)
def test_openai_templates(template):
    assert detect_content_format(template) == "openai"


def test_resolve_uses_the_template_that_will_be_applied():
    tok = SimpleNamespace(get_chat_template=lambda template, tools: template or CHATML)
    assert resolve_content_format("auto", tok, None) == "string"  # the tokenizer's
    assert resolve_content_format("auto", tok, OPENAI_TEMPLATES[0]) == "openai"  # the given one
    assert resolve_content_format("string", tok, OPENAI_TEMPLATES[0]) == "string"  # a fixed format wins
    assert resolve_content_format("openai", tok, CHATML) == "openai"

    def none(template, tools):
        raise ValueError("no chat template")
    assert resolve_content_format("auto", SimpleNamespace(get_chat_template=none), None) == "string"


def test_normalized_content_in_both_formats():
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                     "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}]
    flat = normalize_messages(msgs)
    assert [m["content"] for m in flat] == ["Be brief.", "a\nb", "", "no"]
    parts = normalize_messages(msgs, "openai")
    assert parts[0]["content"] == [{"type": "text", "text": "Be brief."}]
    assert parts[1]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert parts[2]["content"] == [] and parts[2]["tool_calls"][0]["function"]["arguments"] == {}
    assert parts[3]["content"] == [{"type": "text", "text": "no"}]
    assert [message_text(m) for m in parts] == [m["content"] for m in flat]
    with pytest.raises(OpenAIError, match="text-only"):
        normalize_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "openai")


def test_templates_render_the_parts():
    """What the template gets under each format (transformers applies it)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment()
    msgs = [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}]
    looping = env.from_string(OPENAI_TEMPLATES[0])
    assert looping.render(messages=normalize_messages(msgs, "openai")) == "xy"
    assert env.from_string(CHATML).render(messages=normalize_messages(msgs, "string")) == \
        "<|im_start|>user\nx\ny<|im_end|>\n"
