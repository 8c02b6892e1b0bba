"""--mm-processor-cache-gb: processed images and videos kept by the sha256 of their bytes, least recently used out,
within the byte budget; 0 keeps nothing; the engine's processor takes the flag (and vLLM's older switch)."""
import threading

import pytest

from voltllm.config import ConfigError
from voltllm.multimodal.config import resolve_multimodal
from voltllm.multimodal.processed_cache import ProcessedCache


class _Item:
    def __init__(self, n: int):
        self.n = n


def _make(calls: list, n: int):
    def make():
        calls.append(n)
        return _Item(n)
    return make


def test_hits_by_bytes_and_kind_and_evicts_least_recent():
    cache = ProcessedCache(100)
    calls: list = []
    a = cache.get_or_make("image", b"a", _make(calls, 40), lambda v: v.n)
    assert cache.get_or_make("image", b"a", _make(calls, 40), lambda v: v.n) is a and calls == [40]
    cache.get_or_make("video", b"a", _make(calls, 40), lambda v: v.n)  # (another kind: another item)
    assert calls == [40, 40] and cache.bytes == 80
    cache.get_or_make("image", b"a", _make(calls, 40), lambda v: v.n)  # a is now the most recent
    cache.get_or_make("image", b"b", _make(calls, 40), lambda v: v.n)  # over 100: the video item goes
    assert len(cache) == 2 and cache.bytes == 80 and (cache.hits, cache.misses) == (2, 3)
    cache.get_or_make("video", b"a", _make(calls, 40), lambda v: v.n)
    assert calls == [40, 40, 40, 40]
    big = cache.get_or_make("image", b"big", _make(calls, 500), lambda v: v.n)  # larger than the budget: not kept
    assert big.n == 500 and cache.bytes <= 100 and len(cache) == 2


def test_zero_keeps_nothing_and_threads_agree():
    cache = ProcessedCache(0)
    calls: list = []
    cache.get_or_make("image", b"a", _make(calls, 1), lambda v: v.n)
    cache.get_or_make("image", b"a", _make(calls, 1), lambda v: v.n)
    assert calls == [1, 1] and len(cache) == 0
    shared = ProcessedCache(10**6)
    out = []
    threads = [threading.Thread(target=lambda i=i: out.append(shared.get_or_make(
        "image", bytes([i % 3]), _make([], 10), lambda v: v.n))) for i in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(shared) == 3 and shared.bytes == 30 and shared.hits + shared.misses == 30


def test_flags():
    assert resolve_multimodal().processor_cache_gb == 4.0  # vLLM's default
    assert resolve_multimodal(mm_processor_cache_gb=0.5).processor_cache_gb == 0.5
    assert resolve_multimodal(disable_mm_preprocessor_cache=True).processor_cache_gb == 0.0
    with pytest.raises(ConfigError, match="--mm-processor-cache-gb must be a number of GiB >= 0"):
        resolve_multimodal(mm_processor_cache_gb=-1)


def test_the_engines_processor_takes_a_resent_image_from_the_cache(tmp_path):
    """The chat path's ImageProcessor.load_image: the same bytes again are a hit (the same processed rows and content
    hash, no decode), other bytes a miss; the prompt prepared from cached items equals one prepared from PIL images."""
    import base64
    import io

    import numpy as np
    from PIL import Image
    from transformers import AutoConfig

    from vl_models import make_tiny_qwen3_5_vl
    from voltllm.multimodal.media import MediaSettings, decode_image
    from voltllm.multimodal.processor import ImageProcessor

    path = make_tiny_qwen3_5_vl(str(tmp_path / "vl"))
    processor = ImageProcessor.from_model(path, AutoConfig.from_pretrained(path))
    processor.cache = ProcessedCache(2**20)

    def url(seed):
        buf = io.BytesIO()
        rng = np.random.default_rng(seed)
        Image.fromarray(rng.integers(0, 256, (32, 48, 3), dtype=np.uint8)).save(buf, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(), buf.getvalue()

    (u0, raw0), (u1, _) = url(0), url(1)
    first = processor.load_image(u0, MediaSettings())
    assert processor.load_image(u0, MediaSettings()) is first and processor.cache.hits == 1
    other = processor.load_image(u1, MediaSettings())
    assert other.content_hash != first.content_hash and processor.cache.misses == 2
    image_id = processor.image_token_id
    cached = processor.prepare([5, image_id, 6], [first])
    fresh = processor.prepare([5, image_id, 6], [decode_image(raw0)])
    assert cached[0] == fresh[0] and cached[1].images[0].content_hash == fresh[1].images[0].content_hash
    assert (cached[1].images[0].pixel_values == fresh[1].images[0].pixel_values).all()
