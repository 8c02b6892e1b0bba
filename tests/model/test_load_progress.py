"""--use-tqdm-on-load (vLLM's, on by default): a bar on stderr over a checkpoint's safetensors shards (a GGUF file's
tensors) while the weights load, none with --no-use-tqdm-on-load; the weights are the same either way."""
from __future__ import annotations

import glob
import os

import pytest
import torch

from tiny_models import make_model
from voltllm import SamplingParams

PROMPT = {"prompt_token_ids": list(range(3, 20))}
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _two_shards(path: str) -> str:
    """The model's one safetensors file split in two (the loader reads every *.safetensors of the directory)."""
    from safetensors.torch import load_file, save_file

    (single,) = glob.glob(os.path.join(path, "*.safetensors"))
    tensors = load_file(single)
    names = sorted(tensors)
    os.remove(single)
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        save_file({n: tensors[n] for n in part}, os.path.join(path, f"model-0000{i + 1}-of-00002.safetensors"),
                  metadata={"format": "pt"})
    return path


def _generate(path: str, **kw):
    from voltllm.entrypoints.llm import LLM

    llm = LLM(path, device="cpu", dtype="float32", enforce_eager=True, max_num_seqs=1, **kw)
    return llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_a_bar_over_the_shards_by_default_and_none_when_off(tmp_path, capfd):
    path = _two_shards(make_model(str(tmp_path / "tiny"), "llama"))
    capfd.readouterr()
    with_bar = _generate(path)
    err = capfd.readouterr().err
    assert "Loading safetensors checkpoint shards" in err and "2/2" in err, err
    without = _generate(path, use_tqdm_on_load=False)
    assert "Loading safetensors checkpoint shards" not in capfd.readouterr().err
    assert with_bar == without


def test_a_gguf_files_tensors(tmp_path, capfd):
    pytest.importorskip("gguf")
    from transformers import LlamaConfig

    from gguf_files import writer_with_header
    from voltllm.model.loader.gguf_loader import gguf_weights

    cfg = LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=12, head_dim=4)
    path = str(tmp_path / "t.gguf")
    w = writer_with_header(path, "llama", cfg)
    g = torch.Generator().manual_seed(0)
    want = {"token_embd.weight": torch.randn(12, 8, generator=g), "output_norm.weight": torch.randn(8, generator=g),
            "blk.0.attn_norm.weight": torch.randn(8, generator=g)}
    for name, t in want.items():
        w.add_tensor(name, t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    capfd.readouterr()
    shown = dict(gguf_weights(path, cfg, progress=True))
    err = capfd.readouterr().err
    assert "Loading GGUF tensors" in err and "3/3" in err, err
    quiet = dict(gguf_weights(path, cfg))
    assert "Loading GGUF tensors" not in capfd.readouterr().err
    assert shown.keys() == quiet.keys() and len(shown) == 3
    assert all(torch.equal(shown[n], quiet[n]) for n in shown)
    assert torch.equal(shown["model.embed_tokens.weight"], want["token_embd.weight"])
