"""Decode attention, this tree's kernel against another version of paged_decode.py, same call (GPU only).

    PYTHONPATH=$PWD python3 benchmarks/micro/attn_decode_ab.py OLD_PAGED_DECODE_PY [--defaults]

qwen3-8b heads (32 q / 8 kv, d128, page 16), random contexts and permuted pages, four caches rotated, CUDA-graph
replays. Each output is checked against an fp32 gather reference (relative error). Prints per shape and tile
(BLOCK_N, warps, stages) the time and KV read rate of both versions, at the split count the backend would choose;
"default" is each version's own choice for the card's SM count (as the backend calls it). --defaults: only those.
"""
import importlib
import importlib.util
import sys

import torch
from graph_timing import graph_us
from paged_decode_case import paged_decode_case
new_mod = importlib.import_module("voltllm.kernels.attention.paged_decode")  # (the package exports the function)

HQ, HKV, D = 32, 8, 128


def load_old(path):
    """The other version as its own module; its kernels are not put in the registry (the names are taken)."""
    from voltllm.kernels import registry
    spec = importlib.util.spec_from_file_location("paged_decode_old", path)
    mod = importlib.util.module_from_spec(spec)
    register = registry.register_kernel
    registry.register_kernel = lambda name, fn, *args, **kwargs: fn
    try:
        spec.loader.exec_module(mod)
    finally:
        registry.register_kernel = register
    return mod


def reference(q, cache, bt, lens, scale):
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    page = cache.shape[2]
    for r, n in enumerate(lens.tolist()):
        slots = (bt[r, (torch.arange(n, device=q.device) // page)].long() * page
                 + torch.arange(n, device=q.device) % page)
        k = cache[0].view(-1, HKV, D)[slots].float().repeat_interleave(HQ // HKV, dim=1)  # [n, HQ, D]
        v = cache[1].view(-1, HKV, D)[slots].float().repeat_interleave(HQ // HKV, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[r].float(), k) * scale, dim=-1)
        out[r] = torch.einsum("hn,nhd->hd", p, v)
    return out


def checked_us(f, out, ref, label, replays=5):
    """f(i) (a decode launch on rotated cache i into `out`) checked once against `ref` from a NaN-poisoned output,
    then timed over CUDA-graph replays: (us per call, relative error), or None (printed) where it does not launch."""
    out.fill_(float("nan"))
    try:
        f(0)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - a tile that does not fit is reported, not fatal
        print(f"  {label}: {type(e).__name__} {str(e)[:100]}", flush=True)
        return None
    err = ((out.float() - ref).norm() / ref.norm()).item()
    return graph_us(lambda i: f(i % 4), reps=20, replays=replays), err


def main(old_path, defaults_only=False):
    torch.manual_seed(0)
    old_mod = load_old(old_path)
    scale = D ** -0.5
    tiles = [] if defaults_only else [(64, 2, 2), (64, 2, 3), (64, 2, 4), (64, 4, 3), (32, 2, 3), (32, 2, 4),
                                      (32, 4, 3)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for bs, lo, hi in ((64, 128, 256), (16, 128, 256), (64, 900, 1100), (4, 2000, 4000), (1, 8000, 8200)):
        q, caches, bt, sl, qsl, _ = paged_decode_case(bs, lo, hi, HQ, HKV, D)
        kv_bytes = int(sl.sum()) * HKV * D * 2 * 2
        ref = reference(q, caches[0], bt, sl, scale)
        splits = new_mod.choose_num_splits(bs, HKV, hi, sms)
        no, nl = new_mod.decode_scratch_numel(bs, HQ, splits, D)
        po, pl = torch.empty(no, device="cuda"), torch.empty(nl, device="cuda")
        out = torch.empty_like(q)
        rows = []
        for name, mod in (("new", new_mod), ("old", old_mod)):
            for bn, nw, ns in [(None, None, None)] + tiles:
                kw = {"num_sms": sms} if bn is None else {"block_n": bn, "num_warps": nw, "num_stages": ns}

                def f(i, mod=mod, kw=kw):
                    return mod.paged_decode(q, caches[i], bt, sl, qsl, scale, out, num_splits=splits, part_o=po,
                                            part_lse=pl, **kw)
                timed = checked_us(f, out, ref, f"{name} {bn, nw, ns}", replays=3)
                if timed is None:
                    continue
                t, err = timed
                rows.append((t, name, "default" if bn is None else (bn, nw, ns), err))
        print(f"bs={bs} ctx {lo}-{hi}, {splits} split(s), KV {kv_bytes / 1e6:.1f} MB", flush=True)
        for t, name, tile, err in sorted(rows, key=lambda r: r[0])[:6] + [r for r in rows if r[2] == "default"]:
            print(f"  {name} {tile}: {t:.1f} us {kv_bytes / t / 1e6:.2f} TB/s rel. error {err:.1e}"
                  + ("" if err < 2e-3 else " WRONG"), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], "--defaults" in sys.argv[2:])
