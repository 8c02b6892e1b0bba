"""Image and video input over HTTP: a real server on the tiny Qwen3.5 VL checkpoint (tests/vl_models.py) answers chat
completions, Responses and Messages requests with images, and chat completions and /tokenize with videos; the
limits, media rules and refusals are 400s."""
from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from server_helpers import ServerProc, free_port
from vl_models import make_tiny_qwen3_5_vl, vl_video_bytes

MAX_LEN = 512


def png(w: int, h: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB").save(buf, format="PNG")
    return buf.getvalue()


def data_url(w: int = 48, h: int = 32, seed: int = 0) -> str:
    return "data:image/png;base64," + base64.b64encode(png(w, h, seed)).decode()


def video_url(frames: int = 9, w: int = 48, h: int = 32, seed: int = 0) -> str:
    """An MP4 at 4 fps: 9 frames are 2.25 s, sampled at 2 fps to 4 frames, 2 temporal patches of 24 tokens."""
    return "data:video/mp4;base64," + base64.b64encode(vl_video_bytes(seed, frames, h, w)).decode()


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    path = make_tiny_qwen3_5_vl(str(tmp_path_factory.mktemp("vl")))
    media = tmp_path_factory.mktemp("media")
    (media / "a.png").write_bytes(png(48, 32))
    (media / "v.mp4").write_bytes(vl_video_bytes(0, 9, 32, 48))
    srv = ServerProc([path, "--device", "cpu", "--max-model-len", str(MAX_LEN), "--served-model-name", "vl",
                      "--limit-mm-per-prompt", '{"image": 2, "video": 1}', "--allowed-local-media-path", str(media),
                      "--disable-log-stats", "--disable-uvicorn-access-log"], free_port(), env={"OMP_NUM_THREADS": "1"})
    srv.model_path, srv.media = path, media
    try:
        srv.wait_healthy(300)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def http(vl):
    with httpx.Client(base_url=vl.base, timeout=120) as client:
        yield client


def _text_prompt_tokens(vl, content: list) -> int:
    """The rendered prompt's tokens before the images' placeholders are expanded."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vl.model_path)
    parts = [{"type": p["type"][:-4]} if p["type"] in ("image_url", "video_url") else p for p in content]
    text = tok.apply_chat_template([{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True)
    return len(tok.encode(text, add_special_tokens=False))


def _chat(http, content, **extra):
    return http.post("/v1/chat/completions", json={"model": "vl", "max_tokens": 4, "temperature": 0,
                                                   "messages": [{"role": "user", "content": content}], **extra})


def test_chat_with_image_counts_expanded_prompt(vl, http):
    content = [{"type": "text", "text": "What is in"}, {"type": "image_url", "image_url": {"url": data_url()}},
               {"type": "text", "text": "this picture?"}]
    r = _chat(http, content, return_token_ids=True)
    assert r.status_code == 200, r.text
    body = r.json()
    # a 48 x 32 image is a (1, 8, 12) patch grid: 24 tokens after the 2 x 2 merge, in place of 1 placeholder
    assert body["usage"]["prompt_tokens"] == _text_prompt_tokens(vl, content) - 1 + 24
    assert len(body["prompt_token_ids"]) == body["usage"]["prompt_tokens"]
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    # vLLM's bare-string image_url gives the same prompt and (greedy) the same answer
    bare = [content[0], {"type": "image_url", "image_url": data_url()}, content[2]]
    again = _chat(http, bare, return_token_ids=True).json()
    assert again["prompt_token_ids"] == body["prompt_token_ids"]
    assert again["choices"][0]["token_ids"] == body["choices"][0]["token_ids"]


def test_local_file_only_under_allowed_path(vl, http, tmp_path):
    ok = _chat(http, [{"type": "image_url", "image_url": {"url": f"file://{vl.media}/a.png"}}])
    assert ok.status_code == 200, ok.text
    (tmp_path / "b.png").write_bytes(png(16, 16))
    bad = _chat(http, [{"type": "image_url", "image_url": {"url": f"file://{tmp_path}/b.png"}}])
    assert bad.status_code == 400 and "--allowed-local-media-path" in bad.json()["error"]["message"]


@pytest.mark.parametrize("content, param, words", [
    ([{"type": "image_url", "image_url": {"url": data_url(seed=i)}} for i in range(3)], "messages",
     "at most 2 (--limit-mm-per-prompt)"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}], "messages", "not valid base64"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}], "messages", "not an image"),
    ([{"type": "input_audio", "input_audio": {"data": "AAAA"}}], "messages", "no audio or file input"),
    ([{"type": "video_url", "video_url": {"url": video_url(seed=i)}} for i in range(2)], "messages",
     "2 videos in one request: this server takes at most 1 (--limit-mm-per-prompt)"),
    ([{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,aGVsbG8="}}], "messages",
     "not a format FFmpeg can read"),
    ([{"type": "video_url", "video_url": {"url": data_url()}}], "messages", "only video/* data URLs"),
    # 40 frames: the loader's 32, 16 temporal patches of 24 tokens and their timestamps, past --max-model-len
    ([{"type": "video_url", "video_url": {"url": video_url(40)}}], "prompt", "context length"),
    ([{"type": "image_url", "image_url": {}}], "messages", "image_url must be a URL string"),
    # 256 x 256 pixels: 64 x 64 patches, 1,024 tokens, past --max-model-len
    ([{"type": "image_url", "image_url": {"url": data_url(256, 256)}}], "prompt", "context length"),
    # the processor's own refusal (an aspect ratio above 200) is a 400 too, not a 500
    ([{"type": "image_url", "image_url": {"url": data_url(2010, 8)}}], "messages", "the image could not be used"),
])
def test_refusals(http, content, param, words):
    r = _chat(http, content)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_beam_search_and_truncation_refused(http):
    image = [{"type": "image_url", "image_url": {"url": data_url()}}]
    r = _chat(http, image, use_beam_search=True, n=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search"
    r = _chat(http, image, truncate_prompt_tokens=5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_responses_input_image(vl, http):
    chat = _chat(http, [{"type": "text", "text": "Describe"}, {"type": "image_url", "image_url": {"url": data_url()}}])
    r = http.post("/v1/responses", json={"model": "vl", "max_output_tokens": 4, "temperature": 0, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Describe"},
                                     {"type": "input_image", "image_url": data_url()}]}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] == chat.json()["usage"]["prompt_tokens"]
    bad = http.post("/v1/responses", json={"model": "vl", "input": [
        {"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"


def test_messages_image_block(http):
    chat = _chat(http, [{"type": "image_url", "image_url": {"url": data_url()}}, {"type": "text", "text": "Describe"}])
    b64 = data_url().split(",", 1)[1]
    r = http.post("/v1/messages", json={"model": "vl", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
        {"type": "text", "text": "Describe"}]}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] == chat.json()["usage"]["prompt_tokens"]
    counted = http.post("/v1/messages/count_tokens", json={"model": "vl", "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
        {"type": "text", "text": "Describe"}]}]})
    assert counted.status_code == 200 and counted.json()["input_tokens"] == r.json()["usage"]["input_tokens"]
    counted = http.post("/v1/messages/count_tokens", json={"model": "vl", "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
        {"type": "text", "text": "Describe"}]}]})
    assert counted.status_code == 200 and counted.json()["input_tokens"] == r.json()["usage"]["input_tokens"]


def test_tokenize_expands_the_images(vl, http):
    """vLLM's /tokenize with messages: the prompt the chat route would run, each image's tokens in place."""
    content = [{"type": "text", "text": "What is in"}, {"type": "image_url", "image_url": {"url": data_url()}},
               {"type": "text", "text": "this picture?"}]
    r = http.post("/tokenize", json={"model": "vl", "messages": [{"role": "user", "content": content}],
                                     "add_generation_prompt": True})
    assert r.status_code == 200, r.text
    chat = _chat(http, content, return_token_ids=True).json()
    assert r.json()["tokens"] == chat["prompt_token_ids"] and r.json()["count"] == _text_prompt_tokens(vl, content) + 23
    bad = http.post("/tokenize", json={"model": "vl", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,not-an-image"}}]}]})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_bench_random_mm_against_the_server(vl, tmp_path):
    """`voltllm bench --scenario random-mm --base-url`: streaming chat completions of the text then the images; each
    request's prompt tokens are the server's count, its image tokens the processor's, the requests those in process
    gets."""
    import dataclasses
    import json

    from transformers import AutoConfig, AutoTokenizer

    from voltllm.bench.cli import main
    from voltllm.bench.images import image_tokens_of, random_mm
    from voltllm.bench.inprocess import make_plans, make_run_input

    buckets = "{(32, 48, 1): 0.5, (64, 64, 1): 0.5}"
    out = tmp_path / "results"
    assert main([vl.model_path, "--base-url", vl.base, "--scenario", "random-mm", "--random-mm-bucket-config", buckets,
                 "--random-mm-num-mm-items-range-ratio", "1", "--random-mm-limit-mm-per-prompt", '{"image": 2}',
                 "--prompt-vocab", "300", "--input-len", "10", "--output-len", "3", "--concurrency", "3",
                 "--num-warm", "1", "--no-limits", "--output-dir", str(out), "--name", "mm", "--commit", "abc"]) == 0
    with open(out / "mm.json") as f:
        res = json.load(f)
    spec = random_mm(1, 1.0, '{"image": 2}', buckets)
    plan = dataclasses.replace(make_plans("random-mm", [3], 10, 3, images=spec)[0],
                               image_tokens=image_tokens_of(AutoConfig.from_pretrained(vl.model_path)))
    tok = AutoTokenizer.from_pretrained(vl.model_path)
    per_size = {(32, 48): 24, (64, 64): 64}
    assert res["config"]["client_side_times"] and len(res["metrics"]["runs"]) == 2
    for i, run in enumerate(res["metrics"]["runs"]):
        work = make_run_input(plan, 300, 0, i)
        for r, text, images in zip(run["requests"], work.prompts, work.images):
            content = [{"type": "text", "text": tok.decode(text)}] + [{"type": "image_url"}] * len(images)
            assert r["images"] == len(images) and r["image_tokens"] == sum(per_size[im.height, im.width]
                                                                           for im in images)
            # the rendered prompt (one placeholder per image) with each placeholder expanded to its image's tokens
            assert r["prompt_tokens"] == _text_prompt_tokens(vl, content) + r["image_tokens"] - len(images)
            assert r["output_tokens"] == 3
        assert run["tower_ms"] is None and run["metrics"]["images_per_request"] == sum(
            len(ims) for ims in work.images) / 3
    assert sum(r["images"] for run in res["metrics"]["runs"] for r in run["requests"]) > 0
    rows = {r["metric"] for r in res["metrics"]["table"]}
    assert {"ttft_ms", "images_per_request", "image_tokens_per_request"} <= rows and "vision_tower_ms" not in rows


def test_chat_with_video_counts_its_frames(vl, http):
    """A video's placeholder (vision start, video pad, vision end) becomes, per temporal patch, `<t seconds>`, vision
    start, 24 video tokens, vision end; /tokenize gives the same ids; a file:// video under the allowed path too."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vl.model_path)
    content = [{"type": "text", "text": "What happens in"}, {"type": "video_url", "video_url": {"url": video_url()}},
               {"type": "text", "text": "this clip?"}]
    r = _chat(http, content, return_token_ids=True)
    assert r.status_code == 200, r.text
    body = r.json()
    stamps = sum(len(tok.encode(f"<{t} seconds>", add_special_tokens=False)) for t in ("0.4", "1.6"))
    assert body["usage"]["prompt_tokens"] == _text_prompt_tokens(vl, content) - 3 + stamps + 2 * (2 + 24)
    ids = body["prompt_token_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|video_pad|>")) == 48 and "<1.6 seconds>" in tok.decode(ids)
    counted = http.post("/tokenize", json={"model": "vl", "messages": [{"role": "user", "content": content}],
                                           "add_generation_prompt": True})
    assert counted.status_code == 200 and counted.json()["tokens"] == ids
    local = [content[0], {"type": "video_url", "video_url": {"url": f"file://{vl.media}/v.mp4"}}, content[2]]
    again = _chat(http, local, return_token_ids=True).json()
    assert again["prompt_token_ids"] == ids and again["choices"][0]["token_ids"] == body["choices"][0]["token_ids"]
    # a video and an image in one message
    both = _chat(http, [{"type": "image_url", "image_url": {"url": data_url()}}, *content])
    assert both.status_code == 200 and both.json()["usage"]["prompt_tokens"] == body["usage"]["prompt_tokens"] + 24 + 2

