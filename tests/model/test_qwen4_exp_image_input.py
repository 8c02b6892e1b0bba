"""Image and video input for Qwen4-Exp (a tiny random qwen4_exp checkpoint: Qwen3.5-MoE's vision tower, the
Qwen4-Exp text model) end to end in the engine, fp32 CPU, against transformers' Qwen4ExpForConditionalGeneration:
greedy tokens and logprobs with one image, two images split by chunked prefill beside a text request, and a video;
with PLE layers (which hash the real token ids, image placeholders included) and without, and with QSA's sparse path
(its indexer rotates pooled past keys by each block's first token's M-RoPE position). The PLE case also shows that
handing PLE other ids for the image rows leaves transformers' output; the QSA case that rotating those keys by 1-D
token positions does."""
from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
if not hasattr(transformers, "Qwen4ExpConfig"):
    pytest.skip("this transformers has no Qwen4-Exp", allow_module_level=True)

from vl_models import (cpu_llm as _llm, run_greedy as _run, same_greedy as _same, vl_image as _image,  # noqa: E402
                       vl_prompt as _prompt, vl_reference as _reference, vl_setup)
from voltllm.model.models import qwen4_exp_ple  # noqa: E402


# ple: PLE layers, QSA's budget past every context (plain causal attention); no_ple: neither; qsa: PLE and a QSA
# budget of 8 tokens, so every image prompt's rows past 12 tokens take the sparse path (pooled keys rotated again)
VARIANTS = {"ple": dict(ple=True), "no_ple": dict(ple=False), "qsa": dict(ple=True, indexer_budget=8)}


@pytest.fixture(scope="module", params=list(VARIANTS))
def vl(request, tmp_path_factory):
    return vl_setup(str(tmp_path_factory.mktemp(f"q4-{request.param}")), "qwen4_exp", **VARIANTS[request.param])


def test_one_image_matches_transformers(vl):
    ids, out, mm = _prompt(vl, [None, "What is in this picture?"], [_image(0, 32, 48)])
    assert mm.rope_delta < 0 and len(ids) > 30
    llm = _llm(vl[0])
    assert llm.engine.runner.image_step is not None, "the qwen4_exp checkpoint takes images (no refusal)"
    assert bool(vl[3].config.text_config.ple_layer_ids) == bool(llm.engine.runner.model.ple_ids)
    assert _same(_run(llm, [(ids, mm)])[0], _reference(vl, ids, out))
    assert not llm.engine.runner.image_step.encoded


def test_two_images_split_by_chunked_prefill_and_a_text_request_beside(vl):
    ids, out, mm = _prompt(vl, ["Compare", None, "with", None, "please."], [_image(1, 32, 48), _image(2, 40, 24)])
    text_ids, _, _ = _prompt(vl, ["Just some text here."], [])
    llm = _llm(vl[0], max_num_batched_tokens=16, enable_chunked_prefill=True)
    got = _run(llm, [(ids, mm), (text_ids, None)])
    assert _same(got[0], _reference(vl, ids, out)) and _same(got[1], _reference(vl, text_ids, None))


def test_video_matches_transformers(vl):
    pytest.importorskip("av")
    from vl_models import vl_video_bytes, vl_video_prompt

    ids, out, mm = vl_video_prompt(vl, [None, "What happens?"], [vl_video_bytes(0, 9, 32, 48)])
    assert tuple(out["video_grid_thw"][0].tolist()) == (2, 8, 12) and len(mm.images) == 2
    assert _same(_run(_llm(vl[0]), [(ids, mm)])[0], _reference(vl, ids, out))


def test_ple_hashes_the_placeholder_ids(vl, monkeypatch):
    """PLE's n-gram windows must hold the image placeholder ids (transformers' ple_input_ids = input_ids): any other
    id for the image rows (here the pad id, as a rows-in-place-of-ids path might give) changes the output."""
    if not vl[3].config.text_config.ple_layer_ids:
        pytest.skip("no PLE layers")
    ids, out, mm = _prompt(vl, ["Compare", None, "with", None, "please."], [_image(1, 32, 48), _image(2, 40, 24)])
    want = _reference(vl, ids, out)
    image_id = vl[3].config.image_token_id
    real = qwen4_exp_ple.NGramContext.__init__

    def other_ids(self, input_ids, *args):
        real(self, input_ids.masked_fill(input_ids == image_id, 0), *args)

    monkeypatch.setattr(qwen4_exp_ple.NGramContext, "__init__", other_ids)
    got = _run(_llm(vl[0]), [(ids, mm)])[0]
    assert not _same(got, want)
    worst = max(abs(a - b) for (_, a), (_, b) in zip(got, want))
    assert [t for t, _ in got] != [t for t, _ in want] or worst > 1e-3


def test_qsa_rotates_past_keys_by_their_mrope_positions(vl, monkeypatch):
    """QSA past its budget pools and rotates cached raw keys again: an image request's block-start tokens must take
    their M-RoPE rotations (ImageStep.rotations of their positions), not their token indices' 1-D ones."""
    from voltllm.worker.image_step import ImageStep

    if vl[3].config.text_config.indexer_budget > 64:
        pytest.skip("no context here reaches QSA's budget")
    ids, out, mm = _prompt(vl, ["Compare", None, "with", None, "please."], [_image(1, 32, 48), _image(2, 40, 24)])
    want = _reference(vl, ids, out)

    def one_d(self, p3):
        length = p3.shape[1]
        return self.rotary.cos[:length].clone(), self.rotary.sin[:length].clone()

    monkeypatch.setattr(ImageStep, "rotations", one_d)
    got = _run(_llm(vl[0], max_num_batched_tokens=16, enable_chunked_prefill=True), [(ids, mm)])[0]
    assert not _same(got, want)


def test_tensor_parallel_ranks_rotate_alike(vl):
    """-tp 2 (gloo) gives -tp 1's output with images past QSA's budget: rank 1 rotates the pooled keys of image
    requests with rank 0's token positions (ImageRows.token_positions), as rank 0 does."""
    if vl[3].config.text_config.indexer_budget > 64:
        pytest.skip("no context here reaches QSA's budget")
    ids, out, mm = _prompt(vl, ["Compare", None, "with", None, "please."], [_image(1, 32, 48), _image(2, 40, 24)])
    got = _run(_llm(vl[0], max_num_batched_tokens=16, enable_chunked_prefill=True, tensor_parallel_size=2),
               [(ids, mm)])[0]
    assert _same(got, _reference(vl, ids, out))


def test_pipeline_stages_rotate_alike(tmp_path):
    """-pp 2 (gloo) with images past QSA's budget and PLE: the later stage rotates its indexed layer's pooled keys with
    rank 0's token positions (ImageRows.token_positions) and hashes the placeholder ids; transformers' output."""
    vl = vl_setup(str(tmp_path), "qwen4_exp", ple=True, indexer_budget=8,
                  layer_types=["linear_attention", "indexed_attention"] * 2)  # (attention on each stage)
    ids, out, mm = _prompt(vl, ["Compare", None, "with", None, "please."], [_image(1, 32, 48), _image(2, 40, 24)])
    got = _run(_llm(vl[0], max_num_batched_tokens=16, enable_chunked_prefill=True, pipeline_parallel_size=2),
               [(ids, mm)])[0]
    assert _same(got, _reference(vl, ids, out))


def test_prefix_cache_hit_past_the_image(vl):
    """The same prompt again hits the prefix cache past its image (KV blocks, the GDN and PLE state snapshots, QSA's
    keys in the blocks) and gives transformers' output again; other pixels share no block from the image on."""
    a_ids, a_out, a_mm = _prompt(vl, [None, "Describe it."], [_image(3, 32, 48)])
    b_ids, b_out, b_mm = _prompt(vl, [None, "Describe it."], [_image(4, 32, 48)])
    llm = _llm(vl[0], block_size=16, mamba_block_size=16, enable_prefix_caching=True)
    cached: list[int] = []
    first = _run(llm, [(a_ids, a_mm)], cached)[0]
    b = _run(llm, [(b_ids, b_mm)], cached)[0]
    again = _run(llm, [(a_ids, a_mm)], cached)[0]
    assert cached[1] == a_mm.images[0].offset // 16 * 16
    assert cached[2] >= a_mm.images[0].offset + a_mm.images[0].num_tokens
    assert _same(first, _reference(vl, a_ids, a_out)) and _same(again, first)
    assert _same(b, _reference(vl, b_ids, b_out))
