"""--kv-offloading-size / --kv-offloading-backend (vLLM's): parsed into CacheConfig, refused clearly where the CPU tier
cannot run (another backend, a size that is not > 0, prefix caching off, a hybrid without snapshots, more than the
host has)."""
from __future__ import annotations

import pytest

from flag_parsing import parse_engine_flags as _parse
from tiny_models import make_model, make_tiny_hybrid
from voltllm.config import ConfigError, EngineArgs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny_offload")), "llama")


@pytest.fixture(autouse=True)
def roomy_host(monkeypatch):
    """The sizes below fit whatever this machine has free (a test may say otherwise)."""
    import voltllm.cache.cpu_offload as cpu_offload

    monkeypatch.setattr(cpu_offload, "host_available_bytes", lambda: 64 << 30)


def test_flags_parse_into_the_cache_config(tiny):
    cache = _parse(tiny, "--device", "cpu", "--kv-offloading-size", "2.5", "--kv-offloading-backend",
                   "native").create_engine_config().cache
    assert cache.kv_offloading_size == 2.5 and cache.kv_offloading_backend == "native"
    cache = _parse(tiny, "--device", "cpu", "--kv_offloading_size", "1").create_engine_config().cache
    assert cache.kv_offloading_size == 1.0 and cache.kv_offloading_backend == "native"  # vLLM's default backend
    assert _parse(tiny, "--device", "cpu").create_engine_config().cache.kv_offloading_size is None


def test_the_flags_left_the_unbuilt_table():
    from voltllm.cli_unbuilt import UNBUILT_FLAGS

    assert "--kv-offloading-size" not in UNBUILT_FLAGS and "--kv-offloading-backend" not in UNBUILT_FLAGS


@pytest.mark.parametrize("kw,match", [
    (dict(kv_offloading_size=4, kv_offloading_backend="lmcache"),
     "--kv-offloading-backend lmcache: the LMCache connector is not built; native"),
    (dict(kv_offloading_backend="lmcache"), "--kv-offloading-backend lmcache"),
    (dict(kv_offloading_size=4, kv_offloading_backend="disk"), "--kv-offloading-backend disk: not a backend"),
    (dict(kv_offloading_size=0), r"--kv-offloading-size must be a number of GiB > 0, got 0"),
    (dict(kv_offloading_size=-1.5), r"--kv-offloading-size must be a number of GiB > 0, got -1.5"),
    (dict(kv_offloading_size=float("nan")), r"--kv-offloading-size must be a number of GiB > 0"),
    (dict(kv_offloading_size=1, enable_prefix_caching=False),
     "--kv-offloading-size: the CPU tier keeps prefix-cache blocks, and --no-enable-prefix-caching turns the prefix "
     "cache off"),
])
def test_refusals_name_the_flag(tiny, kw, match):
    with pytest.raises(ConfigError, match=match):
        EngineArgs(model=tiny, device="cpu", **kw).create_engine_config()


def test_more_than_the_host_has_is_refused(tiny, monkeypatch):
    import voltllm.cache.cpu_offload as cpu_offload

    monkeypatch.setattr(cpu_offload, "host_available_bytes", lambda: 3 << 30)
    with pytest.raises(ConfigError, match=r"--kv-offloading-size 4 GiB: this host has 3\.0 GiB of memory available"):
        EngineArgs(model=tiny, device="cpu", kv_offloading_size=4).create_engine_config()
    assert EngineArgs(model=tiny, device="cpu", kv_offloading_size=2).create_engine_config().cache.kv_offloading_size


def test_hybrid_models_take_it_unless_they_keep_no_snapshots(tmp_path):
    """A hybrid's prefix hits resume from recurrent-state snapshots (--mamba-cache-mode align, the default): the CPU
    tier keeps those too. --mamba-cache-mode none keeps none, so there is no prefix cache to extend."""
    path = make_tiny_hybrid(str(tmp_path / "hybrid"), "qwen3_5", seed=0, gen_seed=0)
    if path is None:
        pytest.skip("this transformers has no qwen3_5")
    config = EngineArgs(model=path, device="cpu", kv_offloading_size=1, skip_tokenizer_init=True).create_engine_config()
    assert config.cache.kv_offloading_size == 1
    with pytest.raises(ConfigError, match="--kv-offloading-size: --mamba-cache-mode none keeps no recurrent-state"):
        EngineArgs(model=path, device="cpu", kv_offloading_size=1, skip_tokenizer_init=True,
                   mamba_cache_mode="none").create_engine_config()


def test_mean_pooling_models_are_refused(tiny):
    with pytest.raises(ConfigError, match="MEAN / CLS pooling turns prefix caching off"):
        EngineArgs(model=tiny, device="cpu", runner="pooling", pooler_config={"pooling_type": "MEAN"},
                   kv_offloading_size=1).create_engine_config()


def test_the_cli_exits_2_with_the_message(tiny, capsys):
    from voltllm.cli import main

    assert main(["generate", "hi", tiny, "--device", "cpu", "--kv-offloading-size", "1",
                 "--kv-offloading-backend", "lmcache"]) == 2
    err = capsys.readouterr().err
    assert err.strip().startswith("voltllm: error: --kv-offloading-backend lmcache: the LMCache connector is not "
                                  "built"), err
