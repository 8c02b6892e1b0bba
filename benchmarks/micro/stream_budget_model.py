"""A toy model (no GPU, no engine) of a streamed run at C in flight: what the token budget per step
(--max-num-batched-tokens) should do to output tok/s when every request has the same lengths.

    python3 benchmarks/micro/stream_budget_model.py [--weights-ms 5.0] [--tflops 620] [--gflop-per-token 14.2]

Each step serves the running decodes first (one token each), then prompt chunks in arrival order, up to the budget
(the scheduler's order, engine/scheduler.py). A step takes max(weight read, matmul time of its rows) plus a fixed
overhead: the decode step of the 8B at 64 rows is memory-bound (~5 ms), its prompt phase compute-bound at the
power-capped matmul rate (~620 TFLOP/s on the H200: 187 ms for 64 x 128 tokens). The defaults are those figures
(benchmarks/README.md); it prints predicted output tok/s per budget for 320 and 1,000 requests. A prediction to
choose what to measure, not a measurement.

Measured, it was wrong (session 68, H100, results/session68/): 320 requests at a budget of 256 gave 7,609 output
tok/s against 7,621 for the one batch and 7,586 at the default budget, and 384 gave 7,021. The max() above assumes a
step's prompt work hides under its weight read; the GEMMs of a step with ~64 decode and up to 192 prompt rows
do not overlap the two, so the prompt work is paid in full.
"""
import argparse


def step_ms(rows: int, prompt_rows: int, weights_ms: float, tflops: float, gflop_per_token: float) -> float:
    matmul_ms = rows * gflop_per_token * 1e9 / (tflops * 1e12) * 1e3
    return max(weights_ms, matmul_ms) + 0.3 + (0.5 if prompt_rows else 0.0)  # per-step host / attention overheads


def output_tok_s(budget: int, n: int, c: int, input_len: int, output_len: int, **cost) -> float:
    t_ms, sent, done, out = 0.0, 0, 0, 0
    decoding: dict[int, int] = {}  # request -> tokens generated
    prefilling: list[list[int]] = []  # [request, prompt tokens computed], in arrival order
    while done < n:
        while len(decoding) + len(prefilling) < c and sent < n:
            prefilling.append([sent, 0])
            sent += 1
        decodes = list(decoding)[:budget]
        left = budget - len(decodes)
        prompt_rows = 0
        for p in prefilling:
            if left <= 0:
                break
            take = min(input_len - p[1], left)
            p[1] += take
            left -= take
            prompt_rows += take
        t_ms += step_ms(len(decodes) + prompt_rows, prompt_rows, **cost)
        for r in decodes:
            decoding[r] += 1
            out += 1
            if decoding[r] >= output_len:
                del decoding[r]
                done += 1
        for p in [p for p in prefilling if p[1] >= input_len]:  # a finished prompt yields the first token
            prefilling.remove(p)
            decoding[p[0]] = 1
            out += 1
    return out / (t_ms / 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights-ms", type=float, default=5.0, help="a decode step's weight + KV read (ms)")
    ap.add_argument("--tflops", type=float, default=620.0, help="the sustained matmul rate (TFLOP/s)")
    ap.add_argument("--gflop-per-token", type=float, default=14.2, help="2 x the projection parameters (GFLOP)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    a = ap.parse_args()
    cost = dict(weights_ms=a.weights_ms, tflops=a.tflops, gflop_per_token=a.gflop_per_token)
    print(f"{'budget':>7} {'320 requests':>13} {'1000 requests':>14}  (predicted output tok/s)")
    for budget in (8192, 2048, 1024, 512, 384, 256, 192):
        rates = [output_tok_s(budget, n, a.concurrency, a.input_len, a.output_len, **cost) for n in (320, 1000)]
        print(f"{budget:>7} {rates[0]:>13,.0f} {rates[1]:>14,.0f}")


if __name__ == "__main__":
    main()
