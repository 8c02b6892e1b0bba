"""`voltllm bench --scenario random-mm`: vLLM's random-mm flags (bench/images.py), the requests drawn from the seed, the
vision tower's FLOPs of the limit, and end to end in process on the tiny Qwen3.5 VL checkpoint (tests/vl_models.py);
the refusals. (Against a real server: tests/server/test_images_server.py.)"""
from __future__ import annotations

import json
from collections import Counter

import pytest

from voltllm.bench.images import ImageTokens, RandomMM, draw_requests, random_mm
from voltllm.bench.inprocess import make_plans, make_run_input
from voltllm.config import ConfigError

TOKENS = ImageTokens(image=7, start=5, end=6, avoid=(5, 6, 7, 8))


# -- the flags --------------------------------------------------------------------------------------------------------
def test_defaults_are_vllms_and_zero_or_unnormalized_buckets_are_normalized():
    spec = random_mm()
    # (the 0-probability video bucket dropped)
    assert spec == RandomMM(1, 0.0, 255, ((256, 256, 0.5), (720, 1280, 0.5)))
    assert spec.items_range == (1, 1)
    literal = random_mm(3, 0.5, '{"image": 4, "video": 0}', "{(32, 48, 1): 3, (64, 64, 1): 1, (8, 8, 16): 0}")
    assert literal.buckets == ((32, 48, 0.75), (64, 64, 0.25)) and literal.image_limit == 4
    assert literal.items_range == (1, 4)  # [floor(1.5), ceil(4.5)] capped at the limit
    as_json = random_mm(buckets='{"(32, 48, 1)": 3, "(64, 64, 1)": 1}')
    assert as_json.buckets == literal.buckets
    assert random_mm(2, 1.0).items_range == (0, 4)  # r = 1 allows none


@pytest.mark.parametrize("kwargs, words", [
    (dict(buckets="{(720, 1280, 16): 1.0}"), "is a video item: voltllm takes images only"),
    (dict(buckets="{(32, 32, 1): 0, (64, 64, 1): 0.0}"), "no bucket has a probability above 0"),
    (dict(buckets="{(32, 32, 1): -1}"), "must be a number >= 0"),
    (dict(buckets="{(32, 32): 1}"), "is not a \\(height, width, num_frames\\) tuple"),
    (dict(buckets="not a dict"), "must be a dict"),
    (dict(limit='{"video": 1}'), "must give an \"image\" count"),
    (dict(limit='{"image": -1}'), "a count >= 0"),
    (dict(limit="[3]"), "must be a JSON object"),
    (dict(range_ratio=1.5), "must be in \\[0, 1\\]"),
    (dict(base_items=-1), "must be >= 0"),
    (dict(base_items=4, limit='{"image": 2}'), "needs at least 4 images per request, more than"),
])
def test_flag_refusals(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        random_mm(**kwargs)


# -- the requests -----------------------------------------------------------------------------------------------------
def test_requests_follow_the_config_and_the_seed():
    spec = random_mm(2, 0.5, '{"image": 3}', "{(32, 48, 1): 0.75, (64, 64, 1): 0.25}")
    prompts, images = draw_requests(spec, TOKENS, 400, [10] * 400, 20, seed=3)
    assert all(len(p) == 10 and not set(p) & set(TOKENS.avoid) and max(p) < 20 for p in prompts)
    counts = Counter(len(ims) for ims in images)
    assert set(counts) == {1, 2, 3} and all(c > 80 for c in counts.values())  # uniform over [1, 3]
    sizes = Counter((im.height, im.width) for ims in images for im in ims)
    assert set(sizes) == {(32, 48), (64, 64)} and 0.65 < sizes[(32, 48)] / sum(sizes.values()) < 0.85
    assert len({im.seed for ims in images for im in ims}) == sum(sizes.values())  # every image its own pixels
    again = draw_requests(spec, TOKENS, 400, [10] * 400, 20, seed=3)
    assert again == (prompts, images)
    other = draw_requests(spec, TOKENS, 400, [10] * 400, 20, seed=4)
    assert other[0] != prompts and other[1] != images
    im = images[0][0]
    assert im.pixels().shape == (im.height, im.width, 3) and (im.pixels() == im.pixels()).all()
    assert im.jpeg() == im.jpeg() and im.data_url().startswith("data:image/jpeg;base64,")


def test_runs_draw_fresh_requests_and_every_runner_the_same():
    spec = random_mm(1, 1.0, None, "{(32, 48, 1): 1}")
    plans = make_plans("random-mm", [1, 3], 12, 4, range_ratio=0.5, images=spec)
    assert [(p.scenario, p.concurrency, p.input_len, p.output_len, p.images) for p in plans] == [
        ("random-mm", 1, 12, 4, spec), ("random-mm", 3, 12, 4, spec)]
    plan = plans[1].__class__(**{**plans[1].__dict__, "image_tokens": TOKENS})
    w0, w0b, w1 = (make_run_input(plan, 50, 0, i) for i in (0, 0, 1))
    assert (w0.prompts, w0.images, w0.output_lens) == (w0b.prompts, w0b.images, w0b.output_lens)
    assert w0.prompts != w1.prompts
    assert all(6 <= len(p) <= 18 for p in w0.prompts) and all(2 <= n <= 6 for n in w0.output_lens)
    assert make_plans("random-mm", None, None, None)[0].images == random_mm()  # (C 1, 4, 16; 128 / 128)
    assert [p.concurrency for p in make_plans("random-mm", None)] == [1, 4, 16]
    with pytest.raises(ValueError, match="needs the model's image token ids"):
        make_run_input(plans[0], 50, 0, 0)


# -- the limit: the tower's FLOPs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_vl", "qwen2_5_vl", "qwen2_vl"])
def test_tower_flops_count_the_towers_matmuls_and_attention(kind):
    """(Qwen2.5-VL's: the windowed block's attention over windows of several sizes, the other's over the frame)"""
    from types import SimpleNamespace

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from vl_models import QWEN2_5_VL_VISION, QWEN2_VL_VISION, QWEN3_VL_VISION, VL_VISION
    from voltllm.bench.limits import tower_flops
    from voltllm.multimodal.vision_tower import vision_tower_for

    vision = dict({"qwen3_vl": QWEN3_VL_VISION, "qwen2_5_vl": QWEN2_5_VL_VISION, "qwen2_vl": QWEN2_VL_VISION}.get(
        kind, VL_VISION))
    tower = vision_tower_for(SimpleNamespace(vision_config=vision), torch.float32)
    for grid in [(1, 8, 12), (1, 16, 16), (2, 4, 8), (1, 10, 14)]:
        pixels = torch.randn(grid[0] * grid[1] * grid[2], tower.patch_dim)
        # (the math SDPA, whose matmuls the counter sees: it counts no fused CPU attention kernel)
        with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            tower.forward_with_deepstack(pixels, [grid])
        assert tower_flops(vision, grid) == counter.get_total_flops(), grid


# -- end to end in process on the tiny Qwen3.5 VL checkpoint ----------------------------------------------------------
@pytest.fixture(scope="module")
def vl_path(tmp_path_factory):
    from vl_models import make_tiny_qwen3_5_vl

    return make_tiny_qwen3_5_vl(str(tmp_path_factory.mktemp("vl")))


IMAGE_FLAGS = ("--scenario", "random-mm", "--random-mm-bucket-config", "{(32, 48, 1): 0.5, (64, 64, 1): 0.5}",
               "--random-mm-base-items-per-request", "2", "--random-mm-num-mm-items-range-ratio", "0.5",
               "--input-len", "12", "--output-len", "3")


def _bench(model: str, out, name: str, *flags: str) -> dict:
    """`voltllm bench` on a model path (or "--random-weights DIR": one argument) and its result file."""
    from voltllm.bench.cli import main

    assert main([*model.split(" ", 1), "--device", "cpu", "--max-model-len", "512", "--output-dir", str(out), "--name",
                 name, "--commit", "abc", "--num-warm", "1", *flags]) == 0
    with open(out / f"{name}.json") as f:
        return json.load(f)


def test_random_mm_in_process_runs_the_images_through_the_engine(vl_path, tmp_path):
    res = _bench(vl_path, tmp_path, "mm", *IMAGE_FLAGS, "--concurrency", "1,2", "--limit-copy-mib", "2",
                 "--limit-matmul-n", "64", "--limit-iters", "2")
    tokens = {(32, 48): 24, (64, 64): 64}  # grids (1, 8, 12) and (1, 16, 16), 2 x 2 merged
    assert res["config"]["random_mm"]["images_per_request_range"] == [1, 3]
    runs = res["metrics"]["runs"]
    assert len(runs) == 4
    for run in runs:
        assert len(run["requests"]) == run["concurrency"] and run["images"]["buckets"][0]["height"] == 32
        assert 1 <= min(r["images"] for r in run["requests"]) and max(r["images"] for r in run["requests"]) <= 3
        for r in run["requests"]:  # text + per image start, its tokens, end
            assert r["prompt_tokens"] == 12 + r["image_tokens"] + 2 * r["images"] and r["output_tokens"] == 3
            assert r["image_tokens"] in {a + b for a in tokens.values() for b in [0, *tokens.values()]} | {
                a + b + c for a in tokens.values() for b in tokens.values() for c in tokens.values()}
        images = sum(r["images"] for r in run["requests"])
        assert len(run["tower_ms"]) == images and len(run["processor_ms"]) == images  # one encode per image
        m = run["metrics"]
        assert m["images_per_request"] == images / len(run["requests"])
        assert m["vision_tower_ms"] > 0 and m["image_processor_ms"] > 0 and m["ttft_ms"] > 0
    table = {(r["metric"], r["concurrency"]): r for r in res["metrics"]["table"]}
    assert {"images_per_request", "image_tokens_per_request", "vision_tower_ms", "ttft_ms",
            "concurrent_decode_tok_s"} <= {k for k, _ in table}
    cost = res["limit"]["image_cost"]
    assert {k: b["tokens"] for k, b in cost["buckets"].items()} == {"32x48": 24, "64x64": 64}
    assert cost["prompt_tokens_per_image"] == 0.5 * (24 + 2) + 0.5 * (64 + 2) and cost["images_per_request"] == 2
    assert table[("ttft_ms", 1)]["limit"] > 0 and table[("vision_tower_ms", 2)]["limit"] > 0
    assert table[("ttft_ms", 2)]["limit"] is None  # (a limit at C = 1 only)
    assert res["metrics"]["random_mm"]["2"]["images_per_request"] == table[("images_per_request", 2)]["median"]


def test_the_tower_timer_leaves_nothing_behind():
    from voltllm.bench.images import TowerTimer

    class Step:
        def _encode(self, pixels, grid):
            return pixels

    step = Step()
    with TowerTimer(step, "cpu") as timer:
        assert step._encode(1, None) == 1 and step._encode(2, None) == 2
    assert len(timer.since(0)) == 2 and timer.since(1) == timer.since(0)[1:]
    assert "_encode" not in vars(step)  # the class's method again: an engine the bench does not time pays nothing


def test_random_mm_refusals(vl_path, tmp_path):
    from transformers import Qwen3Config

    text_only = tmp_path / "text"
    Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=1024).save_pretrained(text_only)
    with pytest.raises(ConfigError, match="random-mm sends images, which this engine does not take: this server "
                                          "serves a text-only model"):
        _bench(f"--random-weights {text_only}", tmp_path, "x", *IMAGE_FLAGS)
    with pytest.raises(ConfigError, match="--random-mm-bucket-config shape the images of --scenario random-mm, not "
                                          "--scenario decode"):
        _bench(vl_path, tmp_path, "x", "--random-mm-bucket-config", "{(8, 8, 1): 1}")
    with pytest.raises(ConfigError, match="--baseline"):
        _bench(vl_path, tmp_path, "x", *IMAGE_FLAGS, "--baseline", "hf")
    with pytest.raises(ConfigError, match="up to 3 images, more than the engine's --limit-mm-per-prompt image 2"):
        _bench(vl_path, tmp_path, "x", *IMAGE_FLAGS, "--limit-mm-per-prompt", '{"image": 2}', "--no-limits")
    with pytest.raises(ConfigError, match="needs 213 tokens .* more than --max-model-len 200"):
        _bench(vl_path, tmp_path, "x", *IMAGE_FLAGS, "--max-model-len", "200", "--no-limits")


def test_requests_without_images_among_ones_with(vl_path, tmp_path):
    """r = 1 allows 0 images: such a request is plain text through the same path (no MultiModalPrompt)."""
    res = _bench(vl_path, tmp_path, "mm0", "--scenario", "random-mm", "--random-mm-bucket-config", "{(32, 48, 1): 1}",
                 "--random-mm-num-mm-items-range-ratio", "1", "--input-len", "8", "--output-len", "2",
                 "--concurrency", "6", "--no-limits")
    counts = [r["images"] for run in res["metrics"]["runs"] for r in run["requests"]]
    assert set(counts) == {0, 1, 2}
    for run in res["metrics"]["runs"]:
        for r in run["requests"]:
            assert r["image_tokens"] == 24 * r["images"] and r["prompt_tokens"] == 8 + 26 * r["images"]
        assert len(run["processor_ms"]) == len(run["tower_ms"]) == sum(r["images"] for r in run["requests"])
