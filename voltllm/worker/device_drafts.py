"""Drafts made on the device, on their way into a step: the runner's side of a proposer whose drafts never visit the
host before verification (a draft model's DraftRunner, DFlash's DFlashRunner).

The proposer leaves `_drafts` [K, requests] (request i's draft j at [j, i]; past a request's own drafts: unused),
`_prob_rows` (request id -> i) and, for sampled requests, `_probs` [K, requests, vocab] (the q each draft was drawn
from).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from voltllm.host_to_device import to_device
from voltllm.sampling.params import SamplingParams
from voltllm.sampling.sampler import SamplingRow

# a request's row in a proposal's passes past its own drafts: greedy (no random draw), its token unused
PAD_ROW = SamplingRow(SamplingParams(temperature=0.0), (), (), None, 0)


class DeviceDrafts:
    _drafts: Optional[torch.Tensor] = None
    _probs: Optional[torch.Tensor] = None
    _prob_rows: dict = {}

    # -- the proposer's KV cache: its attention layers' tensors, in the target's blocks and KV dtype (a proposer whose
    # caches differ overrides these); self.model and self.runner are the proposer's
    def kv_block_bytes(self, block_size: int, kv_dtype: torch.dtype) -> int:
        heads, dim = self.model.kv_heads_and_dim
        elem = torch.tensor([], dtype=kv_dtype).element_size()
        return 2 * block_size * heads * dim * elem * self.model.num_attention_layers

    def initialize_kv_cache(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> None:
        self.kv_caches = self.profile_caches(num_blocks, block_size, kv_dtype)

    def profile_caches(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> list[torch.Tensor]:
        """Cache tensors of the proposer's layers for num_blocks blocks (its KV cache; memory profiling's forward)."""
        from voltllm.attention.backend import make_kv_cache

        heads, dim = self.model.kv_heads_and_dim
        return make_kv_cache(self.model.num_attention_layers, num_blocks, block_size, heads, dim, kv_dtype,
                             self.runner.device)

    # -- a split drafter's other ranks (ModelRunner.execute_follower): run_step's and after_step's twins, after the
    # step's forward and after its logits (a drafter with nothing to do there keeps these)
    def follow_run_step(self, step, meta) -> None:
        pass

    def follow_after_step(self, step, meta, hidden: torch.Tensor) -> None:
        pass

    def chain_drawer(self, rows: list, ks: list[int], kmax: int) -> Callable[[int, torch.Tensor, torch.Tensor], None]:
        """draw(j, logits, drafts) for pass j of a chained proposal over the drafting `rows` (ks: their draft counts):
        the argmax when every request is greedy (or draft_sample_method greedy), else a draw from each request's
        processed distribution q, kept in `_probs` [kmax, requests, vocab] for the verification (a request past its
        own drafts: a greedy padding row)."""
        sampler, n = self.runner.sampler, len(rows)
        sampled = self.spec.draft_sample_method == "probabilistic" and not all(
            s.request.sampling_params.greedy for s in rows)

        def draw(j: int, logits: torch.Tensor, drafts: torch.Tensor) -> None:
            if not sampled:
                drafts[j] = logits.argmax(dim=-1)
                return
            tokens, probs = sampler.draw_drafts(logits, [
                SamplingRow(s.request.sampling_params, s.request.prompt_token_ids, (), s.request.generator,
                            s.request.num_output_tokens + j) if j < k else PAD_ROW for s, k in zip(rows, ks)])
            drafts[j] = tokens
            if probs is not None:  # (None: every request still drafting here is greedy; none reads pass j's q)
                if self._probs is None:
                    self._probs = probs.new_zeros(kmax, n, probs.shape[1])
                self._probs[j] = probs

        return draw

    def fill_inputs(self, input_ids: torch.Tensor, spans: list) -> None:
        """Copy the drafts into the step's input ids on the device (the step was prepared with placeholders):
        spans = (index of its first draft in the step's tokens, ScheduledRequest) per drafting request."""
        if self._drafts is None or not spans:
            return
        n = self._drafts.shape[1]
        dst, src = [], []
        for at, s in spans:
            i = self._prob_rows[s.request.request_id]
            dst += range(at, at + len(s.spec_tokens))
            src += [j * n + i for j in range(len(s.spec_tokens))]
        idx = to_device(dst + src, torch.long, input_ids.device)
        input_ids.index_copy_(0, idx[:len(dst)], self._drafts.reshape(-1).index_select(0, idx[len(dst):]))

    def verification_drafts(self, rows: list) -> Optional[torch.Tensor]:
        """The drafts of the runner's verification rows of `rows` ((index, ScheduledRequest): each request's drafts
        then -1 for the row after them), on the device."""
        if self._drafts is None:
            return None
        n = self._drafts.shape[1]
        src = []
        for _, s in rows:
            i = self._prob_rows[s.request.request_id]
            src += [j * n + i for j in range(len(s.spec_tokens))] + [-1]
        idx = to_device(src, torch.long, self._drafts.device)
        return torch.where(idx >= 0, self._drafts.reshape(-1)[idx.clamp_min(0)], -1)

    def verification_probs(self, rows: list) -> tuple[Optional[torch.Tensor], Optional[list[bool]]]:
        """The q rows the verification rows' drafts were drawn from and which were drawn (Sampler.verify_drafts'
        draft_probs / drawn); (None, None) when every draft was a greedy one."""
        probs, self._probs = self._probs, None
        if probs is None:
            return None, None
        n, vocab = probs.shape[1], probs.shape[2]
        src, drawn = [], []
        for _, s in rows:
            i, k = self._prob_rows[s.request.request_id], len(s.spec_tokens)
            src += [j * n + i for j in range(k)] + [i]
            drawn += [not s.request.sampling_params.greedy] * k + [False]
        return probs.reshape(-1, vocab)[to_device(src, torch.long, probs.device)], drawn


def draft_weights(spec, dtype: torch.dtype):
    """The (name, tensor) pairs of a draft checkpoint (spec.model, spec.draft_hf_config), floating-point tensors in
    the target's dtype."""
    from voltllm.model.loader import iter_weights, resolve_model

    for name, t in iter_weights(resolve_model(spec.model), spec.draft_hf_config):
        yield name, t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def load_head(runner, spec, make, what: str) -> torch.nn.Module:
    """A drafter module built by make(runner) on the runner's device, then its checkpoint's weights (spec.model) or,
    under --load-format dummy, random ones (init_dummy_weights, seeded past the target's); in eval mode."""
    import logging
    import time

    from voltllm.worker.runner import init_dummy_weights

    t0 = time.monotonic()
    mc = runner.config.model
    with torch.device(runner.device):
        model = make(runner)
    if mc.load_format == "dummy":
        with torch.no_grad():
            init_dummy_weights(model, mc.seed + 1)
    else:
        model.load_weights(draft_weights(spec, runner.dtype))
    logging.getLogger("voltllm").info("loaded %s %s in %.1f s", what, spec.model, time.monotonic() - t0)
    return model.eval()
