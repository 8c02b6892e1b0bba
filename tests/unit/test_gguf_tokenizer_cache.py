"""The on-disk cache of GGUF tokenizers (voltllm/model/loader/gguf_tokenizer_cache.py): a second load reads the cache
and gives the same tokenizer as the conversion (on the real SmolLM2 GGUF, and on tiny qwen2 / sentencepiece files
whose classes and flags save_pretrained alone would not carry back); changed files, broken entries and an unwritable
cache fall back to the conversion."""
import json
import logging
import os
import shutil

import pytest

from voltllm.model.loader import gguf_tokenizer_cache as gtc

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n\n",
    "Mixed CASE and   several    spaces",
    "unicode: héllo wörld, 日本語のテキスト, Ελληνικά, emoji 🦙🚀👍🏽",
    "composed \u00e9 and decomposed e\u0301",
    "<|im_start|>user\nHi there<|im_end|>\n<|endoftext|>",
    "<|im_start|><|im_start|>doubled<|im_end|x <|im_end|>",
    "code:\ndef f(x):\n    return x ** 2  # square\n",
    "digits 1234567890 and 3.14159",
    "",
    " ",
]

MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi 👋"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "  spaces\nand lines  "}],
]


def assert_same_tokenizer(fresh, cached, texts=TEXTS, messages=MESSAGES, name_or_path=None):
    assert type(cached) is type(fresh)
    assert cached.name_or_path == (fresh.name_or_path if name_or_path is None else name_or_path)
    assert json.loads(cached.backend_tokenizer.to_str()) == json.loads(fresh.backend_tokenizer.to_str())
    assert cached.get_vocab() == fresh.get_vocab() and len(cached) == len(fresh)
    assert cached.added_tokens_decoder == fresh.added_tokens_decoder
    assert cached.all_special_tokens == fresh.all_special_tokens
    for name in ("bos_token", "eos_token", "pad_token", "unk_token", "bos_token_id", "eos_token_id", "pad_token_id",
                 "unk_token_id", "add_bos_token", "add_eos_token", "chat_template"):
        assert getattr(cached, name) == getattr(fresh, name), name
    for text in texts:
        for special in (True, False):
            ids = fresh.encode(text, add_special_tokens=special)
            assert cached.encode(text, add_special_tokens=special) == ids, text
            for skip in (True, False):
                assert cached.decode(ids, skip_special_tokens=skip) == fresh.decode(ids, skip_special_tokens=skip)
    if fresh.chat_template is not None:
        for msgs in messages:
            text = fresh.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            assert cached.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == text
            assert (cached.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"]
                    == fresh.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"])


@pytest.fixture(scope="module")
def smol_fresh(smollm2_gguf):
    """SmolLM2's tokenizer as transformers converts it from the GGUF (once for the module: seconds)."""
    return gtc.build_gguf_tokenizer(smollm2_gguf)


@pytest.fixture
def builds(monkeypatch, smol_fresh):
    """Replace the conversion with one that counts its calls and hands back the converted SmolLM2 tokenizer;
    `builds.forbid()` makes any further conversion fail the test."""
    class Builds(list):
        def forbid(self):
            def fail(path):
                raise AssertionError(f"converted {path} again instead of reading the cache")
            monkeypatch.setattr(gtc, "build_gguf_tokenizer", fail)

    calls = Builds()

    def build(path):
        calls.append(path)
        return smol_fresh

    monkeypatch.setattr(gtc, "build_gguf_tokenizer", build)
    return calls


def entries(root):
    return sorted(os.listdir(root))


def test_second_load_reads_the_cache_and_matches(tmp_path, smollm2_gguf, smol_fresh, builds):
    root = str(tmp_path / "cache")
    first = gtc.load_gguf_tokenizer(smollm2_gguf, root)
    assert first is smol_fresh and len(builds) == 1
    entry = gtc.cache_entry(smollm2_gguf, root)
    assert entries(root) == [os.path.basename(entry)]  # no temporary folders left
    assert {"tokenizer.json", "tokenizer_config.json", gtc.META_FILE} <= set(os.listdir(entry))

    builds.forbid()
    cached = gtc.load_gguf_tokenizer(smollm2_gguf, root)
    assert cached is not smol_fresh
    assert_same_tokenizer(smol_fresh, cached)
    assert cached.chat_template and "<|im_start|>" in cached.chat_template
    assert cached.eos_token == "<|im_end|>" and cached.bos_token_id == 1 and cached.eos_token_id == 2


def test_load_tokenizer_uses_the_cache_under_voltllm_cache_dir(tmp_path, monkeypatch, smollm2_gguf, smol_fresh,
                                                               builds):
    from voltllm.model.loader import load_tokenizer
    from voltllm.model.loader.default_model import default_cache_dir, gguf_tokenizer_cache_dir

    monkeypatch.setenv("VOLTLLM_CACHE_DIR", str(tmp_path / "env"))
    assert default_cache_dir() == str(tmp_path / "env")
    assert gguf_tokenizer_cache_dir() == str(tmp_path / "env" / "gguf-tokenizers")
    assert load_tokenizer(smollm2_gguf) is smol_fresh
    assert entries(tmp_path / "env" / "gguf-tokenizers") == [os.path.basename(gtc.cache_entry(smollm2_gguf))]
    builds.forbid()
    assert load_tokenizer(smollm2_gguf).encode(TEXTS[4]) == smol_fresh.encode(TEXTS[4])


def test_default_root_is_beside_the_models_folder(tmp_path, monkeypatch):
    from voltllm.model.loader.default_model import default_cache_dir, gguf_tokenizer_cache_dir

    monkeypatch.delenv("VOLTLLM_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == str(tmp_path / ".cache" / "voltllm" / "models")
    assert gguf_tokenizer_cache_dir() == str(tmp_path / ".cache" / "voltllm" / "gguf-tokenizers")


def test_changed_file_is_converted_again_and_its_old_entry_pruned(tmp_path, smollm2_gguf, smol_fresh, builds):
    gguf = str(tmp_path / "model.gguf")
    shutil.copyfile(smollm2_gguf, gguf)
    root = str(tmp_path / "cache")
    gtc.load_gguf_tokenizer(gguf, root)
    gtc.load_gguf_tokenizer(gguf, root)
    assert len(builds) == 1
    old = gtc.cache_entry(gguf, root)

    st = os.stat(gguf)
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    new = gtc.cache_entry(gguf, root)
    assert new != old
    gtc.load_gguf_tokenizer(gguf, root)
    assert len(builds) == 2
    assert entries(root) == [os.path.basename(new)]  # the old file's entry can never be used again: deleted

    builds.forbid()
    assert_same_tokenizer(smol_fresh, gtc.load_gguf_tokenizer(gguf, root), texts=TEXTS[:6], messages=MESSAGES[:1],
                          name_or_path=str(tmp_path))  # the fake conversion handed back SmolLM2's from its own path


def _garbage(path):
    with open(path, "w") as f:
        f.write("{ not json")


CORRUPTIONS = {
    "tokenizer.json deleted": lambda e: os.remove(os.path.join(e, "tokenizer.json")),
    "tokenizer.json garbage": lambda e: _garbage(os.path.join(e, "tokenizer.json")),
    "chat template edited": lambda e: open(os.path.join(e, "chat_template.jinja"), "a").write("{{ 'x' }}"),
    "config garbage": lambda e: _garbage(os.path.join(e, "tokenizer_config.json")),
    "meta deleted": lambda e: os.remove(os.path.join(e, gtc.META_FILE)),
    "meta garbage": lambda e: _garbage(os.path.join(e, gtc.META_FILE)),
    "entry is a file": lambda e: (shutil.rmtree(e), _garbage(e)),
}


@pytest.mark.parametrize("corrupt", list(CORRUPTIONS))
def test_broken_entry_is_rebuilt(tmp_path, smollm2_gguf, smol_fresh, builds, corrupt, caplog):
    root = str(tmp_path / "cache")
    gtc.load_gguf_tokenizer(smollm2_gguf, root)
    entry = gtc.cache_entry(smollm2_gguf, root)
    CORRUPTIONS[corrupt](entry)

    with caplog.at_level(logging.WARNING, logger="voltllm"):
        tok = gtc.load_gguf_tokenizer(smollm2_gguf, root)
    assert tok is smol_fresh and len(builds) == 2  # converted again
    assert "unreadable" in caplog.text
    assert entries(root) == [os.path.basename(entry)]  # rewritten in place, nothing left over

    builds.forbid()
    cached = gtc.load_gguf_tokenizer(smollm2_gguf, root)
    assert_same_tokenizer(smol_fresh, cached, texts=TEXTS[:7], messages=MESSAGES[:1])


def test_unwritable_cache_still_loads(tmp_path, smollm2_gguf, smol_fresh, builds, caplog):
    (tmp_path / "file").write_text("a regular file: nothing can be made under it")
    root = str(tmp_path / "file" / "cache")
    with caplog.at_level(logging.WARNING, logger="voltllm"):
        assert gtc.load_gguf_tokenizer(smollm2_gguf, root) is smol_fresh
        assert gtc.load_gguf_tokenizer(smollm2_gguf, root) is smol_fresh
    assert len(builds) == 2
    warnings = [r for r in caplog.records if "could not cache" in r.getMessage()]
    assert len(warnings) == 1 and root in warnings[0].getMessage()  # once per process


def test_losing_a_race_keeps_the_winners_entry(tmp_path, smollm2_gguf, smol_fresh):
    root = str(tmp_path / "cache")
    stamp = gtc._stamp(os.path.abspath(smollm2_gguf))
    entry = os.path.join(root, gtc.cache_key(stamp))
    gtc._write(smol_fresh, root, entry, stamp, replace=False)
    meta = os.path.join(entry, gtc.META_FILE)
    before = os.stat(meta).st_ino
    gtc._write(smol_fresh, root, entry, stamp, replace=False)  # another process got there first
    assert os.stat(meta).st_ino == before
    assert entries(root) == [os.path.basename(entry)]  # the loser's temporary folder is gone


# Tiny GGUF files with only a tokenizer: converted in milliseconds, for what SmolLM2's file does not exercise.

def _write_gguf(path, arch, model, tokens, token_types, merges=None, scores=None, pre=None, add_bos=None,
                bos=1, eos=2, unk=0, chat_template=None):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model(model)
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_unk_token_id(unk)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if chat_template:
        w.add_chat_template(chat_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _qwen2_gguf(path):
    """A byte-level BPE qwen2 file: transformers converts it to a Qwen2Tokenizer without a normalizer, while
    Qwen2Tokenizer loaded from a tokenizer.json rebuilds itself with NFC."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    tokens = alphabet + ["Ġh", "Ġhe", "ll", "Ġhell", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]
    types = [1] * (len(tokens) - 4) + [3, 3, 3, 4]
    n = len(tokens)
    _write_gguf(path, "qwen2", "gpt2", tokens, types, merges=["Ġ h", "Ġh e", "l l", "Ġhe ll"], pre="qwen2",
                bos=n - 3, eos=n - 2, unk=n - 4,
                chat_template="{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _spm_gguf(path):
    """A sentencepiece ("llama") file that asks for a BOS: add_bos_token is True after the conversion, and
    save_pretrained does not write it."""
    pieces = ["<unk>", "<s>", "</s>", "\u2581"] + list("abcdefghijklmnopqrstuvwxyz") + \
        ["\u2581a", "\u2581b", "ab", "\u2581ab", "he", "llo", "\u2581hello"]
    types = [2, 3, 3] + [1] * (len(pieces) - 3)
    pieces += [f"<0x{i:02X}>" for i in range(256)]
    types += [6] * 256
    _write_gguf(path, "llama", "llama", pieces, types, scores=[0.0] * 3 + [-float(i) for i in range(len(pieces) - 3)],
                add_bos=True, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")


TINY_TEXTS = [" hello <think> <|im_start|>x  \n", "composed \u00e9, decomposed e\u0301, 日本", "hello ab <s>ab</s>", ""]


@pytest.mark.parametrize("make, cls, add_bos", [(_qwen2_gguf, "Qwen2Tokenizer", False),
                                               (_spm_gguf, "TokenizersBackend", True)])
def test_tiny_files_round_trip(tmp_path, monkeypatch, make, cls, add_bos):
    path = str(tmp_path / "tiny.gguf")
    make(path)
    fresh = gtc.build_gguf_tokenizer(path)
    assert type(fresh).__name__ == cls and fresh.add_bos_token is add_bos
    root = str(tmp_path / "cache")
    gtc.load_gguf_tokenizer(path, root)
    monkeypatch.setattr(gtc, "build_gguf_tokenizer", lambda p: pytest.fail(f"converted {p} again"))
    cached = gtc.load_gguf_tokenizer(path, root)
    assert cached is not fresh
    assert_same_tokenizer(fresh, cached, texts=TINY_TEXTS, messages=MESSAGES[:1])
    if add_bos:
        assert cached.encode("ab")[0] == cached.bos_token_id
