"""fp8 KV vs fp16 KV on a real model: teacher-forced greedy top-1 agreement over 256 tokens (CPU or GPU).

    PYTHONPATH=$PWD:$PWD/tests python benchmarks/micro/fp8_kv_agreement.py MODEL.gguf [--device cpu]

The fp16-KV engine generates 256 greedy tokens for four chat-templated prompts (with its top-2 logprobs, for
the margins); each fp8 engine (e4m3 at scale 1.0, with --calculate-kv-scales, with --calculate-key-offsets, with
both; e5m2) then replays prompt +
continuation one forward at a time through its own fp8 cache (tests/unit/_fp8_kv_interp_check.py's
teacher_forced_logits) and the argmax is compared position by position. Prints each flip's reference margin."""
import argparse
import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "unit")]
from voltllm import LLM, SamplingParams  # noqa: E402

# variant -> (--kv-cache-dtype, extra engine arguments); calibrating flags act on the engine's first forward
VARIANTS = {
    "e4m3": ("fp8_e4m3", {}),
    "e4m3-scales": ("fp8_e4m3", {"calculate_kv_scales": True}),
    "e4m3-offsets": ("fp8_e4m3", {"calculate_key_offsets": True}),
    "e4m3-offsets-scales": ("fp8_e4m3", {"calculate_key_offsets": True, "calculate_kv_scales": True}),
    "e5m2": ("fp8_e5m2", {}),
}
MESSAGES = ("What is the capital of France? Explain its history in detail.",
            "Write a Python function that checks whether a string is a palindrome, and explain it.",
            "Tell me a short story about a robot learning to paint.",
            "Explain how a hash table works.")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "unit" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    args = ap.parse_args()
    _load("_attention_interp_check")
    teacher_forced_logits = _load("_fp8_kv_interp_check").teacher_forced_logits
    kw = dict(device=args.device, dtype="float16", max_model_len=1024, num_gpu_blocks_override=80)
    ref = LLM(args.model, **kw)
    tok = ref.tokenizer
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": m}], tokenize=False,
                                           add_generation_prompt=True))["input_ids"] for m in MESSAGES]
    n = args.tokens
    refs = []
    for p in prompts:
        o = ref.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                                                 logprobs=2))[0].outputs[0]
        top2 = torch.tensor([sorted((lp.logprob for lp in pos.values()), reverse=True)[:2] for pos in o.logprobs])
        refs.append((list(o.token_ids), top2[:, 0] - top2[:, 1]))
    del ref
    for name in args.variants.split(","):
        kv, extra = VARIANTS[name]
        llm = LLM(args.model, kv_cache_dtype=kv, **extra, **kw)
        label = kv + "".join(" --" + k.replace("_", "-") for k in extra)
        accs = []
        for p, (toks, margin) in zip(prompts, refs):
            if extra:  # scales / offsets come from the engine's first real forward (the first prompt's)
                llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=1))
            got = teacher_forced_logits(llm.engine.runner, list(p) + toks, len(p))[:n]
            flips = got.argmax(-1).cpu() != torch.tensor(toks)
            accs.append(1 - flips.float().mean().item())
            print(f"  {label}: agreement {accs[-1]:.4f}; reference margins at the flips "
                  f"{[round(m, 2) for m in margin[flips].tolist()]} (median margin {margin.median():.2f})", flush=True)
        print(f"{label}: " + " ".join(f"{a:.4f}" for a in accs) + f"  mean {sum(accs) / len(accs):.4f}", flush=True)
        del llm


if __name__ == "__main__":
    main()
