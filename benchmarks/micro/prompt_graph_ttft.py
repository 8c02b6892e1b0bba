"""Time to first token with prompt steps replayed from piecewise CUDA graphs against eager prompt steps, one engine.

    PYTHONPATH=$PWD python3 benchmarks/micro/prompt_graph_ttft.py [--shape smollm2-135m-shape | --model PATH]
        [--input-lens 16,128,500] [--concurrency 1] [--runs 10] [--max-graph-tokens N]

Random weights of a named shape (as `voltllm bench --random-weights`) or a model path; prefix caching off; for each
input length, C requests of fresh random prompt tokens arrive together and each generates one token (the prompt step
and its sampling). Alternating runs with the engine's prompt graphs on and off (runner.prompt_graphs set aside), so
both see the same host and GPU state; prints the median and min milliseconds from arrival to the last request's
first token, and the ratio. `--max-graph-tokens` sets DeviceConfig.prompt_graph_max_tokens (the largest bucket) for
this engine. `--device cpu` runs the script's logic only (no graphs there)."""
import argparse
import dataclasses
import statistics
import tempfile

from _micro_timing import first_tokens_ms

from voltllm.bench.shapes import materialize
from voltllm.config import EngineArgs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m-shape")
    ap.add_argument("--model", default=None, help="a model path (GGUF file or HF folder) instead of --shape")
    ap.add_argument("--input-lens", default="16,128,500")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="8192: the bench's default")
    ap.add_argument("--max-graph-tokens", type=int, default=None, help="the largest prompt-graph bucket (default: "
                    "by the model's size, as the engine picks it)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or materialize(args.shape, tmp)
        ea = EngineArgs(model=path, load_format="auto" if args.model else "dummy", dtype="float16",
                        device=args.device, max_model_len=2048, max_num_seqs=max(args.concurrency, 16),
                        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)
        ea.skip_tokenizer_init = True
        config = ea.create_engine_config()
        if args.max_graph_tokens is not None:
            config = dataclasses.replace(config, device=dataclasses.replace(
                config.device, prompt_graph_max_tokens=args.max_graph_tokens))
        from voltllm.engine.core import EngineCore

        eng = EngineCore(config)
        vocab = eng.config.model.hf_config.vocab_size
        runner = eng.runner
        graphs = runner.prompt_graphs
        print(f"{args.model or args.shape} on {args.device}: prompt graphs {graphs.sizes if graphs else 'none'}, "
              f"{args.concurrency} request(s) per run")
        rows = []
        for n in (int(x) for x in args.input_lens.split(",")):
            times = {"graphs": [], "eager": []}
            for run in range(args.runs + 1):  # the first pair warms up (compiles eager kernels at this length)
                for mode in ("graphs", "eager"):
                    runner.prompt_graphs = graphs if mode == "graphs" else None
                    ms = first_tokens_ms(eng, vocab, n, args.concurrency, f"{mode}{n}-{run}")
                    if run:
                        times[mode].append(ms)
            runner.prompt_graphs = graphs
            g, e = (statistics.median(times[m]) for m in ("graphs", "eager"))
            rows.append((n, g, min(times["graphs"]), e, min(times["eager"]), e / g))
        print(f"{'input':>6} {'graphs ms (median / min)':>25} {'eager ms (median / min)':>24} {'eager / graphs':>15}")
        for n, g, gmin, e, emin, ratio in rows:
            print(f"{n:>6} {g:>15.2f} / {gmin:<7.2f} {e:>14.2f} / {emin:<7.2f} {ratio:>15.2f}")


if __name__ == "__main__":
    main()
