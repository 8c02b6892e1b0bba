"""Qwen3-VL image input end to end in the engine (tiny random checkpoints, fp32 CPU) against transformers'
Qwen3VLForConditionalGeneration / Qwen3VLMoeForConditionalGeneration: greedy tokens and their logprobs with one
image, two images split by chunked prefill beside a text request (also under -tp 2), the MoE kind; and the
deepstack rows matter (the output moves when they are left out)."""
from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

from vl_models import (cpu_llm as _llm, run_greedy as _run, same_greedy as _same, vl_image as _image,  # noqa: E402
                       vl_prompt as _prompt, vl_reference as _reference, vl_setup)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    return vl_setup(str(tmp_path_factory.mktemp("qwen3vl")), "qwen3_vl")


def _two_images_and_text(vl):
    ids, out, mm = _prompt(vl, ["Compare", None, "with", None, "please."], [_image(1, 32, 48), _image(2, 40, 24)])
    text_ids, _, _ = _prompt(vl, ["Just some text here."], [])
    return (ids, out, mm), text_ids


def test_one_image_matches_transformers(vl):
    ids, out, mm = _prompt(vl, [None, "What is in this picture?"], [_image(0, 32, 48)])
    llm = _llm(vl[0])
    step = llm.engine.runner.image_step
    assert step is not None and step.deepstack_levels == 2
    assert _same(_run(llm, [(ids, mm)])[0], _reference(vl, ids, out))
    assert not step.encoded


def test_two_images_split_by_chunked_prefill_and_a_text_request_beside(vl):
    (ids, out, mm), text_ids = _two_images_and_text(vl)
    llm = _llm(vl[0], max_num_batched_tokens=16, enable_chunked_prefill=True)
    got = _run(llm, [(ids, mm), (text_ids, None)])
    assert _same(got[0], _reference(vl, ids, out)) and _same(got[1], _reference(vl, text_ids, None))


def test_tensor_parallel_two_ranks_match_transformers(vl):
    """-tp 2: rank 0 encodes and broadcasts the rows with their deepstack levels beside them."""
    (ids, out, mm), text_ids = _two_images_and_text(vl)
    llm = _llm(vl[0], tensor_parallel_size=2, max_num_batched_tokens=16, enable_chunked_prefill=True)
    got = _run(llm, [(ids, mm), (text_ids, None)])
    assert _same(got[0], _reference(vl, ids, out)) and _same(got[1], _reference(vl, text_ids, None))


def test_leaving_out_the_deepstack_rows_moves_the_output(vl, monkeypatch):
    """The comparison above sees the deepstack addition: without it the logprobs leave transformers'."""
    from voltllm.worker.image_step import ImageStep

    ids, out, mm = _prompt(vl, [None, "What is in this picture?"], [_image(0, 32, 48)])
    apply = ImageStep._apply

    def without_deepstack(self, rows, extra):
        apply(self, rows, extra)
        assert extra.pop("image_deepstack", None) is not None or rows.embeds is None

    monkeypatch.setattr(ImageStep, "_apply", without_deepstack)
    assert not _same(_run(_llm(vl[0]), [(ids, mm)])[0], _reference(vl, ids, out))


def test_moe_kind_matches_transformers(tmp_path):
    """qwen3_vl_moe: its text model is a Qwen3-MoE (stacked experts stored [E, in, out], as released) with one dense
    layer; images split by chunked prefill."""
    vl = vl_setup(str(tmp_path / "moe"), "qwen3_vl_moe")
    (ids, out, mm), text_ids = _two_images_and_text(vl)
    llm = _llm(vl[0], max_num_batched_tokens=16, enable_chunked_prefill=True)
    assert llm.engine.runner.model.has_moe
    got = _run(llm, [(ids, mm), (text_ids, None)])
    assert _same(got[0], _reference(vl, ids, out)) and _same(got[1], _reference(vl, text_ids, None))


def test_dummy_weights_profile_and_kept_rows_carry_the_deepstack_levels(vl):
    """--load-format dummy builds the deepstack mergers too; memory profiling encodes through them and charges the
    kept rows at their full width (the rows and two levels)."""
    from voltllm.worker.memory import _kept_image_rows_bytes

    ids, _, mm = _prompt(vl, ["Look:", None, "and tell."], [_image(5, 32, 48)])
    llm = _llm(vl[0], load_format="dummy", max_num_batched_tokens=16, enable_chunked_prefill=True)
    runner = llm.engine.runner
    step = runner.image_step
    step.profile((1, 8, 8))
    # fp32 rows of 64 x (1 + 2 levels): the largest image's (its grid (1, 64, 64): 1,024 tokens) and a step's
    assert step.largest_grid == (1, 64, 64)
    assert _kept_image_rows_bytes(runner) == (1024 + step.capacity) * 64 * 3 * 4
    assert len(_run(llm, [(ids, mm)])[0]) == 6


def test_lora_adapters_on_the_text_model_with_an_image(vl, tmp_path):
    """PEFT adapters on Qwen3-VL's text model (its names under model.language_model), with an image in the prompt:
    the engine with the adapter equals the engine on the merged checkpoint; an adapter on the vision tower is
    refused by name."""
    import torch
    from safetensors.torch import load_file, save_file

    from lora_adapters import make_adapter, merged_copy as _merged_copy
    from vl_models import GREEDY
    from voltllm import LoRARequest
    from voltllm.engine.types import EngineCoreRequest
    from voltllm.lora.adapter import LoRAAdapterError, read_adapter

    adapter = make_adapter(str(tmp_path / "a"), vl[0], rank=4, alpha=8, seed=3, std=0.15)
    # (PEFT names a Qwen3-VL module under model.language_model)
    tensors = {k.replace("base_model.model.model.layers.", "base_model.model.model.language_model.layers."): v
               for k, v in load_file(f"{adapter}/adapter_model.safetensors").items()}
    save_file(tensors, f"{adapter}/adapter_model.safetensors")
    merged = _merged_copy(vl[0], adapter, str(tmp_path / "merged"))
    ids, _, mm = _prompt(vl, [None, "What is in this picture?"], [_image(0, 32, 48)])
    want = _run(_llm(merged), [(ids, mm)])[0]
    llm = _llm(vl[0], enable_lora=True, max_lora_rank=8)
    core = llm.engine
    core.add_request(EngineCoreRequest("l", ids, GREEDY, multi_modal=mm, lora_request=LoRARequest("a", 1, adapter)))
    got = []
    while core.has_unfinished_requests():
        for o in core.step():
            got += [(t, lp[t][0]) for t, lp in zip(o.new_token_ids, o.new_logprobs)]
    assert _same(got, want) and not _same(got, _run(_llm(vl[0]), [(ids, mm)])[0])
    save_file({"base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight": torch.zeros(4, 32)},
              f"{adapter}/adapter_model.safetensors")
    with pytest.raises(LoRAAdapterError, match="visual.blocks.0.attn.qkv.*not a projection"):
        read_adapter(LoRARequest("v", 2, adapter), llm.config.model.hf_config, 8, torch.float32)
