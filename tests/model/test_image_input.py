"""Image input end to end in the engine (Qwen3.5 VL, tiny random checkpoint, fp32 CPU) against transformers'
Qwen3_5ForConditionalGeneration: greedy tokens with one image, two images split by chunked prefill, a text request
beside an image one, and prefix caching keyed by the image's pixels."""
from __future__ import annotations

import hashlib
from typing import Optional

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

from vl_models import VL_PREPROCESSOR, make_tiny_qwen3_5_vl  # noqa: E402
from voltllm import SamplingParams  # noqa: E402
from voltllm.engine.types import EngineCoreRequest  # noqa: E402
from voltllm.multimodal.inputs import ImageInput, MultiModalPrompt  # noqa: E402
from voltllm.multimodal.mrope import prompt_positions  # noqa: E402

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    path = make_tiny_qwen3_5_vl(str(tmp_path_factory.mktemp("vl")), "qwen3_5", seed=0)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(**{k: v for k, v in VL_PREPROCESSOR.items()
                                            if k not in ("image_processor_type", "processor_class")})
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ref = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return path, processor, tok, ref


def _image(seed: int, h: int, w: int):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _prompt(vl, text_parts: list, images: list):
    """Token ids with each image's placeholder expanded, the processor's pixels, and our MultiModalPrompt."""
    _, processor, tok, ref = vl
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in text_parts]
    text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    image_id = ref.config.image_token_id
    out = processor(images=images, return_tensors="pt") if images else None
    expanded, items, k = [], [], 0
    for t in ids:
        if t != image_id:
            expanded.append(t)
            continue
        grid = tuple(int(x) for x in out["image_grid_thw"][k])
        n = grid[0] * grid[1] * grid[2] // 4
        start = sum(int(np.prod(g)) for g in out["image_grid_thw"][:k].tolist())
        pixels = out["pixel_values"][start:start + int(np.prod(grid))]
        digest = hashlib.sha256(pixels.numpy().tobytes()).digest()
        items.append(ImageInput(pixels.float(), grid, digest, len(expanded), n))
        expanded += [image_id] * n
        k += 1
    assert k == len(images)
    pos, delta = prompt_positions(len(expanded), [(im.offset, im.grid_thw) for im in items], 2)
    mm = MultiModalPrompt(tuple(items), pos, delta) if items else None
    return expanded, out, mm


def _reference(vl, ids: list, out) -> list[tuple[int, float]]:
    """transformers' greedy tokens and their logprobs."""
    ref = vl[3]
    inputs = {"input_ids": torch.tensor([ids])}
    if out is not None:
        types = (inputs["input_ids"] == ref.config.image_token_id).int()
        inputs.update(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"], mm_token_type_ids=types)
    with torch.no_grad():
        gen = ref.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                           output_logits=True, return_dict_in_generate=True)  # (raw: min_new_tokens masks EOS)
    tokens = gen.sequences[0, len(ids):].tolist()
    return [(t, torch.log_softmax(s[0].float(), -1)[t].item()) for t, s in zip(tokens, gen.logits)]


def _same(got: list, want: list) -> bool:
    return [t for t, _ in got] == [t for t, _ in want] and all(abs(a - b) < 1e-4 for (_, a), (_, b) in
                                                               zip(got, want))


def _llm(path, **kw):
    from voltllm.entrypoints.llm import LLM

    return LLM(path, device="cpu", dtype="float32", enforce_eager=True, max_num_seqs=4, **kw)


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)


def _run(llm, prompts: list, cached: Optional[list] = None) -> list[list[tuple[int, float]]]:
    """Each prompt's greedy (token, logprob)s; `cached` gets each one's prefix-cache hit tokens."""
    core = llm.engine
    for i, (ids, mm) in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"r{i}", ids, GREEDY, multi_modal=mm))
    got: dict[str, list] = {f"r{i}": [] for i in range(len(prompts))}
    hits: dict[str, int] = {}
    while core.has_unfinished_requests():
        for o in core.step():
            got[o.request_id] += [(t, lp[t][0]) for t, lp in zip(o.new_token_ids, o.new_logprobs)]
            if o.finished:
                hits[o.request_id] = o.num_cached_tokens
    if cached is not None:
        cached += [hits[f"r{i}"] for i in range(len(prompts))]
    return [got[f"r{i}"] for i in range(len(prompts))]


def test_one_image_matches_transformers(vl):
    ids, out, mm = _prompt(vl, [None, "What is in this picture?"], [_image(0, 32, 48)])
    assert mm.rope_delta < 0 and len(ids) > 30
    llm = _llm(vl[0])
    assert llm.engine.runner.image_step is not None
    assert _same(_run(llm, [(ids, mm)])[0], _reference(vl, ids, out))
    assert not llm.engine.runner.image_step.encoded, "every image's rows are dropped once its tokens are computed"


def test_two_images_split_by_chunked_prefill_and_a_text_request_beside(vl):
    ids, out, mm = _prompt(vl, ["Compare", None, "with", None, "please."], [_image(1, 32, 48), _image(2, 40, 24)])
    text_ids, _, _ = _prompt(vl, ["Just some text here."], [])
    llm = _llm(vl[0], max_num_batched_tokens=16, enable_chunked_prefill=True)
    got = _run(llm, [(ids, mm), (text_ids, None)])
    assert _same(got[0], _reference(vl, ids, out)) and _same(got[1], _reference(vl, text_ids, None))


def test_prefix_cache_is_keyed_by_the_pixels(vl):
    a_ids, a_out, a_mm = _prompt(vl, [None, "Describe it."], [_image(3, 32, 48)])
    b_ids, b_out, b_mm = _prompt(vl, [None, "Describe it."], [_image(4, 32, 48)])
    assert a_ids == b_ids, "the same placeholders: only the pixels differ"
    llm = _llm(vl[0], block_size=16, mamba_block_size=16, enable_prefix_caching=True)
    cached: list[int] = []
    first = _run(llm, [(a_ids, a_mm)], cached)[0]
    b = _run(llm, [(b_ids, b_mm)], cached)[0]
    again = _run(llm, [(a_ids, a_mm)], cached)[0]
    start = a_mm.images[0].offset
    assert cached[0] == 0 and cached[1] == start // 16 * 16, "no block holding the image may be shared"
    assert cached[2] >= start + a_mm.images[0].num_tokens, "the same pixels hit past the image"
    assert _same(first, _reference(vl, a_ids, a_out)) and _same(again, first)
    assert _same(b, _reference(vl, b_ids, b_out))


def test_dummy_weights_take_images_and_gone_requests_leave_no_rows(vl):
    """--load-format dummy builds a random tower too; an aborted request's kept rows go with it."""
    ids, _, mm = _prompt(vl, ["Look:", None, "and tell."], [_image(5, 32, 48)])
    llm = _llm(vl[0], load_format="dummy", max_num_batched_tokens=16, enable_chunked_prefill=True)
    step = llm.engine.runner.image_step
    assert step is not None and step.largest_grid == (1, 64, 64)
    core = llm.engine
    core.add_request(EngineCoreRequest("cut", ids, GREEDY, multi_modal=mm))
    core.step()
    assert step.encoded, "the image's rows are kept while its tokens are being prefilled"
    core.abort_requests(["cut"])
    while core.has_unfinished_requests():
        core.step()
    core.step()
    assert not step.encoded
    assert len(_run(llm, [(ids, mm)])[0]) == NEW_TOKENS
