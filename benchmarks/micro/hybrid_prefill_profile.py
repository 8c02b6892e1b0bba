"""Hybrid (Gated DeltaNet) prefill: the Triton prefill conv1d against the torch form, one engine, then where one
prompt's time goes by GPU kernel.

    PYTHONPATH=$PWD python3 benchmarks/micro/hybrid_prefill_profile.py [--shape qwen3.5-27b-shape]
        [--cases 8192x1,128x64] [--runs 2] [--profile-len 8192] [--top 18]

Random weights of a named hybrid shape, fp16, prefix caching off, 8192-token steps. For each case (tokens x
requests), fresh random prompts generate one token each; runs alternate between the GDN layers' conv1d through
voltllm/kernels/gdn_conv.py and through the torch form (gdn_ref.causal_conv1d_varlen), so both see the same engine
and GPU state; prints median / min time to first token. Then one prompt of --profile-len tokens under
torch.profiler: GPU time per kernel (the --top largest) and the total."""
import argparse
import statistics
import tempfile

from _micro_timing import first_tokens_ms, kernel_times_us

from voltllm.bench.shapes import materialize
from voltllm.config import EngineArgs
from voltllm.model.layers.gdn import GatedDeltaNet


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.5-27b-shape")
    ap.add_argument("--cases", default="8192x1,128x64")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--profile-len", type=int, default=8192)
    ap.add_argument("--top", type=int, default=18)
    args = ap.parse_args()
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = materialize(args.shape, tmp)
        longest = max([n for n, _ in cases] + [args.profile_len])
        ea = EngineArgs(model=path, load_format="dummy", dtype="float16", device="cuda",
                        max_model_len=longest + 256, max_num_seqs=max(c for _, c in cases),
                        max_num_batched_tokens=8192, enable_prefix_caching=False, gpu_memory_utilization=0.8)
        ea.skip_tokenizer_init = True
        from voltllm.engine.core import EngineCore

        eng = EngineCore(ea.create_engine_config())
        vocab = eng.config.model.hf_config.vocab_size
        print(f"{args.shape} fp16: time to first token, prefill conv1d Triton vs torch form")
        print(f"{'case':>10} {'triton ms (med / min)':>22} {'torch ms (med / min)':>22} {'saved':>7}")
        for n, c in cases:
            times = {True: [], False: []}
            for run in range(args.runs + 1):  # the first pair warms up
                for on in (True, False):
                    GatedDeltaNet.triton_conv = on
                    ms = first_tokens_ms(eng, vocab, n, c, f"conv{on}-{n}x{c}-{run}")
                    if run:
                        times[on].append(ms)
            GatedDeltaNet.triton_conv = None
            t, r = (statistics.median(times[k]) for k in (True, False))
            print(f"{f'{n}x{c}':>10} {t:>12.1f} / {min(times[True]):<8.1f} {r:>12.1f} / {min(times[False]):<8.1f} "
                  f"{r - t:>7.1f}", flush=True)
        k = kernel_times_us(lambda: first_tokens_ms(eng, vocab, args.profile_len, 1, "profile"))
        total = sum(k.values())
        print(f"\none {args.profile_len}-token prompt: {total / 1e3:.1f} ms of GPU kernels; the largest:")
        for name, us in sorted(k.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"{us / 1e3:>9.2f} ms {100 * us / total:>5.1f}%  {name}")


if __name__ == "__main__":
    main()
