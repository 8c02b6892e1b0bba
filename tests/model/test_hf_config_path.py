"""--hf-config-path (vLLM's): the model's config from another directory / .json file, checked to describe the same
network. Reference: the same engine with the model's own config edited the same way (a copy of the directory, or
--hf-overrides on a GGUF file), token for token."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from gguf_files import tiny_qwen2_gguf_config, write_tiny_qwen2_gguf
from tiny_models import make_model
from voltllm import SamplingParams
from voltllm.config import ConfigError, EngineArgs

PROMPT = {"prompt_token_ids": [5, 17, 3, 60, 22, 9, 41, 8, 13]}
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _llm(path, **kw):
    from voltllm.entrypoints.llm import LLM

    return LLM(path, device="cpu", dtype="float32", enforce_eager=True, max_num_seqs=1, **kw)


def _tokens(llm) -> list:
    return llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _edited_config(src_dir: str, dst_dir: str, **fields) -> str:
    os.makedirs(dst_dir, exist_ok=True)
    with open(os.path.join(src_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(fields)
    with open(os.path.join(dst_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst_dir


def test_a_directory_or_json_file_replaces_the_models_config(tmp_path):
    model = make_model(str(tmp_path / "tiny"), "llama")
    other = _edited_config(model, str(tmp_path / "other"), rms_norm_eps=0.5, max_position_embeddings=300)
    edited_copy = str(tmp_path / "copy")
    shutil.copytree(model, edited_copy)
    _edited_config(other, edited_copy)
    want = _tokens(_llm(edited_copy))
    for given in (other, os.path.join(other, "config.json")):
        llm = _llm(model, hf_config_path=given)
        assert llm.engine.config.model.hf_config.rms_norm_eps == 0.5
        assert llm.engine.config.model.max_model_len == 300
        assert _tokens(llm) == want
    assert _tokens(_llm(model)) != want, "the edit must change the output, else this test shows nothing"


def test_another_network_is_refused_before_loading(tmp_path):
    model = make_model(str(tmp_path / "tiny"), "llama")
    deeper = _edited_config(model, str(tmp_path / "deeper"), num_hidden_layers=5, hidden_size=48)
    with pytest.raises(ConfigError, match=r"--hf-config-path .*deeper describes another network than the model: "
                                          r"hidden_size 48 \(the model's: \d+\); num_hidden_layers 5 \(the model's: "):
        EngineArgs(model=model, device="cpu", hf_config_path=deeper).create_engine_config()
    qwen = make_model(str(tmp_path / "qwen"), "qwen3")
    with pytest.raises(ConfigError, match="model_type 'qwen3' \\(the model's: 'llama'\\)"):
        EngineArgs(model=model, device="cpu", hf_config_path=qwen).create_engine_config()
    quantized = _edited_config(model, str(tmp_path / "awq"),
                               quantization_config={"quant_method": "awq", "bits": 4, "group_size": 128})
    with pytest.raises(ConfigError, match="quantization awq \\(the model's: none\\)"):
        EngineArgs(model=model, device="cpu", hf_config_path=quantized).create_engine_config()


@pytest.mark.parametrize("given,message", [
    ("/nonexistent-config-dir", "no such file or directory"),
    ("{tmp}/notes.txt", "give a directory holding config.json, a config .json file or a Hub repo id"),
    ("{tmp}/empty", "not a readable Hugging Face config"),
])
def test_unreadable_paths(tmp_path, given, message):
    model = make_model(str(tmp_path / "tiny"), "llama")
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=message):
        EngineArgs(model=model, device="cpu",
                   hf_config_path=given.format(tmp=tmp_path)).create_engine_config()


def test_a_gguf_file_with_its_original_config(tmp_path):
    gguf_path = write_tiny_qwen2_gguf(str(tmp_path / "tiny-qwen2.gguf"))
    original = str(tmp_path / "original")
    cfg = tiny_qwen2_gguf_config()
    cfg.rms_norm_eps = 0.25
    cfg.max_position_embeddings = 384
    cfg.save_pretrained(original)
    llm = _llm(gguf_path, skip_tokenizer_init=True, hf_config_path=original)
    assert llm.engine.config.model.hf_config.rms_norm_eps == 0.25 and llm.engine.config.model.max_model_len == 384
    want = _tokens(_llm(gguf_path, skip_tokenizer_init=True,
                        hf_overrides={"rms_norm_eps": 0.25, "max_position_embeddings": 384}))
    assert _tokens(llm) == want
    wrong = str(tmp_path / "wrong")
    cfg.intermediate_size = 512
    cfg.save_pretrained(wrong)
    with pytest.raises(ConfigError, match=r"intermediate_size 512 \(the model's: 256\)"):
        EngineArgs(model=gguf_path, device="cpu", skip_tokenizer_init=True,
                   hf_config_path=wrong).create_engine_config()
