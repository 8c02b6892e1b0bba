"""Eager prompt steps at token counts near a multiple of 64: does the count's alignment change the GPU time?

    PYTHONPATH=$PWD python3 benchmarks/micro/prompt_eager_alignment.py [--shape qwen3-8b-shape]
        [--lens 1000,1008,1024,2000,2048] [--runs 6] [--profile-lens 1000,1024]

Session 17 measured the 8B's eager 1,000-token prompt step at 35.5 ms where the 1,024-token graph replay took 24.4 and
2,000 tokens took the same both ways. This script takes graphs out of it: one engine, prompt graphs set aside, one
request of n fresh random tokens per run (prefix caching off), milliseconds from arrival to its first token (median /
min of the runs after a warm-up). Then, for each of --profile-lens, one step under torch.profiler: the CUDA kernels'
total time by name, so a kernel whose time jumps at an unaligned count shows which library or kernel pays for it.
Also the bare cuBLAS GEMMs of the shape's projections at each length (CUDA events, 20 calls)."""
import argparse
import statistics
import tempfile

import torch

from _micro_timing import first_tokens_ms, kernel_times_us

from voltllm.bench.shapes import materialize
from voltllm.config import EngineArgs


def _gemm_us(m: int, n: int, k: int, dtype=torch.float16) -> float:
    x = torch.randn(m, k, dtype=dtype, device="cuda")
    w = torch.randn(n, k, dtype=dtype, device="cuda")
    for _ in range(3):
        x @ w.t()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(20):
        x @ w.t()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b-shape")
    ap.add_argument("--lens", default="1000,1008,1016,1024,2000,2040,2048")
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--profile-lens", default="1000,1024")
    args = ap.parse_args()
    lens = [int(x) for x in args.lens.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = materialize(args.shape, tmp)
        ea = EngineArgs(model=path, load_format="dummy", dtype="float16", device="cuda", max_model_len=4096,
                        max_num_seqs=16, max_num_batched_tokens=8192, enable_prefix_caching=False)
        ea.skip_tokenizer_init = True
        from voltllm.engine.core import EngineCore

        eng = EngineCore(ea.create_engine_config())
        eng.runner.prompt_graphs = None  # every prompt step eager
        hf = eng.config.model.hf_config
        vocab = hf.vocab_size
        print(f"{args.shape}: eager prompt steps, one request per run")
        print(f"{'tokens':>7} {'first token ms (median / min)':>30}")
        for n in lens:
            times = [first_tokens_ms(eng, vocab, n, 1, f"a{n}-{r}") for r in range(args.runs + 1)][1:]
            print(f"{n:>7} {statistics.median(times):>20.2f} / {min(times):<7.2f}")
        h, i = hf.hidden_size, hf.intermediate_size
        hd = getattr(hf, "head_dim", h // hf.num_attention_heads)
        qkv = (hf.num_attention_heads + 2 * hf.num_key_value_heads) * hd
        shapes = {"qkv": (qkv, h), "o": (h, hf.num_attention_heads * hd), "gate_up": (2 * i, h), "down": (h, i)}
        print(f"{'tokens':>7} " + " ".join(f"{k + ' us':>12}" for k in shapes))
        for n in lens:
            print(f"{n:>7} " + " ".join(f"{_gemm_us(n, nn, kk):>12.1f}" for nn, kk in shapes.values()))
        plens = [int(x) for x in args.profile_lens.split(",") if x]
        if plens:
            prof = {n: kernel_times_us(lambda n=n: first_tokens_ms(eng, vocab, n, 1, f"p{n}")) for n in plens}
            names = sorted(set().union(*prof.values()), key=lambda k: -max(p.get(k, 0) for p in prof.values()))
            print(f"{'kernel (self CUDA us per step)':<70} " + " ".join(f"{n:>9}" for n in plens))
            for k in names[:25]:
                print(f"{k:<70} " + " ".join(f"{prof[n].get(k, 0):>9.0f}" for n in plens))
            print(f"{'total':<70} " + " ".join(f"{sum(prof[n].values()):>9.0f}" for n in plens))


if __name__ == "__main__":
    main()
