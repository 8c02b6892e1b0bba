"""Image input end to end in the engine (Qwen3.5 VL, tiny random checkpoint, fp32 CPU) against transformers'
Qwen3_5ForConditionalGeneration: greedy tokens with one image, two images split by chunked prefill, a text request
beside an image one, and prefix caching keyed by the image's pixels."""
from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

from vl_models import (cpu_llm as _llm, GREEDY, NEW_TOKENS, run_greedy as _run, same_greedy as _same,  # noqa: E402
                       vl_image as _image, vl_prompt as _prompt, vl_reference as _reference, vl_setup)
from voltllm.engine.types import EngineCoreRequest  # noqa: E402

@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    return vl_setup(str(tmp_path_factory.mktemp("vl")))


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


def test_tensor_parallel_two_ranks_match_transformers(vl):
    """-tp 2: rank 0 encodes and broadcasts the tower rows; every rank writes the same scratch rotary rows."""
    ids, out, mm = _prompt(vl, ["Compare", None, "with", None, "please."], [_image(1, 32, 48), _image(2, 40, 24)])
    text_ids, _, _ = _prompt(vl, ["Just some text here."], [])
    llm = _llm(vl[0], tensor_parallel_size=2, max_num_batched_tokens=16, enable_chunked_prefill=True)
    got = _run(llm, [(ids, mm), (text_ids, None)])
    assert _same(got[0], _reference(vl, ids, out)) and _same(got[1], _reference(vl, text_ids, None))


def test_the_same_image_in_requests_at_once_is_encoded_once(vl):
    """Two requests of one prompt and a third prompt with the same picture: one tower run for the three; the rows
    leave the kept set once every one has computed the image's tokens and stay among the recent ones."""
    ids, out, mm = _prompt(vl, [None, "What is in this picture?"], [_image(0, 32, 48)])
    other_ids, other_out, other_mm = _prompt(vl, ["Here:", None, "Describe."], [_image(0, 32, 48)])
    llm = _llm(vl[0], max_num_batched_tokens=24, enable_chunked_prefill=True)
    step = llm.engine.runner.image_step
    calls = []
    tower = step.tower
    step.tower = lambda pixels, grids: calls.append(grids) or tower(pixels, grids)
    got = _run(llm, [(ids, mm), (ids, mm), (other_ids, other_mm)])
    assert len(calls) == 1 and not step.encoded and not step.waiting
    assert list(step.recent) == [mm.images[0].content_hash]
    want = _reference(vl, ids, out)
    assert _same(got[0], want) and _same(got[1], want) and _same(got[2], _reference(vl, other_ids, other_out))


def test_mtp_drafts_keep_the_greedy_output(vl, tmp_path):
    """The target's MTP module drafts for a request with an image (its chained rows at the shifted positions): the
    greedy output is the one without speculation."""
    import shutil

    from mtp_models import add_mtp_weights

    path = str(tmp_path / "vl-mtp")
    shutil.copytree(vl[0], path)
    add_mtp_weights(path, prefix="model.language_model.")
    ids, out, mm = _prompt(vl, [None, "What is in this picture?"], [_image(0, 32, 48)])
    plain = _run(_llm(path), [(ids, mm)])[0]
    llm = _llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert llm.engine.runner.draft is not None and llm.engine.runner.image_step is not None
    spec = _run(llm, [(ids, mm)])[0]
    assert [t for t, _ in spec] == [t for t, _ in plain]


def test_profiled_image_follows_mm_processor_kwargs(vl):
    """Memory profiling encodes the largest image the processor makes, --mm-processor-kwargs applied."""
    llm = _llm(vl[0], load_format="dummy", mm_processor_kwargs={"max_pixels": 1024},
               limit_mm_per_prompt={"video": 0})
    assert llm.engine.runner.image_step.largest_grid == (1, 8, 8)  # 32 x 32 pixels of 4-pixel patches
    # with videos (max_pixels is the image processor's alone): a temporal patch of the video budget's 2 frames
    llm = _llm(vl[0], load_format="dummy", mm_processor_kwargs={"max_pixels": 1024, "size": {
        "shortest_edge": 1024, "longest_edge": 2 * 48 * 48}})
    assert llm.engine.runner.image_step.largest_grid == (1, 12, 12)


def test_preempted_image_requests_encode_again_and_match(vl):
    """A KV budget too small for both image requests at once: one is preempted (recomputed from its prompt, its
    image encoded again or taken from the recent rows) and both still give transformers' tokens; no rows leak."""
    first, out1, mm1 = _prompt(vl, [None, "What is in this picture?"], [_image(6, 32, 48)])
    second, out2, mm2 = _prompt(vl, ["Here:", None, "Describe."], [_image(7, 40, 24)])
    llm = _llm(vl[0], block_size=4, max_num_batched_tokens=16, enable_chunked_prefill=True,
               num_gpu_blocks_override=(len(first) + len(second)) // 4 + 2)
    got = _run(llm, [(first, mm1), (second, mm2)])
    assert llm.engine.stats().num_preemptions > 0
    assert _same(got[0], _reference(vl, first, out1)) and _same(got[1], _reference(vl, second, out2))
    step = llm.engine.runner.image_step
    assert not step.encoded and not step.waiting


def test_vllm_multi_modal_data_prompts_and_refusals(vl):
    """LLM.generate takes vLLM's {"prompt", "multi_modal_data": {"image": ...}}: the same tokens as the expanded
    prompt; an engine that takes no images refuses a prompt with images (ValueError, nothing left running)."""
    from voltllm import SamplingParams

    picture = _image(0, 32, 48)
    ids, out, mm = _prompt(vl, [None, "What is in this picture?"], [picture])
    tok = vl[2]
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {
        "type": "text", "text": "What is in this picture?"}]}], add_generation_prompt=True, tokenize=False)
    llm = _llm(vl[0])
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    got = llm.generate({"prompt": text, "multi_modal_data": {"image": picture}}, params, use_tqdm=False)[0]
    assert got.prompt_token_ids == ids and got.outputs[0].token_ids == [t for t, _ in _reference(vl, ids, out)]
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate({"prompt": text, "multi_modal_data": {"image": [picture, picture]}}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="video_url"):
        llm.generate({"prompt": text, "multi_modal_data": {"video": [picture]}}, params, use_tqdm=False)
    text_only = _llm(vl[0], limit_mm_per_prompt={"image": 0, "video": 0})
    with_data = {"prompt": text, "multi_modal_data": {"image": picture}}
    for prompt in ({"prompt_token_ids": ids, "multi_modal": mm}, with_data):
        with pytest.raises(ValueError, match="limit-mm-per-prompt image 0"):
            text_only.generate(prompt, params, use_tqdm=False)
    assert not text_only.engine.has_unfinished_requests()
    assert len(text_only.generate({"prompt_token_ids": ids[:5]}, params, use_tqdm=False)[0].outputs[0].token_ids) \
        == NEW_TOKENS
