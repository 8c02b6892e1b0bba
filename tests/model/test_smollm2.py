"""The real SmolLM2-135M-Instruct GGUF: voltllm greedy == transformers greedy on the same file."""

import pytest
import torch

from voltllm import LLM, SamplingParams

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


@pytest.fixture(scope="module")
def engines(smollm2_gguf, smollm2_transformers):
    llm = LLM(smollm2_gguf, max_model_len=1024, max_num_batched_tokens=64)
    return smollm2_transformers, llm


def test_greedy_matches_transformers_on_gguf(engines):
    ref, llm = engines
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)  # EOS masked, as min_new_tokens
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
    for out in outs:
        ids = out.prompt_token_ids
        exp = ref.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert out.outputs[0].token_ids == exp[0, len(ids):].tolist(), tok.decode(ids)
    llm.engine.check_integrity()


def test_capital_of_france(engines):
    _, llm = engines
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # ends on <|im_end|> (EOS from the GGUF tokenizer)



def test_a_split_copy_of_the_file_reads_as_the_file(smollm2_gguf, tmp_path):
    """The same GGUF cut into parts as gguf-split does (the first holds metadata and tokenizer) reads as the file:
    the same config, tokenizer and weights, whichever part names it (the engine reads it through these alone)."""
    from gguf_files import split_copy

    from voltllm.model.loader import resolve_model
    from voltllm.model.loader.gguf_loader import gguf_config, gguf_weights
    from voltllm.model.loader.gguf_tokenizer_cache import build_gguf_tokenizer

    # each file's config, tokenizer and weights read one after the other: the loader keeps one file's parsed header
    # (seconds to parse) until gguf_weights is done with it, so alternating the files would parse each several times
    text = "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n"
    config, ids = gguf_config(smollm2_gguf).to_dict(), build_gguf_tokenizer(smollm2_gguf).encode(text)
    theirs = dict(gguf_weights(smollm2_gguf))
    parts = split_copy(smollm2_gguf, str(tmp_path / "smollm2.gguf"), max_tensors=100)
    assert len(parts) >= 3
    source = resolve_model(parts[-1])
    assert source.path == source.tokenizer_path == parts[0]
    assert gguf_config(parts[0]).to_dict() == config
    assert build_gguf_tokenizer(parts[0]).encode(text) == ids
    ours = dict(gguf_weights(parts[0]))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
