"""--hf-overrides: YaRN RoPE scaling set on a tiny qwen3 at start gives transformers' logits on the same overridden
config past the original context, and stretches the derived max_model_len as vLLM does."""
import pytest
import torch

from tiny_models import make_model
from voltllm import LLM, SamplingParams
from voltllm.config import ConfigError, EngineArgs

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny_yarn")), "qwen3", max_position_embeddings=128)


def _hf_logprobs(path, ids, rope=None):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    if rope is not None:
        cfg.rope_parameters = {**cfg.rope_parameters, **rope}
    ref = AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _ours(llm, ids, vocab):
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1,
                                                                 prompt_logprobs=vocab))[0]
    lp = torch.full((len(ids) - 1, vocab), float("nan"))
    for pos in range(1, len(ids)):
        for tid, v in out.prompt_logprobs[pos].items():
            lp[pos - 1, tid] = v.logprob
    return lp


def test_yarn_override_matches_transformers(tiny):
    llm = LLM(tiny, device="cpu", hf_overrides={"rope_scaling": {"type": "yarn", "factor": 4.0,
                                                                 "original_max_position_embeddings": 128}},
              max_num_batched_tokens=64, block_size=8)
    assert llm.engine.config.model.max_model_len == 512  # 128 x 4 (vLLM's rule for yarn)
    from transformers import AutoConfig

    rope = llm.engine.config.model.hf_config.rope_parameters
    theta = AutoConfig.from_pretrained(tiny).rope_parameters["rope_theta"]
    assert rope["rope_type"] == "yarn" and rope["rope_theta"] == theta  # the checkpoint's theta is kept
    vocab = llm.engine.config.model.hf_config.vocab_size
    ids = [(7 * i + 3) % (vocab - 10) + 5 for i in range(300)]  # past the original 128 positions
    ours = _ours(llm, ids, vocab)
    want = _hf_logprobs(tiny, ids, YARN)[:-1]
    assert torch.allclose(ours, want, atol=2e-4, rtol=1e-4)
    plain = _hf_logprobs(tiny, ids[:128])[:-1]  # the override does change the model
    assert not torch.allclose(ours[:127], plain, atol=1e-2)


def test_without_override_the_context_is_the_checkpoints(tiny):
    cfg = EngineArgs(model=tiny, device="cpu").create_engine_config()
    assert cfg.model.max_model_len == 128
    with pytest.raises(ConfigError, match="exceeds the model's maximum context"):
        EngineArgs(model=tiny, device="cpu", max_model_len=512).create_engine_config()


def test_bad_overrides_are_config_errors(tiny):
    with pytest.raises(ConfigError, match="rope_scaling must be an object"):
        EngineArgs(model=tiny, device="cpu", hf_overrides={"rope_scaling": 4}).create_engine_config()
    with pytest.raises(ConfigError, match="--hf-overrides must be a JSON object"):
        EngineArgs(model=tiny, device="cpu", hf_overrides="[1]").create_engine_config()
    cfg = EngineArgs(model=tiny, device="cpu", hf_overrides='{"rope_theta": 5000.0}').create_engine_config()
    assert cfg.model.hf_config.rope_parameters["rope_theta"] == 5000.0


@pytest.mark.parametrize("rope,want", [({"rope_type": "linear", "factor": 2.0}, 256),
                                       ({"rope_type": "dynamic", "factor": 2.0}, 128),  # no stretch: run-time frequencies
                                       ({"rope_type": "yarn", "factor": 3.0}, 384)])  # original: max positions
def test_derived_context_per_rope_type(tiny, rope, want):
    cfg = EngineArgs(model=tiny, device="cpu", hf_overrides={"rope_parameters": rope}).create_engine_config()
    assert cfg.model.max_model_len == want
