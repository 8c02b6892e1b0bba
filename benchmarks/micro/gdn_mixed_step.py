"""A mixed step's Gated DeltaNet layer (GPU): decode rows beside a prompt chunk, with and without RowSplit.

    PYTHONPATH=$PWD python3 benchmarks/micro/gdn_mixed_step.py [--shape 27b|35b] [--rows 0,16,64,255] [--prompt 512]

One GatedDeltaNet layer at the shape's GDN dims (random weights, fp16), one step of R decode rows (requests that
resume from a stored state) and one prompt chunk of P tokens, timed with CUDA events (median of 10 after a warm-up):
as built (the decode rows run the decode kernel, the prompt the chunk kernels: voltllm.model.layers.gdn.RowSplit)
and with the split turned off (every request through the chunk kernels, a 64-row chunk per decode row, as before
session 22). Both outputs are compared (relative error). `--device cpu` with TRITON_INTERPRET=1 and small dims
checks the script's logic only."""
import argparse
from types import SimpleNamespace

import torch
from _micro_timing import event_ms

from voltllm.model.layers import gdn as G
from voltllm.model.state_cache import StateCache

SHAPES = {"27b": (16, 48, 128, 5120), "35b": (16, 32, 128, 2048), "tiny": (2, 4, 16, 32)}  # Hk, Hv, D, hidden


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="27b", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="0,16,64,255")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev = torch.device(args.device)
    hk, hv, d, hidden = SHAPES[args.shape]
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    cfg = SimpleNamespace(linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=d,
                          linear_value_head_dim=d, linear_conv_kernel_dim=4, hidden_size=hidden, rms_norm_eps=1e-6)
    layer = G.GatedDeltaNet(cfg, 0, dtype).to(dev)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype).to(dev))
        layer.A_log.copy_(torch.empty(hv).uniform_(0.02, 0.5, generator=gen).log().to(dev))
    if dev.type != "cuda":
        layer.triton_prefill = layer.triton_decode = layer.triton_conv = layer.triton_norm = True
    real_of = G.RowSplit.of
    for rows in (int(r) for r in args.rows.split(",")):
        n = rows + 1
        qsl = list(range(rows + 1)) + [rows + args.prompt]
        t = qsl[-1]
        x = (torch.randn(t, hidden, generator=gen) * 0.5).to(dtype).to(dev)
        cache = StateCache(1, n + 1, layer.conv_state_shape, layer.ssm_state_shape, dtype, dev)
        cache.ssm[0].normal_(0, 0.1)
        slots = torch.arange(n, device=dev)
        init = torch.tensor([True] * rows + [False], device=dev)
        saved = (cache.ssm[0].clone(), cache.conv[0].clone())

        def step(split: bool):
            cache.ssm[0].copy_(saved[0])
            cache.conv[0].copy_(saved[1])
            G.RowSplit.of = real_of if split else (lambda batch: None)
            try:
                batch = G.HybridBatch(state_cache=cache, slots=slots, has_initial_state=init, query_start_loc=qsl,
                                      decode_only=False)
                with torch.no_grad():
                    return layer(x, batch)
            finally:
                G.RowSplit.of = real_of

        a, b = step(True).float(), step(False).float()
        err = ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
        on, off = event_ms(lambda: step(True), 10), event_ms(lambda: step(False), 10)
        print(f"{args.shape}: {rows:4d} decode rows + {args.prompt}-token prompt: split {on:7.3f} ms, "
              f"unsplit {off:7.3f} ms, rel diff {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
