"""Video input for Qwen2.5-VL and Qwen2-VL in the engine (tiny random checkpoints, fp32 CPU) against transformers'
Qwen2_5_VLForConditionalGeneration / Qwen2VLForConditionalGeneration given pixel_values_videos / video_grid_thw (and
Qwen2.5-VL's second_per_grid_ts) from voltllm's processor: a video is one run of video tokens between vision start /
end (no timestamps), each temporal patch one (1, h, w) image to the tower, and its patches' M-RoPE time positions
step by tokens_per_second x seconds per patch (Qwen2.5-VL; the tiny config's tokens_per_second is transformers'
default 4) or by one (Qwen2-VL).

The clips are chosen so that the time positions stay within the video's rows and columns: there transformers 5's
get_rope_index and the Qwen models' original rule (vLLM's; mrope.prompt_positions) agree on the text after a video
(tests/unit/test_mrope.py shows where they part)."""
from __future__ import annotations

import base64

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("av")

from vl_models import (GREEDY, cpu_llm as _llm, run_greedy as _run, same_greedy as _same, vl_image,  # noqa: E402
                       vl_prompt, vl_reference as _reference, vl_setup, vl_video_bytes as _video,
                       vl_video_prompt as _prompt)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl"])
def vl(request, tmp_path_factory):
    return vl_setup(str(tmp_path_factory.mktemp(request.param)), request.param)


def _processor(vl, **loading):
    from voltllm.multimodal.processor import ImageProcessor
    from voltllm.multimodal.video import VideoLoading

    processor = ImageProcessor.from_model(vl[0], vl[3].config, videos=True)
    processor.video_loading = VideoLoading(**loading)
    return processor


def test_one_video_matches_transformers(vl):
    """6 frames at 3 fps (all read; the processor samples none): 3 temporal patches of 2 frames, 2/3 s each, so
    Qwen2.5-VL's time positions step by 4 x 2/3: 0, 2, 5 (floored after the multiply)."""
    path, _, tok, ref = vl
    data = _video(0, 6, 32, 48, fps=3)
    processor = _processor(vl)
    ids, out, mm = _prompt(vl, [None, "What happens?"], [data], processor)
    assert tuple(out["video_grid_thw"][0].tolist()) == (3, 8, 12) and len(mm.images) == 3
    c = ref.config
    start = ids.index(c.video_token_id)
    assert ids[start - 1] == c.vision_start_token_id and ids[start + 72] == c.vision_end_token_id
    assert ids.count(c.video_token_id) == 72 and [im.offset for im in mm.images] == [start, start + 24, start + 48]
    times = mm.rope_positions[0, [im.offset for im in mm.images]] - start
    if c.model_type == "qwen2_5_vl":
        assert out["second_per_grid_ts"].tolist() == pytest.approx([2 / 3])
        assert times.tolist() == [0, 2, 5]
    else:
        assert times.tolist() == [0, 1, 2]
    llm = _llm(path)
    want = _reference(vl, ids, out)
    assert _same(_run(llm, [(ids, mm)])[0], want)
    assert not llm.engine.runner.image_step.encoded
    # LLM.chat with the video as a data URL: the same prompt and answer
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    chat = llm.chat([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                  {"type": "text", "text": "What happens?"}]}], GREEDY,
                    use_tqdm=False)[0]
    assert chat.prompt_token_ids == ids and list(chat.outputs[0].token_ids) == [t for t, _ in want]


def test_loader_sampling_sets_the_seconds_per_patch(vl):
    """--media-io-kwargs video num_frames 4 of a 9-frame clip at 4 fps reads frames 0, 2, 5, 8: a sampled rate of
    4 / 9 x 4 fps, 1.125 s per patch (transformers' sampled_fps), Qwen2.5-VL's time step 4.5."""
    processor = _processor(vl, num_frames=4)
    ids, out, mm = _prompt(vl, ["Watch", None, "now."], [_video(3, 9, 32, 48, fps=4)], processor)
    assert tuple(out["video_grid_thw"][0].tolist()) == (2, 8, 12)
    if vl[3].config.model_type == "qwen2_5_vl":
        assert out["second_per_grid_ts"].tolist() == pytest.approx([1.125])
        assert mm.rope_positions[0, mm.images[1].offset] - mm.rope_positions[0, mm.images[0].offset] == 4
    assert _same(_run(_llm(vl[0]), [(ids, mm)])[0], _reference(vl, ids, out))


def test_video_and_image_split_by_chunked_prefill(vl):
    """An image and a 3-patch video (6 frames at 4 fps: Qwen2.5-VL's step 2) in one prompt, prefilled 16 tokens a
    step (patches split across steps), beside a text request."""
    import torch

    path, image_processor, tok, ref = vl
    processor = _processor(vl)
    video = processor.video_from_bytes(_video(1, 6, 32, 40, fps=4))
    content = [{"type": "text", "text": "See"}, {"type": "image"}, {"type": "text", "text": "then"},
               {"type": "video"}, {"type": "text", "text": "and say."}]
    text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    image = vl_image(2, 32, 48)
    ids, mm = processor.prepare(tok.encode(text, add_special_tokens=False), [image], [video], tok)
    assert video.grid == (3, 8, 10) and len(mm.images) == 4
    out = dict(image_processor(images=[image], return_tensors="pt"))
    out.update(pixel_values_videos=torch.from_numpy(video.pixel_values), video_grid_thw=torch.tensor([video.grid]))
    if ref.config.model_type == "qwen2_5_vl":
        out["second_per_grid_ts"] = torch.tensor([video.second_per_grid])
    text_ids, _, _ = vl_prompt(vl, ["Just some text here."], [])
    llm = _llm(path, max_num_batched_tokens=16, enable_chunked_prefill=True)
    got = _run(llm, [(ids, mm), (text_ids, None)])
    assert _same(got[0], _reference(vl, ids, out)) and _same(got[1], _reference(vl, text_ids, None))


def _clip(last_seed: int, fps: int = 2) -> bytes:
    """4 lossless frames (all read, none sampled): patches (0, 1), (2, 3); the first three frames fixed."""
    import io

    import av
    import numpy as np

    rng = [np.random.default_rng(s) for s in (10, 11, 12, last_seed)]
    buf = io.BytesIO()
    with av.open(buf, "w", format="avi") as c:
        s = c.add_stream("ffv1", rate=fps)
        s.width, s.height, s.pix_fmt = 48, 32, "bgr0"
        for r in rng:
            c.mux(s.encode(av.VideoFrame.from_ndarray(r.integers(0, 256, (32, 48, 3), dtype=np.uint8),
                                                      format="rgb24")))
        c.mux(s.encode())
    return buf.getvalue()


def test_prefix_cache_is_keyed_by_each_temporal_patch(vl):
    """Two videos whose first patches are alike and whose second ones differ share the blocks up to the block of
    the second patch; the same frames at another rate (Qwen2.5-VL: other time positions for the second patch) do
    not share that patch either."""
    a_ids, a_out, a_mm = _prompt(vl, [None, "Describe it."], [_clip(13)])
    b_ids, b_out, b_mm = _prompt(vl, [None, "Describe it."], [_clip(14)])
    assert a_ids == b_ids and a_mm.images[0].content_hash == b_mm.images[0].content_hash
    assert a_mm.images[1].content_hash != b_mm.images[1].content_hash
    _, _, fast = _prompt(vl, [None, "Describe it."], [_clip(13, fps=4)])
    assert fast.images[0].content_hash == a_mm.images[0].content_hash
    assert (fast.images[1].content_hash == a_mm.images[1].content_hash) == (vl[3].config.model_type == "qwen2_vl")
    llm = _llm(vl[0], block_size=16, enable_prefix_caching=True)
    cached: list[int] = []
    first = _run(llm, [(a_ids, a_mm)], cached)[0]
    b = _run(llm, [(b_ids, b_mm)], cached)[0]
    again = _run(llm, [(a_ids, a_mm)], cached)[0]
    split = a_mm.images[1].offset // 16 * 16  # (no block holding the second patch's tokens is shared)
    assert cached[0] == 0 and cached[1] == split
    assert cached[2] >= a_mm.images[1].end, "the same pixels hit past the video"
    assert _same(first, _reference(vl, a_ids, a_out)) and _same(b, _reference(vl, b_ids, b_out))
    assert _same(again, first)


def test_chat_mm_processor_kwargs_reach_the_processor(vl):
    """LLM.chat(mm_processor_kwargs=...) (vLLM's keyword): this call's processor settings over the engine's, as
    --mm-processor-kwargs sets them: max_pixels 1024 shrinks a 32 x 48 image (grid 1 x 8 x 12) and each frame of a
    video to 1024 pixels' patches; the answer is transformers' on those pixels. A later call without them gets the
    engine's settings again; a key no processor takes is a ValueError naming the argument."""
    import io

    import torch

    from voltllm.multimodal.processor import ImageProcessor

    path, _, tok, ref = vl
    image, data = vl_image(5, 32, 48), _video(6, 4, 32, 48, fps=8)  # (Qwen2.5-VL: time step 1)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," +
                                                   base64.b64encode(buf.getvalue()).decode()}},
               {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(data).decode()}},
               {"type": "text", "text": "Both?"}]
    small = ImageProcessor.from_model(path, ref.config, {"max_pixels": 1024}, videos=True)
    pixels, grid = small.process([image])[0]
    video = small.video_from_bytes(data)
    assert grid == (1, 6, 8) and video.grid == (2, 6, 8)  # (32 x 48 -> 24 x 32 under 1024 pixels)
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "video"},
                                                                 {"type": "text", "text": "Both?"}]}],
                                   add_generation_prompt=True, tokenize=False)
    ids, _ = small.prepare(tok.encode(text, add_special_tokens=False), [image], [video], tok)
    out = {"pixel_values": pixels, "image_grid_thw": torch.tensor([grid]),
           "pixel_values_videos": torch.from_numpy(video.pixel_values), "video_grid_thw": torch.tensor([video.grid])}
    if ref.config.model_type == "qwen2_5_vl":
        out["second_per_grid_ts"] = torch.tensor([video.second_per_grid])
    llm = _llm(path)
    messages = [{"role": "user", "content": content}]
    got = llm.chat(messages, GREEDY, use_tqdm=False, mm_processor_kwargs={"max_pixels": 1024})[0]
    assert got.prompt_token_ids == ids
    assert _same([(t, lp[t].logprob) for t, lp in zip(got.outputs[0].token_ids, got.outputs[0].logprobs)],
                 _reference(vl, ids, out))
    plain = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert plain.prompt_token_ids.count(ref.config.image_token_id) == 24  # (the engine's: 8 x 12 / 4)
    with pytest.raises(ValueError, match="mm_processor_kwargs: neither the image processor"):
        llm.chat(messages, GREEDY, use_tqdm=False, mm_processor_kwargs={"nonsense": 1})
