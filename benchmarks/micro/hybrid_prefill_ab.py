"""Hybrid (Gated DeltaNet) prefill with tensor-core chunk-kernel products against the exact-fp32 route, one engine.

    PYTHONPATH=$PWD python3 benchmarks/micro/hybrid_prefill_ab.py [--shape qwen3.5-27b-shape]
        [--input-lens 8192,32768] [--runs 2]

Random weights of a named hybrid shape, fp16, prefix caching off, prompts in 8192-token chunks (the bench's
defaults). For each input length, one request of fresh random tokens generates one token; runs alternate between
the GDN layers' chunk precision as the runner chose it ("tf32x3" on the native route of sm_80+: Triton chunk
kernels on tensor cores for every prefill; "--fast tf32" times single-tf32 products instead) and "ieee" (exact
fp32 products, with the torch chunked form for a long single prompt: what every route ran before session 18), so
both see the same engine and GPU state. Prints the median / min time to first token and the prefill rate."""
import argparse
import statistics
import tempfile

from _micro_timing import first_tokens_ms

from voltllm.bench.shapes import materialize
from voltllm.config import EngineArgs
from voltllm.model.layers.gdn import set_chunk_precision


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.5-27b-shape")
    ap.add_argument("--input-lens", default="8192,32768")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--fast", default=None, help="the tensor-core precision to time (default: the runner's)")
    args = ap.parse_args()
    lens = [int(x) for x in args.input_lens.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = materialize(args.shape, tmp)
        ea = EngineArgs(model=path, load_format="dummy", dtype="float16", device="cuda",
                        max_model_len=max(lens) + 256, max_num_seqs=4, max_num_batched_tokens=8192,
                        enable_prefix_caching=False, gpu_memory_utilization=0.8)
        ea.skip_tokenizer_init = True
        from voltllm.engine.core import EngineCore

        eng = EngineCore(ea.create_engine_config())
        model = eng.runner.model
        vocab = eng.config.model.hf_config.vocab_size
        chosen = next(m.chunk_precision for m in model.modules() if hasattr(m, "chunk_precision"))
        print(f"{args.shape} fp16: the runner chose {chosen!r} products; one request per run")
        print(f"timing {args.fast or chosen!r} (columns 'tf32') against 'ieee'")
        print(f"{'tokens':>7} {'tensor-core ms (med / min)':>27} {'ieee ms (median / min)':>24} {'tc tok/s':>11} "
              f"{'ieee tok/s':>11} {'speed-up':>9}")
        for n in lens:
            times = {"tf32": [], "ieee": []}
            for run in range(args.runs + 1):  # the first pair warms up
                for mode in ("tf32", "ieee"):  # "tf32": the tensor-core precision (--fast, or the runner's)
                    set_chunk_precision(model, (args.fast or chosen) if mode == "tf32" else mode)
                    ms = first_tokens_ms(eng, vocab, n, 1, f"{mode}{n}-{run}")
                    if run:
                        times[mode].append(ms)
            set_chunk_precision(model, chosen)
            t, e = (statistics.median(times[m]) for m in ("tf32", "ieee"))
            print(f"{n:>7} {t:>14.1f} / {min(times['tf32']):<8.1f} {e:>14.1f} / {min(times['ieee']):<8.1f} "
                  f"{n / t * 1e3:>11.0f} {n / e * 1e3:>11.0f} {e / t:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
