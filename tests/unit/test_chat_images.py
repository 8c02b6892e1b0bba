"""Image parts on the chat path, without a server: normalize_messages (parts for the template, URLs in order, the
400s), the Responses and Messages translations, and ServerState's refusals by route and engine."""
from __future__ import annotations

import jinja2
import pytest

from voltllm.entrypoints.chat_content_format import detect_content_format
from voltllm.entrypoints.openai.errors import OpenAIError
from voltllm.entrypoints.openai.messages_protocol import MessagesRequest
from voltllm.entrypoints.openai.responses_protocol import input_messages
from voltllm.entrypoints.openai.serving_common import (IMAGE_ROUTES, TEXT_ONLY, ServerState, message_text,
                                                       normalize_messages)
from vl_models import VL_CHATML

MSGS = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Compare"},
                                     {"type": "image_url", "image_url": {"url": "http://a/1.png"}},
                                     {"type": "text", "text": "with"},
                                     {"type": "image_url", "image_url": "data:image/png;base64,AAAA"}]}]


def test_image_parts_for_the_template():
    urls: list = []
    out = normalize_messages(MSGS, "openai", image_urls=urls)
    assert urls == ["http://a/1.png", "data:image/png;base64,AAAA"]  # (vLLM's bare-string form too)
    assert out[1]["content"] == [{"type": "text", "text": "Compare"}, {"type": "image"},
                                 {"type": "text", "text": "with"}, {"type": "image"}]
    assert message_text(out[1]) == "Compare\nwith"
    # a template that loops over the content ("auto" picks openai) places one placeholder per image, in order
    assert detect_content_format(VL_CHATML) == "openai"
    text = jinja2.Environment().from_string(VL_CHATML).render(messages=out, add_generation_prompt=True)
    assert "Compare<|vision_start|><|image_pad|><|vision_end|>with<|vision_start|><|image_pad|>" in text


def test_video_parts_for_the_template():
    urls: list = []
    videos: list = []
    msgs = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "http://a/v.mp4"}},
                                         {"type": "image_url", "image_url": "http://a/1.png"},
                                         {"type": "video_url", "video_url": "data:video/mp4;base64,AAAA"}]}]
    out = normalize_messages(msgs, "openai", image_urls=urls, video_urls=videos)
    assert urls == ["http://a/1.png"] and videos == ["http://a/v.mp4", "data:video/mp4;base64,AAAA"]
    assert out[0]["content"] == [{"type": "video"}, {"type": "image"}, {"type": "video"}]
    text = jinja2.Environment().from_string(VL_CHATML).render(messages=out, add_generation_prompt=False)
    assert text.count("<|vision_start|><|video_pad|><|vision_end|>") == 2


def test_image_refusals():
    with pytest.raises(OpenAIError, match="--chat-template-content-format openai") as e:
        normalize_messages(MSGS, "string", image_urls=[])
    assert e.value.status == 400 and e.value.param == "messages"
    with pytest.raises(OpenAIError, match="content\\[1\\] has type 'image_url': some reason"):
        normalize_messages(MSGS, "openai", refusal="some reason")
    video = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "http://a/v.mp4"}}]}]
    with pytest.raises(OpenAIError, match="takes images .* but no video on this route"):
        normalize_messages(video, "openai", image_urls=[])
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA"}}]}]
    with pytest.raises(OpenAIError, match="takes images and videos .* no audio or file input"):
        normalize_messages(audio, "openai", image_urls=[], video_urls=[])
    with pytest.raises(OpenAIError, match="a video cannot be placed in a chat template that takes message content"):
        normalize_messages(video, "string", image_urls=[], video_urls=[])
    with pytest.raises(OpenAIError, match="image_url must be a URL string"):
        normalize_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 3}}]}], "openai",
                           image_urls=[])


class _Tok:
    chat_template = VL_CHATML

    def get_chat_template(self, *args):
        return VL_CHATML


class _Engine:
    tokenizer = _Tok()


def test_server_state_refusals():
    state = ServerState(engine=_Engine(), served_model_names=["m"], max_model_len=64, model_path="m")
    with pytest.raises(OpenAIError, match=TEXT_ONLY.replace("(", "\\(").replace(")", "\\)")):
        state.template_messages(MSGS, None, None, [])  # (a text-only engine, even on an image route)
    state.image_refusal = "the server was started with --language-model-only (no image input)"
    with pytest.raises(OpenAIError, match="--language-model-only"):
        state.template_messages(MSGS, None, None, [])
    state.images = object()  # (an engine that takes images: the processor)
    urls: list = []
    assert state.template_messages(MSGS, None, None, urls)[1]["content"][1] == {"type": "image"} and len(urls) == 2
    with pytest.raises(OpenAIError, match="not by this route"):  # (/tokenize, count_tokens, ...)
        state.template_messages(MSGS, None, None)
    assert "/v1/chat/completions" in IMAGE_ROUTES


def test_responses_input_image_becomes_image_url():
    msgs = input_messages([{"role": "user", "content": [{"type": "input_text", "text": "What?"},
                                                        {"type": "input_image", "image_url": "http://a/1.png",
                                                         "detail": "auto"}]}])
    assert msgs == [{"role": "user", "content": [{"type": "text", "text": "What?"},
                                                 {"type": "image_url", "image_url": {"url": "http://a/1.png"}}]}]
    assert input_messages([{"role": "user", "content": [{"type": "input_text", "text": "x"}]}])[0]["content"] == "x"
    with pytest.raises(OpenAIError, match="Files API"):
        input_messages([{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}])


def test_messages_image_blocks_become_image_url():
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
        {"type": "image", "source": {"type": "url", "url": "https://a/2.png"}},
        {"type": "text", "text": "Both?"}]}]})
    assert req.chat_messages() == [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "image_url", "image_url": {"url": "https://a/2.png"}}, {"type": "text", "text": "Both?"}]}]
    bad = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "file", "file_id": "f"}}]}]})
    with pytest.raises(OpenAIError, match="image block.s source must be"):
        bad.chat_messages()
