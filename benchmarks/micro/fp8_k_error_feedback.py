"""Experiment (issue #5): E4M3 keys rounded with error feedback against the query covariance, vs round-to-nearest.

    PYTHONPATH=$PWD:$PWD/tests python benchmarks/micro/fp8_k_error_feedback.py MODEL.gguf [TOKENS] [--long-calib]

A key's rounding error dk changes a query's score by q . dk; its expected square over the queries is
dk^T S dk with S = E[q q^T] (per layer and kv head, after RoPE). Rounding the channels one at a time and pushing
each channel's error onto the ones not yet rounded (the GPTQ / OBQ update with the inverse-Cholesky factor of S,
channels in decreasing S_jj order, damping `damp` x mean(S_jj)) lowers that expectation where round-to-nearest
ignores it. S comes from a calibration text (the fp16-KV model's queries), not from the test prompts. The rounded
keys are exactly representable, so the engine's own fp8 write stores them unchanged (scale 1.0). Prints the raw
q . k mean squared error on held-out text and the teacher-forced greedy top-1 agreement with fp16 KV over TOKENS
tokens of four chat prompts (the protocol of fp8_kv_agreement.py). CPU; minutes per variant."""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_kv_agreement import MESSAGES, _load  # noqa: E402  (the same prompts and test-helper loader)
from voltllm import LLM, SamplingParams  # noqa: E402
from voltllm.kernels.fp8_codec import decode_e4m3, encode_e4m3  # noqa: E402

CALIB = ("The history of science is the study of the development of science and scientific knowledge, including both "
         "the natural and social sciences. def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
         "Once upon a time, in a small village by the sea, there lived an old fisherman who told stories every night.")
CALIB_LONG = (
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to synthesize foods "
    "from carbon dioxide and water. The Roman Empire was the post-Republican state of ancient Rome. "
    "import json\nclass Cache:\n    def __init__(self, size):\n        self.size = size\n        self.data = {}\n"
    "Dear team, thank you for your hard work this quarter. Our sales grew by twelve percent. "
    "A recipe for pancakes: mix two cups of flour, two eggs, one and a half cups of milk and a pinch of salt. "
    "Quantum mechanics describes nature at the smallest scales. Q: What is 17 times 23? A: 17 times 23 is 391. "
    "The weather today is sunny with a light breeze from the west, and temperatures will reach 24 degrees. ")


def nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    return decode_e4m3(encode_e4m3(x.float()))


class KeyRounding:
    """Wraps an attention backend: collects query second moments ("collect") or stores error-feedback-rounded
    keys ("feedback"); the layer is the call's position in the model's forward."""

    def __init__(self, inner, layers: int, heads: int, dim: int):
        self.inner, self.layers, self.calls, self.mode = inner, layers, 0, None
        self.moment = torch.zeros(layers, heads, dim, dim)
        self.count = torch.zeros(layers, heads)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, q, k, v, kv_cache, meta, scale, k_scale=None, v_scale=None, kv_written=False):
        layer = self.calls % self.layers
        self.calls += 1
        group = q.shape[1] // k.shape[1]
        if self.mode == "collect":
            x = q.float().unflatten(1, (k.shape[1], group)).transpose(0, 1).flatten(1, 2)  # [Hk, T * group, D]
            self.moment[layer] += x.transpose(1, 2) @ x
            self.count[layer] += x.shape[1]
        elif self.mode == "feedback":
            k = self.round_keys(k, layer)
        elif self.mode == "grab":
            self.grabbed.setdefault(layer, (q.float().clone(), k.float().clone()))
        return self.inner.forward(q, k, v, kv_cache, meta, scale, k_scale, v_scale, kv_written)

    def prepare(self, damp: float) -> None:
        s = self.moment / self.count[..., None, None]
        self.perm = torch.argsort(torch.diagonal(s, dim1=-2, dim2=-1), dim=-1, descending=True)
        s = torch.gather(torch.gather(s, -1, self.perm[..., None, :].expand_as(s)), -2,
                         self.perm[..., :, None].expand_as(s))
        eye = torch.eye(s.shape[-1])
        s = s + damp * torch.diagonal(s, dim1=-2, dim2=-1).mean(-1)[..., None, None] * eye
        self.factor = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(s)), upper=True)
        self.unperm = torch.argsort(self.perm, dim=-1)

    def round_keys(self, k: torch.Tensor, layer: int) -> torch.Tensor:
        u, perm, unperm = self.factor[layer], self.perm[layer], self.unperm[layer]
        kf = k.float()
        w = torch.gather(kf, 2, perm[None].expand(kf.shape[0], -1, -1)).clone()
        out = torch.empty_like(w)
        for j in range(w.shape[2]):
            out[:, :, j] = nearest_e4m3(w[:, :, j])
            err = (w[:, :, j] - out[:, :, j]) / u[:, j, j][None]
            w[:, :, j + 1:] -= err[:, :, None] * u[:, j, j + 1:][None]
        return torch.gather(out, 2, unperm[None].expand(kf.shape[0], -1, -1)).to(k.dtype)


def held_out_mse(rounding: KeyRounding) -> tuple[float, float]:
    """Mean squared error of the raw scores q . k (every query against every key of the grabbed prompt, averaged
    over layers) with round-to-nearest and with error-feedback keys."""
    rtn = fb = 0.0
    for layer, (q, k) in rounding.grabbed.items():
        group = q.shape[1] // k.shape[1]

        def scores(keys):
            return torch.einsum("thd,shd->hts", q, keys.repeat_interleave(group, dim=1))

        ref = scores(k)
        rtn += ((scores(nearest_e4m3(k)) - ref) ** 2).mean().item()
        fb += ((scores(rounding.round_keys(k, layer).float()) - ref) ** 2).mean().item()
    return rtn / len(rounding.grabbed), fb / len(rounding.grabbed)


def main() -> None:
    model = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else 256
    _load("_attention_interp_check")
    teacher_forced = _load("_fp8_kv_interp_check").teacher_forced_logits
    kw = dict(device="cpu", dtype="float16", max_model_len=1024, num_gpu_blocks_override=80)
    ref = LLM(model, **kw)
    tok, runner = ref.tokenizer, ref.engine.runner
    chat = [tok(tok.apply_chat_template([{"role": "user", "content": m}], tokenize=False, add_generation_prompt=True))
            ["input_ids"] for m in MESSAGES]
    conts = [list(ref.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                  [0].outputs[0].token_ids) for p in chat]
    layers = runner.model.num_attention_layers
    heads, dim = runner.model.kv_heads_and_dim
    rounding = KeyRounding(runner.backend, layers, heads, dim)
    rounding.mode = "collect"
    for text in (CALIB, CALIB_LONG) if "--long-calib" in sys.argv else (CALIB,):
        ids = tok(text)["input_ids"]
        rounding.calls = 0
        teacher_forced(runner, ids, len(ids), backend=rounding)
    rounding.prepare(0.1)
    rounding.mode, rounding.calls, rounding.grabbed = "grab", 0, {}
    held = tok(MESSAGES[0] + " " + MESSAGES[2])["input_ids"]
    teacher_forced(runner, held, len(held), backend=rounding)
    rtn, fb = held_out_mse(rounding)
    print(f"held-out q . k mean squared error: round to nearest {rtn:.4f}, error feedback {fb:.4f} "
          f"({fb / rtn:.2f}x)", flush=True)
    del ref
    fp8 = LLM(model, kv_cache_dtype="fp8_e4m3", **kw)
    for label, damp in (("round to nearest", None), ("error feedback, damp 0.1", 0.1)):
        rounding.inner = fp8.engine.runner.backend
        rounding.mode = None
        if damp is not None:
            rounding.prepare(damp)
            rounding.mode = "feedback"
        t0, accs = time.time(), []
        for p, toks in zip(chat, conts):
            rounding.calls = 0
            got = teacher_forced(fp8.engine.runner, list(p) + toks, len(p), backend=rounding)[:n]
            accs.append((got.argmax(-1) == torch.tensor(toks)).float().mean().item())
        print(f"{label}: " + " ".join(f"{a:.4f}" for a in accs) + f"  mean {sum(accs) / len(accs):.4f} "
              f"({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
