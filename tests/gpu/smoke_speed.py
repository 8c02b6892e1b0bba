"""Quick decode speed probe on the GPU (not a test): batch-1 and batch-64 decode tok/s, in-process."""
import sys
import time

import torch

from voltllm import LLM, SamplingParams


def run(model, n_out=256, batch=1, **kw):
    llm = LLM(model, **kw)
    prompt = {"prompt_token_ids": list(range(100, 612))}
    p = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
    llm.generate([prompt] * batch, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate([prompt] * batch, p)
    dt = time.perf_counter() - t0
    m = outs[0].metrics
    dec = (n_out - 1) / (m.last_token_time - m.first_token_time)
    print(f"{model} batch={batch} {kw}: wall {batch * n_out / dt:.1f} tok/s, pure decode (req0) {dec:.1f} tok/s",
          flush=True)
    del llm
    torch.cuda.empty_cache()


if __name__ == "__main__":
    model = sys.argv[1]
    extra = dict(a.split("=", 1) for a in sys.argv[2:])
    extra = {k: (v == "1" if k in ("enforce_eager", "skip_tokenizer_init") else v) for k, v in extra.items()}
    for b in (1, 64):
        run(model, batch=b, max_num_seqs=64, gpu_memory_utilization=0.5, max_model_len=2048, **extra)
