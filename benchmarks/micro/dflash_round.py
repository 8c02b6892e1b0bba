"""DFlash speculation's round cost on the GPU, with random weights (no real checkpoint reaches the GPU machine): the
target's plain decode step against its DFlash round (the target's context K / V write beside the step, one drafter
forward over the block, the target's K + 1 verification rows). Random weights agree on nothing, so every round emits
one token and its time is the round's cost. The drafter has the public Qwen3-8B drafter's shape (z-lab
Qwen3-8B-DFlash-b16: Qwen3 layers of the target's width, block 16, reading target layers 1, 9, 17, 25, 33; its layer
count, 5 here, is an assumption: --layers). Projected tokens / s at the acceptance lengths the paper reports
(tokens per round tau): batch * tau / round time.

    PYTHONPATH=$PWD python3 benchmarks/micro/dflash_round.py [--target qwen3-8b-shape] [-k 15] [--batch 1,16]
"""
import argparse
import json
import os
import sys
import tempfile

import torch

from draft_model_round import measure  # (this folder: the same plain / speculative run measured)
from voltllm.bench.shapes import materialize


def write_drafter(target_dir: str, dest: str, layers: int, block: int) -> str:
    """A DFlash drafter config (no weights: --load-format dummy) of the target's width."""
    with open(os.path.join(target_dir, "config.json")) as f:
        t = json.load(f)
    from voltllm.engine.dflash import default_target_layer_ids

    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": t["hidden_size"],
           "intermediate_size": t["intermediate_size"], "num_hidden_layers": layers,
           "num_attention_heads": t["num_attention_heads"], "num_key_value_heads": t["num_key_value_heads"],
           "head_dim": t.get("head_dim", t["hidden_size"] // t["num_attention_heads"]),
           "rms_norm_eps": t.get("rms_norm_eps", 1e-6), "rope_theta": t.get("rope_theta", 1e6),
           "max_position_embeddings": t.get("max_position_embeddings", 40960), "vocab_size": t["vocab_size"],
           "num_target_layers": t["num_hidden_layers"], "tie_word_embeddings": False, "block_size": block,
           "dflash_config": {"mask_token_id": min(151669, t["vocab_size"] - 1),
                             "target_layer_ids": default_target_layer_ids(t["num_hidden_layers"], 5)}}
    out = os.path.join(dest, "dflash-drafter")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen3-8b-shape")
    ap.add_argument("-k", default="15,7", help="drafts per round (block 16: at most 15)")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = {"target": args.target, "drafter_layers": args.layers, "dtype": args.dtype,
              "gpu": torch.cuda.get_device_name(), "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        target = materialize(args.target, tmp)
        drafter = write_drafter(target, tmp, args.layers, 16)
        for b in (int(x) for x in args.batch.split(",")):
            plain = measure(target, None, b, args.dtype, args.output_len)
            print(f"batch {b}: {args.target} plain {plain['step_ms']:.2f} ms/step ({plain['tok_s']:.0f} tok/s)")
            for k in (int(x) for x in args.k.split(",")):
                spec = measure(target, {"method": "dflash", "model": drafter, "num_speculative_tokens": k}, b,
                               args.dtype, args.output_len)
                proj = {f"{tau}": round(b * tau / (spec["step_ms"] / 1e3), 1) for tau in (2.0, 3.7, 5.0, 6.5)}
                print(f"  DFlash K={k}: round {spec['step_ms']:.2f} ms ({spec['step_ms'] / plain['step_ms']:.2f}x the "
                      f"plain step; acceptance {spec['acceptance']:.2f}); projected tok/s at tau {proj}")
                result["rows"].append({"k": k, "plain": plain, "spec": spec, "projected_tok_s": proj})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
