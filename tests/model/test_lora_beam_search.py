"""LLM.beam_search with LoRA adapters (CPU, a tiny random llama and random PEFT adapters): every prompt's best beams
equal a plain beam search over transformers' logprobs with its adapter merged (W + scaling * B A), whether one adapter
serves every prompt or each prompt names its own (or none); they differ from the base model's; the beams' prefix-cache
blocks are the adapter's own (a base-model search first does not change the adapter's answer)."""
from __future__ import annotations

import pytest

from beam_reference import Reference
from lora_adapters import make_adapter, merged_model
from tiny_models import make_model
from voltllm import LLM, BeamSearchParams, LoRARequest

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["The quick brown fox", "What is the capital of France?", "def add(a, b):"]
PARAMS = BeamSearchParams(beam_width=3, max_tokens=5)


class Setup:
    def __init__(self, root):
        self.model = make_model(f"{root}/llama", "llama", max_position_embeddings=128)
        self.paths = {"a1": make_adapter(f"{root}/a1", self.model, rank=8, alpha=16, seed=1),
                      "a2": make_adapter(f"{root}/a2", self.model, rank=4, alpha=8, seed=2,
                                         targets=("q_proj", "v_proj", "down_proj"))}
        self.requests = {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(self.paths.items(), 1)}
        self.references = {name: Reference(merged_model(self.model, None if name is None else self.paths[name]))
                           for name in (None, "a1", "a2")}
        self.llm = LLM(self.model, device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4,
                       num_gpu_blocks_override=256, max_num_seqs=16)

    def lora(self, name):
        return None if name is None else self.requests[name]

    def expected(self, name, prompt):
        ids = self.llm.get_tokenizer().encode(prompt)
        return self.references[name].search(ids, PARAMS.beam_width, PARAMS.max_tokens, set(self.llm.frontend.eos_ids))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return Setup(str(tmp_path_factory.mktemp("lora-beam")))


def _check(setup, outs, names):
    for prompt, name, out in zip(PROMPTS, names, outs):
        want = setup.expected(name, prompt)
        assert [s.tokens for s in out.sequences] == [t for t, _ in want], (prompt, name)
        for seq, (_, cum) in zip(out.sequences, want):
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)


def test_one_adapter_for_every_prompt_gives_the_merged_models_beams(setup):
    base = setup.llm.beam_search(PROMPTS, PARAMS)  # first: its cached blocks must not serve the adapter's steps
    _check(setup, base, [None] * 3)
    hits = setup.llm.engine.stats().prefix_cache_hits
    adapted = setup.llm.beam_search(PROMPTS, PARAMS, lora_request=setup.lora("a1"))
    _check(setup, adapted, ["a1"] * 3)
    assert [[s.tokens for s in o.sequences] for o in adapted] != [[s.tokens for s in o.sequences] for o in base]
    assert setup.llm.engine.stats().prefix_cache_hits > hits  # the adapter's later steps read its own blocks
    setup.llm.engine.check_integrity()


def test_one_adapter_per_prompt(setup):
    names = ["a2", None, "a1"]
    outs = setup.llm.beam_search(PROMPTS, PARAMS, lora_request=[setup.lora(n) for n in names], concurrency_limit=2)
    _check(setup, outs, names)


def test_bad_lora_requests_are_refused(setup, tmp_path):
    with pytest.raises(ValueError, match="3 prompts but 2 lora requests"):
        setup.llm.beam_search(PROMPTS, PARAMS, lora_request=[None, None])
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest"):
        setup.llm.beam_search(PROMPTS, PARAMS, lora_request="a1")
    plain = LLM(setup.model, device="cpu", block_size=4)
    with pytest.raises(ValueError, match="lora_request: LoRA is not enabled"):
        plain.beam_search(PROMPTS, PARAMS, lora_request=setup.lora("a1"))
