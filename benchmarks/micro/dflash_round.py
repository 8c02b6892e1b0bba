"""DFlash speculation's round cost on the GPU, with random weights (no real checkpoint reaches the GPU machine): the
target's plain decode step against its DFlash round (the target's context K / V write beside the step, one drafter
forward over the block, the target's K + 1 verification rows). Random weights agree on nothing, so every round emits
one token and its time is the round's cost. Projected tokens / s at the acceptance lengths the paper reports
(tokens per round tau): batch * tau / round time.

The drafter (a config only: --load-format dummy gives it random weights) takes the public drafter's layout for the
target shape (DRAFTER_LAYOUTS), else the target's own attention layout and width:
- qwen3-8b-shape: z-lab Qwen3-8B-DFlash-b16, Qwen3 layers of the target's width, block 16, reading target layers
  1, 9, 17, 25, 33; its heads (32 q / 8 kv of 128) and MLP width (12288) are taken to be the target's and its layer
  count, 5 here, is an assumption (--layers), as this script always assumed.
- qwen3.5-27b-shape: the public drafter of this class, 5 Qwen3 layers of 32 q / 8 kv heads of 128 (not the target's
  24 / 4 of 256) at hidden 5120, block 16, reading target layers 1, 16, 31, 46, 61; its MLP width is taken to be
  the target's 17408 (--intermediate). The mask token id (151669) and RoPE base are placeholders: no timing
  depends on them.
--heads / --kv-heads / --head-dim / --intermediate / --layer-ids override the layout. --v2 makes it a DFlash2
drafter (DFLASH2_KEYS: two-tap convolutions over groups of 16 channels around every sublayer, a selector of rank 256
over each row's 16 best tokens, the sizes other implementations of the public Qwen3.8-27B DFlash2 drafter use).

Engines are sized as benchmarks/micro/hybrid_spec_round.py sizes them: --max-num-seqs = batch x (K + 1). A hybrid's
state cache holds n + 1 + n x K request states for --max-num-seqs n (K checkpoint rows per slot), so at K = 15 n is
capped where those states would pass --state-gib (never below the batch; the row records n and the graph replays).
Verification graphs cover n x (K + 1) rows (cuda_graphs.decode_graph_rows), so any n >= batch keeps the target's
verification and the drafter's block on CUDA graphs: the qwen3.5-27b shape's state is ~154 MB per request, so batch 1
gets n = 16 (257 states, ~37 GiB) and batch 4 n = 17 under the default 40 GiB.

    PYTHONPATH=$PWD python3 benchmarks/micro/dflash_round.py [--target qwen3-8b-shape] [-k 15] [--batch 1,16] \\
        [--state-gib 40] [--out result.json]
"""
import argparse
import json
import os
import sys
import tempfile

import torch

from hybrid_spec_round import _free, _measure  # (this folder: the same timed runs)
from voltllm import LLM
from voltllm.bench.shapes import materialize

# the public drafters' layouts per target shape (a shape not listed: the target's own layout, 5 layers by default)
DRAFTER_LAYOUTS: dict = {
    "qwen3.5-27b-shape": {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                          "intermediate_size": 17408, "target_layer_ids": [1, 16, 31, 46, 61]},
}
TAUS = (2.0, 3.7, 5.0, 6.5)
DFLASH2_KEYS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}


def _text_config(target_dir: str) -> dict:
    with open(os.path.join(target_dir, "config.json")) as f:
        t = json.load(f)
    return t.get("text_config") or t


def write_drafter(target_dir: str, dest: str, layers: int, block: int, layout: dict | None = None,
                  v2: dict | None = None) -> str:
    """A DFlash drafter config (no weights: --load-format dummy) at the target's hidden size and vocabulary; layout
    (num_attention_heads, num_key_value_heads, head_dim, intermediate_size, target_layer_ids; each optional) replaces
    the target's attention layout and MLP width and the default layers read (default_target_layer_ids, 5 layers).
    v2: a DFlash2 drafter with these dflash_config keys."""
    t = _text_config(target_dir)
    from voltllm.engine.dflash import default_target_layer_ids

    lay = {"num_attention_heads": t["num_attention_heads"], "num_key_value_heads": t["num_key_value_heads"],
           "head_dim": t.get("head_dim", t["hidden_size"] // t["num_attention_heads"]),
           "intermediate_size": t["intermediate_size"],
           "target_layer_ids": default_target_layer_ids(t["num_hidden_layers"], 5)}
    lay.update({key: v for key, v in (layout or {}).items() if v is not None})
    cfg = {"architectures": ["DFlash2DraftModel" if v2 else "DFlashDraftModel"], "model_type": "qwen3",
           "hidden_size": t["hidden_size"],
           "intermediate_size": lay["intermediate_size"], "num_hidden_layers": layers,
           "num_attention_heads": lay["num_attention_heads"], "num_key_value_heads": lay["num_key_value_heads"],
           "head_dim": lay["head_dim"], "rms_norm_eps": t.get("rms_norm_eps", 1e-6),
           "rope_theta": t.get("rope_theta", 1e6), "max_position_embeddings": t.get("max_position_embeddings", 40960),
           "vocab_size": t["vocab_size"], "num_target_layers": t["num_hidden_layers"], "tie_word_embeddings": False,
           "block_size": block, "dflash_config": {"mask_token_id": min(151669, t["vocab_size"] - 1),
                                                  "target_layer_ids": list(lay["target_layer_ids"])} | (v2 or {})}
    out = os.path.join(dest, "dflash-drafter")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out


def state_bytes_per_request(target_dir: str, dtype: str) -> int:
    """One request's recurrent state over a hybrid target's Gated DeltaNet layers (StateCache.bytes_per_slot of the
    model's state_spec: the fp32 state [value heads, key dim, value dim] and the conv state [kernel - 1, conv width]
    in the model dtype); 0 for an attention-only target."""
    t = _text_config(target_dir)
    if "linear_num_value_heads" not in t:
        return 0
    n = t["num_hidden_layers"]
    types = t.get("layer_types") or ["full_attention" if (i + 1) % t.get("full_attention_interval", 4) == 0
                                     else "linear_attention" for i in range(n)]
    gdn = sum(kind == "linear_attention" for kind in types)
    nk, nv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    dk, dv = t["linear_key_head_dim"], t["linear_value_head_dim"]
    item = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    conv = (t.get("linear_conv_kernel_dim", 4) - 1) * (2 * nk * dk + nv * dv) * item
    return gdn * (conv + nv * dk * dv * 4)


def engine_rows(batch: int, k: int, state_bytes: int, state_budget: float) -> int:
    """--max-num-seqs for `batch` requests drafting K: rows for batch x (K + 1) tokens (hybrid_spec_round.py's
    sizing), fewer where a hybrid's n + 1 + n x K request states would pass state_budget bytes, never fewer than
    the batch."""
    n = max(batch * (k + 1), 4)
    if state_bytes:
        fit = int((state_budget // state_bytes - 1) // (k + 1))
        n = min(n, max(fit, batch))
    return n


def _engine(target: str, spec, dtype: str, rows: int) -> LLM:
    return LLM(target, load_format="dummy", skip_tokenizer_init=True, dtype=dtype, max_model_len=2048,
               max_num_seqs=rows, gpu_memory_utilization=0.85, speculative_config=spec)


def _replays(graphs) -> int | None:
    return graphs.replays if graphs is not None else None


def measure_rounds(target: str, drafter: str, batches: list[int], ks: list[int], dtype: str, output_len: int,
                   state_gib: float = 40.0, out: str | None = None, result: dict | None = None) -> dict:
    """Per batch: the plain step, then the DFlash round at each K (one engine each, a warm-up run before the timed
    one); rows added to result["rows"] (written to `out` after each batch, so a cut-off run keeps what it measured)."""
    result = result if result is not None else {"rows": []}
    state_bytes = state_bytes_per_request(target, dtype)
    budget = state_gib * 2**30
    result.update(state_bytes_per_request=state_bytes, state_gib=state_gib)
    for b in batches:
        rows = engine_rows(b, max(ks), state_bytes, budget)
        llm = _engine(target, None, dtype, rows)
        vocab = llm.engine.vocab_size
        prompts = [{"prompt_token_ids": [(37 * i + 11 * j) % min(30000, vocab - 100) + 100 for j in range(128)]}
                   for i in range(b)]
        _measure(llm, prompts, output_len)  # warm-up: Triton compiles, first-use allocations
        plain, _ = _measure(llm, prompts, output_len)
        plain.update(batch=b, max_num_seqs=rows)
        del llm  # (freed before the next engine is built: a 27B-shape engine fills --gpu-memory-utilization)
        _free()
        print(f"batch {b}: plain {plain['step_ms']:.2f} ms/step ({plain['tok_s']:.1f} tok/s)")
        for k in ks:
            rows = engine_rows(b, k, state_bytes, budget)
            llm = _engine(target, {"method": "dflash", "model": drafter, "num_speculative_tokens": k}, dtype, rows)
            _measure(llm, prompts, output_len)  # warm-up (the drafter's and the verification's kernels)
            runner = llm.engine.runner
            verify, block = runner.verify_graphs, getattr(runner.draft, "graphs", None)
            v0, b0 = _replays(verify), _replays(block)
            spec, _ = _measure(llm, prompts, output_len)
            replays = {"verify": None if v0 is None else _replays(verify) - v0,
                       "block": None if b0 is None else _replays(block) - b0}
            del runner, verify, block, llm
            _free()
            spec.update(batch=b, max_num_seqs=rows, graph_replays=replays)
            proj = {f"{tau}": round(b * tau / (spec["step_ms"] / 1e3), 1) for tau in TAUS}
            print(f"  DFlash K={k}: round {spec['step_ms']:.2f} ms ({spec['step_ms'] / plain['step_ms']:.2f}x the "
                  f"plain step; acceptance {spec['acceptance']:.2f}; --max-num-seqs {rows}, graph replays "
                  f"{replays}); projected tok/s at tau {proj}")
            result["rows"].append({"batch": b, "k": k, "plain": plain, "spec": spec, "projected_tok_s": proj})
        if out:
            with open(out, "w") as f:
                json.dump(result, f, indent=1)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen3-8b-shape", help="a named shape or a directory with a config.json")
    ap.add_argument("-k", default="15,7", help="drafts per round (block 16: at most 15)")
    ap.add_argument("--layers", type=int, default=5, help="drafter layers")
    ap.add_argument("--heads", type=int, default=None, help="drafter query heads (default: the layout's)")
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--intermediate", type=int, default=None, help="drafter MLP width")
    ap.add_argument("--layer-ids", default=None, help="target layers the drafter reads, comma-separated")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--state-gib", type=float, default=40.0,
                    help="a hybrid target's recurrent states (K checkpoint rows per request) at most this many GiB")
    ap.add_argument("--v2", action="store_true", help="a DFlash2 drafter (DFLASH2_KEYS)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    layout = dict(DRAFTER_LAYOUTS.get(args.target, {}))
    layout.update({key: v for key, v in (("num_attention_heads", args.heads), ("num_key_value_heads", args.kv_heads),
                                         ("head_dim", args.head_dim), ("intermediate_size", args.intermediate))
                   if v is not None})
    if args.layer_ids:
        layout["target_layer_ids"] = [int(x) for x in args.layer_ids.split(",")]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        target = materialize(args.target, tmp)
        drafter = write_drafter(target, tmp, args.layers, 16, layout, DFLASH2_KEYS if args.v2 else None)
        with open(os.path.join(drafter, "config.json")) as f:
            d = json.load(f)
        result = {"target": args.target, "drafter_layers": args.layers, "dtype": args.dtype, "gpu": gpu,
                  "dflash2": DFLASH2_KEYS if args.v2 else None,
                  "drafter": {key: d[key] for key in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                                      "intermediate_size", "block_size")}
                  | {"target_layer_ids": d["dflash_config"]["target_layer_ids"]}, "rows": []}
        print(f"{args.target} with a {args.layers}-layer DFlash{'2' if args.v2 else ''} drafter {result['drafter']}")
        measure_rounds(target, drafter, [int(x) for x in args.batch.split(",")], [int(x) for x in args.k.split(",")],
                       args.dtype, args.output_len, args.state_gib, args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
