"""The transformers baseline: `generate` on the same model shape, dtype, device and prompts, same call.

Random-weight runs (--load-format dummy / --random-weights) build the transformers model from the same
config with its own random init (speed does not depend on weight values); real checkpoints (HF
directories, GGUF files) are loaded from the same files. Output lengths are forced with
min_new_tokens = max_new_tokens. A streamer stamps time.monotonic() each time generate hands it a token
(generate moves the token to the host first, so the stamp is taken after the step ran).

Variants: "hf" is plain generate (dynamic cache, eager): what most users run. "hf-static" adds
cache_implementation="static", with which transformers compiles the decode step itself: the strongest
thing a transformers user gets (the cold run pays the compile).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Optional

import torch

from voltllm.bench.inprocess import Plan, Workload
from voltllm.bench.metrics import RequestTiming, RunResult

logger = logging.getLogger("voltllm.bench")

VARIANTS = ("hf", "hf-static")


def load_hf_model(model_path: str, hf_config: Any, load_format: str, dtype: torch.dtype,
                  device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM

    t0 = time.monotonic()
    if load_format == "dummy":
        with torch.device(device):  # initialise on the device itself (no host-side init of billions of values)
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        model = model.to(device)  # a no-op unless transformers built some of it elsewhere
    elif model_path.endswith(".gguf") and os.path.isfile(model_path):
        from voltllm.model.loader.gguf_loader import split_files

        if len(split_files(model_path)) > 1:
            raise ValueError(f"the transformers baseline reads no split GGUF ({model_path}): merge it with llama.cpp's "
                             "gguf-split --merge, or run without --baseline hf")
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(model_path) or ".",
                                                     gguf_file=os.path.basename(model_path), dtype=dtype)
        model = model.to(device)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    model.eval()
    logger.info("transformers baseline: %s (%s) on %s in %.1f s", type(model).__name__,
                "random init" if load_format == "dummy" else model_path, device, time.monotonic() - t0)
    return model


def _stamp_streamer() -> Any:
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        """generate calls put() once with the prompt, then once per step with that step's tokens."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self._prompt_seen = False

        def put(self, value: Any) -> None:
            if not self._prompt_seen:
                self._prompt_seen = True
                return
            self.times.append(time.monotonic())

        def end(self) -> None:
            pass

    return Stamps()


class HFRunner:
    def __init__(self, model: Any, device: torch.device, variant: str = "hf", temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = -1, sampling_seed: int = 0):
        if variant not in VARIANTS:
            raise ValueError(f"--baseline must be one of {', '.join(VARIANTS)}, got {variant!r}")
        self.model = model
        self.device = device
        self.variant = variant
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.sampling_seed = sampling_seed
        gc = getattr(model, "generation_config", None)
        eos = getattr(gc, "eos_token_id", None) if gc is not None else None
        pad = getattr(gc, "pad_token_id", None) if gc is not None else None
        if pad is None:
            pad = (eos[0] if isinstance(eos, (list, tuple)) and eos else eos) if eos is not None else 0
        self.pad_token_id = int(pad)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, plan: Plan, run: str, work: Workload) -> RunResult:
        # generate runs the requests as one batch: one prompt length, one forced output length
        prompts, n = work.prompts, plan.output_len
        if len({len(p) for p in prompts}) > 1 or any(m != n for m in work.output_lens) or work.arrivals:
            raise ValueError("the transformers baseline runs one batch of equal lengths sent together; drop "
                             "--random-range-ratio and --request-rate")
        ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
        kwargs: dict[str, Any] = dict(max_new_tokens=n, min_new_tokens=n, pad_token_id=self.pad_token_id,
                                      do_sample=self.temperature > 0)
        if self.temperature > 0:
            kwargs.update(temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0))
        if self.variant == "hf-static":
            kwargs["cache_implementation"] = "static"
        torch.manual_seed(self.sampling_seed)
        stamps = _stamp_streamer()
        self._sync()
        t0 = time.monotonic()
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), streamer=stamps, **kwargs)
        self._sync()
        end = time.monotonic()
        made = out.shape[1] - ids.shape[1]
        if made != n or len(stamps.times) != n:
            raise RuntimeError(f"transformers generate made {made} tokens ({len(stamps.times)} steps stamped), "
                               f"not the forced {n}")
        times = stamps.times
        reqs = [RequestTiming(prompt_tokens=len(p), output_tokens=n, arrival=t0, first_token=times[0],
                              last_token=times[-1], token_times=list(times)) for p in prompts]
        return RunResult(plan.scenario, plan.concurrency, run, plan.input_len, plan.output_len, t0, end, reqs,
                         side=self.variant)


def hf_plans(plans: list[Plan], max_batch: Optional[int] = None) -> list[Plan]:
    """The plans the baseline runs (all of them unless its batch is capped)."""
    return [p for p in plans if max_batch is None or p.concurrency <= max_batch]
