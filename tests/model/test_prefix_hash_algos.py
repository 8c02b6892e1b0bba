"""--prefix-caching-hash-algo: each algorithm chains block hashes over the same parts (a reference computed here
with hashlib / the packages themselves), keeps tenants and adapters apart, and gives an engine the same prefix hits
and greedy tokens as the default; a hybrid's state snapshots hash with the KV manager's algorithm (else no
snapshot would ever be found); a missing package or an unknown name is refused before anything is loaded."""
from __future__ import annotations

import hashlib
import sys
from array import array

import pytest

from tiny_models import make_model, make_tiny_hybrid
from voltllm import SamplingParams
from voltllm.cache.prefix import HASH_ALGOS, NONE_HASH, check_hash_algo, extend_block_hashes, hash_block
from voltllm.config import ConfigError, EngineArgs

PROMPT = {"prompt_token_ids": list(range(3, 70))}
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _usable(algo: str) -> bool:
    try:
        check_hash_algo(algo)
    except ValueError:
        return False
    return True


USABLE = [a for a in HASH_ALGOS if _usable(a)]


def test_sha256_is_the_digest_of_the_chained_parts():
    tokens = [5, 6, 7, 8, 9, 10, 11, 12]
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, 4, cache_salt="tenant", algo="sha256")
    first = hashlib.sha256(NONE_HASH + array("q", tokens[:4]).tobytes() + repr(("tenant",)).encode()).digest()
    second = hashlib.sha256(first + array("q", tokens[4:]).tobytes()).digest()
    assert hashes == [first, second]
    assert len(first) == 32 and hash_block(None, tokens[:4]) != hash_block(None, tokens[:4], algo="sha256")


@pytest.mark.parametrize("algo", USABLE)
def test_every_algorithm_keeps_chains_and_tenants_apart(algo):
    def chain(tokens, **kw):
        out: list[bytes] = []
        extend_block_hashes(out, tokens, 4, algo=algo, **kw)
        return out

    a, b = chain([1, 2, 3, 4, 5, 6, 7, 8]), chain([9, 2, 3, 4, 5, 6, 7, 8])
    assert a == chain([1, 2, 3, 4, 5, 6, 7, 8, 9])  # deterministic; a partial block is not hashed
    assert a[1] != b[1], "the parent's hash is part of each block's"
    assert chain([1, 2, 3, 4], cache_salt="x") != chain([1, 2, 3, 4]) != chain([1, 2, 3, 4], lora_key=("x", 1))
    assert chain([1, 2, 3, 4], content_spans=[(0, 2, b"img")]) != chain([1, 2, 3, 4])


def test_the_cbor_and_xxhash_forms_against_their_packages():
    cbor2 = pytest.importorskip("cbor2")
    xxhash = pytest.importorskip("xxhash")
    want = cbor2.dumps([NONE_HASH, [1, 2, 3, 4], ["salt", ["lora", "a", 1]]], canonical=True)
    assert hash_block(None, [1, 2, 3, 4], ("salt", ("lora", "a", 1)), "sha256_cbor") == hashlib.sha256(want).digest()
    assert hash_block(None, [1, 2, 3, 4], ("salt", ("lora", "a", 1)), "xxhash_cbor") == xxhash.xxh3_128_digest(want)
    plain = NONE_HASH + array("q", [1, 2, 3, 4]).tobytes()
    assert hash_block(None, [1, 2, 3, 4], algo="xxhash") == xxhash.xxh3_128_digest(plain)


@pytest.mark.parametrize("algo,package", [("sha256_cbor", "cbor2"), ("xxhash", "xxhash"), ("xxhash_cbor", "xxhash")])
def test_a_missing_package_is_refused_before_loading(monkeypatch, tmp_path, algo, package):
    monkeypatch.setitem(sys.modules, package, None)  # (import raises ImportError)
    with pytest.raises(ConfigError, match=f"--prefix-caching-hash-algo {algo} needs the {package} package: "
                                          f"pip install {package}"):
        EngineArgs(model=str(tmp_path / "never-read"), device="cpu",
                   prefix_caching_hash_algo=algo).create_engine_config()


def test_an_unknown_algorithm_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="must be one of blake2b, sha256, sha256_cbor, xxhash, xxhash_cbor, got "
                                          "'md5'"):
        EngineArgs(model=str(tmp_path / "never-read"), device="cpu",
                   prefix_caching_hash_algo="md5").create_engine_config()


def _llm(path, **kw):
    from voltllm.entrypoints.llm import LLM

    return LLM(path, device="cpu", dtype="float32", enforce_eager=True, max_num_seqs=2, block_size=16, **kw)


def test_an_engine_hits_its_prefix_with_sha256(tmp_path):
    path = make_model(str(tmp_path / "tiny"), "llama")
    base = _llm(path).generate(PROMPT, GREEDY, use_tqdm=False)[0]
    llm = _llm(path, prefix_caching_hash_algo="sha256")
    first = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    again = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert llm.engine.kv.hash_algo == "sha256"
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 64
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == base.outputs[0].token_ids
    assert all(len(h) == 32 for h in llm.engine.kv.pool.cached)  # sha256 digests key the cached blocks


def test_a_hybrids_snapshots_hash_as_the_kv_manager(tmp_path):
    path = make_tiny_hybrid(str(tmp_path / "hybrid"), "qwen3_5", seed=0, gen_seed=0)
    if path is None:
        pytest.skip("this transformers has no qwen3_5")
    llm = _llm(path, skip_tokenizer_init=True, mamba_block_size=16, prefix_caching_hash_algo="sha256")
    first = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert llm.engine.runner.state_snapshots.hash_algo == "sha256"
    again = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 64 and again.outputs[0].token_ids == first.outputs[0].token_ids
