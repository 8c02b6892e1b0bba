"""Video input end to end in the engine (tiny random checkpoints, fp32 CPU) against transformers'
Qwen3_5ForConditionalGeneration and Qwen3VLForConditionalGeneration given pixel_values_videos / video_grid_thw /
mm_token_type_ids from voltllm's processor: each temporal patch is one (1, h, w) image to the engine (its timestamp
text, vision start / end around it), and the greedy tokens and logprobs are transformers'. Also a video beside an
image split by chunked prefill, and prefix caching keyed by each temporal patch's pixels."""
from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("av")

from vl_models import (cpu_llm as _llm, run_greedy as _run, same_greedy as _same, vl_image, vl_prompt,  # noqa: E402
                       vl_reference as _reference, vl_setup, vl_video_bytes as _video, vl_video_prompt as _prompt)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_vl"])
def vl(request, tmp_path_factory):
    return vl_setup(str(tmp_path_factory.mktemp(request.param)), request.param)


def test_one_video_matches_transformers(vl):
    import base64

    from vl_models import GREEDY

    data = _video(0, 9, 32, 48)
    ids, out, mm = _prompt(vl, [None, "What happens?"], [data])
    assert tuple(out["video_grid_thw"][0].tolist()) == (2, 8, 12) and len(mm.images) == 2
    llm = _llm(vl[0])
    want = _reference(vl, ids, out)
    assert _same(_run(llm, [(ids, mm)])[0], want)
    assert not llm.engine.runner.image_step.encoded
    # LLM.chat with the video as a data URL: the same prompt and answer
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    chat = llm.chat([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                  {"type": "text", "text": "What happens?"}]}], GREEDY,
                    use_tqdm=False)[0]
    assert chat.prompt_token_ids == ids and list(chat.outputs[0].token_ids) == [t for t, _ in want]


def test_video_and_image_split_by_chunked_prefill(vl):
    """An image and a 3-patch video in one prompt, prefilled 16 tokens a step (patches split across steps), beside
    a text request."""
    import torch

    from voltllm.multimodal.processor import ImageProcessor

    path, image_processor, tok, ref = vl
    processor = ImageProcessor.from_model(path, ref.config, videos=True)
    video = processor.video_from_bytes(_video(1, 6, 24, 40, fps=2))  # (3 s: 6 frames at 2 fps)
    content = [{"type": "text", "text": "See"}, {"type": "image"}, {"type": "text", "text": "then"},
               {"type": "video"}, {"type": "text", "text": "and say."}]
    text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    image = vl_image(2, 32, 48)
    ids, mm = processor.prepare(tok.encode(text, add_special_tokens=False), [image], [video], tok)
    assert video.grid[0] == 3 and len(mm.images) == 4
    out = dict(image_processor(images=[image], return_tensors="pt"))
    out.update(pixel_values_videos=torch.from_numpy(video.pixel_values), video_grid_thw=torch.tensor([video.grid]))
    text_ids, _, _ = vl_prompt(vl, ["Just some text here."], [])
    llm = _llm(path, max_num_batched_tokens=16, enable_chunked_prefill=True)
    got = _run(llm, [(ids, mm), (text_ids, None)])
    assert _same(got[0], _reference(vl, ids, out)) and _same(got[1], _reference(vl, text_ids, None))


def test_prefix_cache_is_keyed_by_each_temporal_patch(vl):
    """Two videos whose first frames are alike and whose later ones differ share the blocks up to the block of the
    patch that differs."""
    import io

    import av
    import numpy as np

    def clip(last_seed: int) -> bytes:  # 4 frames at 2 fps (all read, each one sampled): patches (0, 1), (2, 3)
        rng = [np.random.default_rng(s) for s in (10, 11, 12, last_seed)]
        buf = io.BytesIO()
        with av.open(buf, "w", format="avi") as c:  # (lossless, so the first patch's pixels are equal)
            s = c.add_stream("ffv1", rate=2)
            s.width, s.height, s.pix_fmt = 48, 32, "bgr0"
            for r in rng:
                c.mux(s.encode(av.VideoFrame.from_ndarray(r.integers(0, 256, (32, 48, 3), dtype=np.uint8),
                                                          format="rgb24")))
            c.mux(s.encode())
        return buf.getvalue()

    a_ids, a_out, a_mm = _prompt(vl, [None, "Describe it."], [clip(13)])
    b_ids, b_out, b_mm = _prompt(vl, [None, "Describe it."], [clip(14)])
    assert a_ids == b_ids and a_mm.images[0].content_hash == b_mm.images[0].content_hash
    assert a_mm.images[1].content_hash != b_mm.images[1].content_hash
    llm = _llm(vl[0], block_size=16, mamba_block_size=16, enable_prefix_caching=True)
    cached: list[int] = []
    first = _run(llm, [(a_ids, a_mm)], cached)[0]
    b = _run(llm, [(b_ids, b_mm)], cached)[0]
    again = _run(llm, [(a_ids, a_mm)], cached)[0]
    split = a_mm.images[1].offset // 16 * 16  # (no block holding the second patch's tokens is shared)
    # (a hybrid resumes only at a recurrent-state snapshot, taken where a chunk ends: this one-chunk prompt has one at
    # its last block boundary, so no hit inside the video; docs/hybrid.md)
    assert cached[0] == 0 and cached[1] == (0 if vl[3].config.model_type == "qwen3_5" else split)
    assert cached[2] >= a_mm.images[1].end, "the same pixels hit past the video"
    assert _same(first, _reference(vl, a_ids, a_out)) and _same(b, _reference(vl, b_ids, b_out))
    assert _same(again, first)
