"""LLM.chat with image_url parts (the frontend's media reading, processor and placeholder expansion) against
transformers' Qwen3_5ForConditionalGeneration, Qwen3VLForConditionalGeneration and Qwen2_5_VLForConditionalGeneration
on the tiny VL checkpoints; the offline limit."""
from __future__ import annotations

import base64
import io

import pytest

pytest.importorskip("transformers")

from vl_models import GREEDY, same_greedy, vl_image, vl_prompt, vl_reference, vl_setup  # noqa: E402


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_vl", "qwen2_5_vl"])
def vl(tmp_path_factory, request):
    return vl_setup(str(tmp_path_factory.mktemp("vl")), request.param)


def _data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")  # (lossless: the processor sees the same pixels as the reference's)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_chat_with_images_matches_transformers(vl):
    from voltllm.entrypoints.llm import LLM

    llm = LLM(vl[0], device="cpu", dtype="float32", enforce_eager=True, max_num_seqs=4,
              limit_mm_per_prompt={"image": 2})
    a, b = vl_image(3, 32, 48), vl_image(4, 40, 32)
    content = [{"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": _data_url(a)}},
               {"type": "text", "text": "with"}, {"type": "image_url", "image_url": _data_url(b)}]
    out = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)[0]
    ids, pixels, _ = vl_prompt(vl, ["Compare", None, "with", None], [a, b])
    assert list(out.prompt_token_ids) == ids
    c = out.outputs[0]
    got = [(t, lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs)]
    assert same_greedy(got, vl_reference(vl, ids, pixels))
    with pytest.raises(ValueError, match="3 images in one conversation: this LLM takes at most 2"):
        llm.chat([{"role": "user", "content": content + content[1:2]}], GREEDY, use_tqdm=False)
