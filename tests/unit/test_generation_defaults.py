"""Sampling defaults: the checkpoint's generation_config.json (--generation-config) and, merged over it key by key,
--override-generation-config (vLLM's flag), checked up front like a request's fields."""
from __future__ import annotations

import json

import pytest

from tiny_models import make_model
from voltllm.config import ConfigError, EngineArgs
from voltllm.engine.frontend import generation_defaults


def _folder(tmp_path, cfg: dict) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_file_defaults_and_override_merge(tmp_path):
    folder = _folder(tmp_path, {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_new_tokens": 99})
    assert generation_defaults(folder) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    assert generation_defaults(folder, "auto", {"temperature": 0.2}) == {"temperature": 0.2, "top_p": 0.8,
                                                                        "top_k": 20}
    assert generation_defaults(folder, "vllm", {"min_p": 0.05}) == {"min_p": 0.05}  # vllm: the override only
    greedy = _folder(tmp_path, {"do_sample": False, "temperature": 0.7})
    assert generation_defaults(greedy, "auto", {"repetition_penalty": 1.1}) == {"temperature": 0.0,
                                                                                "repetition_penalty": 1.1}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny_gen")), "qwen3")


def test_override_reaches_the_default_sampling_params(tiny):
    from voltllm import LLM

    llm = LLM(tiny, device="cpu", override_generation_config='{"temperature": 0.3, "top_k": 7}',
              num_gpu_blocks_override=16)
    sp = llm.get_default_sampling_params()
    assert (sp.temperature, sp.top_k) == (0.3, 7)


@pytest.mark.parametrize("value,match", [('{"temperature": -1}', "temperature must be a finite number >= 0"),
                                         ('{"max_tokens": 5}', "max_tokens not supported"),
                                         ("[1]", "must be a JSON object")])
def test_bad_overrides_are_refused_at_start(tiny, value, match):
    with pytest.raises(ConfigError, match=match):
        EngineArgs(model=tiny, device="cpu", override_generation_config=value).create_engine_config()


def test_generate_command_takes_the_defaults_under_its_flags(tiny, monkeypatch, capsys):
    """`voltllm generate`: flags given win, the generation config fills the rest, greedy when nothing sets a
    temperature."""
    from types import SimpleNamespace

    from voltllm import cli
    from voltllm.entrypoints.llm import LLM

    seen = []

    def fake_generate(self, prompt, params, use_tqdm=True):
        assert use_tqdm is False  # one prompt: no progress bar
        seen.append(params)
        return [SimpleNamespace(outputs=[SimpleNamespace(text="ok")])]

    monkeypatch.setattr(LLM, "generate", fake_generate)
    base = ["generate", "hi", tiny, "--device", "cpu", "--num-gpu-blocks-override", "16", "--max-tokens", "3"]
    assert cli.main(base) == 0
    assert cli.main(base + ["--override-generation-config", '{"temperature": 0.4, "top_k": 5}', "--top-k", "9"]) == 0
    assert capsys.readouterr().out.split() == ["ok", "ok"]
    plain, merged = seen
    assert plain.temperature == 0.0 and plain.max_tokens == 3
    assert merged.temperature == 0.4 and merged.top_k == 9
