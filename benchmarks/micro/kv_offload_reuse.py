"""What --kv-offloading-size saves: time to first token of a long prompt seen before, whose prefix-cache blocks were
evicted from the GPU by another prompt, against computing it again and against a GPU prefix hit; one engine.

    PYTHONPATH=$PWD python3 benchmarks/micro/kv_offload_reuse.py [--shape qwen3-8b-shape] [--input-len 16384]
        [--runs 3] [--offload-gib 16] [--device cuda]

Random weights of a named shape, fp16, prefix caching on, a GPU pool of input-len + 4 blocks (so a second prompt
evicts the first's blocks) and a CPU tier of --offload-gib. Each run: a fresh prompt A (computed: "cold"), A again
(GPU hit), a fresh prompt B (evicts A's blocks to the CPU tier), A again (its blocks loaded back: "cpu tier"). Prints
the median and min milliseconds of each, the tokens the CPU tier gave back per run, and a lower bound of its copy
rate (the loaded KV bytes over the whole CPU-tier TTFT). `--device cpu` runs the script's logic only."""
import argparse
import random
import statistics
import tempfile
import time

from voltllm.bench.inprocess import sampling_params
from voltllm.bench.shapes import materialize
from voltllm.config import EngineArgs
from voltllm.engine.types import EngineCoreRequest


def ttft_ms(eng, tokens: list[int], tag: str) -> float:
    """Milliseconds until the request's first token (greedy, one token); then the engine is drained."""
    sp = sampling_params(1, temperature=0.0, top_p=1.0, top_k=0, seed=None)
    t0 = time.perf_counter()
    eng.add_request(EngineCoreRequest(tag, list(tokens), sp))
    while not any(o.new_token_ids for o in eng.step()):
        pass
    ms = (time.perf_counter() - t0) * 1e3
    while eng.has_unfinished_requests():
        eng.step()
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b-shape")
    ap.add_argument("--input-len", type=int, default=16384)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--offload-gib", type=float, default=16.0)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    n, bs = args.input_len, args.block_size
    with tempfile.TemporaryDirectory() as tmp:
        ea = EngineArgs(model=materialize(args.shape, tmp), load_format="dummy", dtype="float16", device=args.device,
                        max_model_len=n + 64, max_num_seqs=4, max_num_batched_tokens=min(n + 64, 8192),
                        enable_prefix_caching=True, block_size=bs, num_gpu_blocks_override=n // bs + 4,
                        kv_offloading_size=args.offload_gib)
        ea.skip_tokenizer_init = True
        from voltllm.engine.core import EngineCore

        eng = EngineCore(ea.create_engine_config())
        vocab = eng.config.model.hf_config.vocab_size
        kv = eng.scheduler.kv
        store = eng.runner.kv_offload
        times: dict[str, list[float]] = {"cold": [], "gpu hit": [], "cpu tier": []}
        hits = []
        for run in range(args.runs + 1):  # the first run warms up (compiles, first copies)
            a = [random.randrange(vocab) for _ in range(n)]
            b = [random.randrange(vocab) for _ in range(n)]
            cold = ttft_ms(eng, a, f"a{run}")
            gpu = ttft_ms(eng, a, f"a{run}-again")
            ttft_ms(eng, b, f"b{run}")
            before = kv.cpu_hit_tokens
            cpu = ttft_ms(eng, a, f"a{run}-back")
            hits.append(kv.cpu_hit_tokens - before)
            if run:
                for key, ms in (("cold", cold), ("gpu hit", gpu), ("cpu tier", cpu)):
                    times[key].append(ms)
        loaded = statistics.median(hits[1:]) if len(hits) > 1 else 0
        print(f"{args.shape} fp16 on {args.device}: {n}-token prompts, GPU pool {kv.num_blocks} blocks of {bs}, CPU "
              f"tier {store.num_slots if store else 0} slots ({store.nbytes / 2**30 if store else 0:.1f} GiB), "
              f"{args.runs} runs")
        print(f"CPU-tier hits per back run: {loaded:.0f} tokens of {n}")
        print(f"{'prompt':>10} {'TTFT ms median':>15} {'min':>9}")
        for key, vals in times.items():
            print(f"{key:>10} {statistics.median(vals):>15.1f} {min(vals):>9.1f}")
        if store is not None and loaded:
            mb = loaded / bs * store.slot_bytes / 1e6
            ms = statistics.median(times["cpu tier"])
            print(f"KV loaded per back run: {mb:.1f} MB in at most {ms:.1f} ms: >= {mb / ms:.2f} GB/s")


if __name__ == "__main__":
    main()
