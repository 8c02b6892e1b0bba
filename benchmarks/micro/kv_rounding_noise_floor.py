"""How far any 8-bit KV format can get on a model: teacher-forced greedy top-1 agreement with the fp16 KV cache when
K and V are rounded through bf16 (8 significant bits), fp8 e4m3 (4) or e5m2 (3) before attention (CPU).

    PYTHONPATH=$PWD:$PWD/tests python benchmarks/micro/kv_rounding_noise_floor.py [--model tiny-qwen3 | PATH]

tiny-qwen3 is the random qwen3 of tests/model/test_fp8_kv_engine.py (tests/tiny_models.make_model). The fp16
engine generates `--tokens` greedy tokens per prompt; the same engine then replays prompt + continuation one
forward at a time (tests/unit/_fp8_kv_interp_check.teacher_forced_logits) with a backend that rounds K / V
through the format (torch's casts; test_engine_fp8_equals_fake_quant_reference shows the engine's e4m3 / e5m2
caches at scale 1 give exactly these logits). Prints agreement per prompt and format, and the reference's
median top-1 / top-2 logit margin: where bf16 itself flips more than 1% of the tokens, no 8-bit format reaches
99%."""
import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "unit")]
from voltllm import LLM, SamplingParams  # noqa: E402
from voltllm.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from fp8_kv_agreement import _load  # noqa: E402  (the test-helper loader)

FORMATS = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
PROMPTS = ("The quick brown fox jumps over the lazy dog. What is", "Once upon a time", "def main():", "1 2 3 4 5")


class RoundedKV(TorchReferenceBackend):
    """The reference backend over K / V rounded through `fmt` (scale 1)."""

    def __init__(self, fmt: torch.dtype):
        super().__init__()
        self.fmt = fmt

    def forward(self, q, k, v, kv_cache, meta, scale, k_scale=None, v_scale=None, kv_written=False):
        k = k.float().to(self.fmt).to(k.dtype)
        v = v.float().to(self.fmt).to(v.dtype)
        return super().forward(q, k, v, kv_cache, meta, scale, kv_written=kv_written)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-qwen3")
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    _load("_attention_interp_check")
    teacher_forced_logits = _load("_fp8_kv_interp_check").teacher_forced_logits
    model = args.model
    if model == "tiny-qwen3":
        from tiny_models import make_model
        model = make_model(tempfile.mkdtemp(prefix="noise-floor-"), "qwen3", max_position_embeddings=1024)
    llm = LLM(model, device="cpu", dtype="float16", max_model_len=1024, num_gpu_blocks_override=80)
    runner = llm.engine.runner
    means = {f: [] for f in FORMATS}
    for text in PROMPTS:
        prompt = llm.tokenizer(text)["input_ids"]
        gen = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=args.tokens,
                                                                       ignore_eos=True))[0].outputs[0].token_ids
        seq, n = list(prompt) + list(gen), len(gen)
        ref = teacher_forced_logits(runner, seq, len(prompt))[:n]
        top2 = ref.topk(2, dim=-1).values
        row = []
        for name, fmt in FORMATS.items():
            got = teacher_forced_logits(runner, seq, len(prompt), backend=RoundedKV(fmt))[:n]
            agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
            means[name].append(agree)
            row.append(f"{name} {agree:.4f}")
        print(f"{text[:24]!r:28} median margin {(top2[:, 0] - top2[:, 1]).median().item():.3f}  " + "  ".join(row))
    print("mean over prompts: " + "  ".join(f"{k} {sum(v) / len(v):.4f}" for k, v in means.items()))


if __name__ == "__main__":
    main()
