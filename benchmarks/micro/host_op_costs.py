"""Host-side cost of the torch calls a decode step makes per step (launch overhead on this machine's CPU, GPU).

    PYTHONPATH=$PWD python3 benchmarks/micro/host_op_costs.py

Each call is timed on the host only (no synchronize inside the loop): what it costs the engine loop between two
steps, not what it costs the GPU. Prints microseconds per call."""
import time

import torch


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n * 1e6


def main():
    dev = torch.device("cuda")
    h = torch.zeros(8192, dtype=torch.long, pin_memory=True)
    d = torch.zeros(8192, dtype=torch.long, device=dev)
    d2 = torch.zeros(64, 300, dtype=torch.int32, device=dev)
    h2 = torch.zeros(64 * 12, dtype=torch.int32, pin_memory=True)
    prev = torch.arange(64, device=dev)
    logits = torch.randn(64, 49152, dtype=torch.float16, device=dev)
    idx = list(range(64))
    hn = h.numpy()
    cases = {
        "copy_ H2D 64 int64 (pinned, non_blocking)": lambda: d[:64].copy_(h[:64], non_blocking=True),
        "copy_ H2D 64x12 block table into [64, 300]": lambda: d2[:64, :12].copy_(h2.view(64, 12), non_blocking=True),
        "torch.tensor(64 ints).pin_memory().to(cuda)": lambda: torch.tensor(idx).pin_memory().to(dev, non_blocking=True),
        "D2D slice copy_ 64": lambda: d[:64].copy_(prev),
        "index_copy_ + index_select 64": lambda: d.index_copy_(0, prev, prev.index_select(0, prev)),
        "argmax [64, 49152] fp16": lambda: logits.argmax(dim=-1),
        "empty(64, pin_memory) + copy_ D2H": lambda: torch.empty(64, dtype=torch.long, pin_memory=True).copy_(
            prev, non_blocking=True),
        "cuda.Event() + record": lambda: torch.cuda.Event().record(),
        "python: 64 x 3 numpy scalar sets": lambda: [hn.__setitem__(i, i) for i in range(192)],
    }
    for name, fn in cases.items():
        print(f"{per_call_us(fn):8.1f} us  {name}", flush=True)


if __name__ == "__main__":
    main()
