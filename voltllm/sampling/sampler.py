"""Batched sampler: allowed token ids, bad words, min_tokens, penalties, logit_bias, temperature, top-k / top-p /
min-p, per-request seeds, logprobs.

Order (as vLLM): a structured-output request's grammar mask (disallowed tokens to -inf) comes first, then logprobs
of that distribution (the model's: the restrictions below do not change them); then allowed_token_ids (every other
token to -inf), bad words and min_tokens bans (-inf), penalties, logit_bias, greedy argmax or temperature -> top-k ->
top-p -> min-p -> sample. Sampling uses the exponential race
(argmax of p / q with q ~ Exp(1)), so a seeded request draws its q from its own generator and gets the
same tokens whatever else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from voltllm.engine.types import PositionLogprobs
from voltllm.host_to_device import to_device, upload
from voltllm.sampling.bad_words import banned_tokens
from voltllm.sampling.bitmask import TokenBitmask, apply_token_bitmask_
from voltllm.sampling.params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs of one request for one step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    # the generated tokens (all of them for penalties; bad words read only the latest bad_words_history)
    output_token_ids: Sequence[int]
    generator: Optional[torch.Generator]
    # tokens generated before this sample, counting ones still in flight (async scheduling) that are not
    # in output_token_ids yet; None: len(output_token_ids). min_tokens needs only this count.
    num_generated: Optional[int] = None
    # a verification row's drafts before it (bad words read them after output_token_ids; penalties count them from
    # verify_drafts' prior)
    drafted: Sequence[int] = ()

    @property
    def generated(self) -> int:
        return len(self.output_token_ids) if self.num_generated is None else self.num_generated


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) of [rows, vocab] logits; on a GPU by kernels/argmax.row_argmax where ROW_ARGMAX_ON_CUDA
    says so (torch's reduction took 22.7 us of the 8B's 64-row decode step for ~5 us of reads)."""
    if logits.is_cuda and logits.dim() == 2 and logits.stride(1) == 1:
        from voltllm.kernels import argmax

        if argmax.ROW_ARGMAX_ON_CUDA:
            return argmax.row_argmax(logits)
    return logits.argmax(dim=-1)


def _pad(lists: list[Sequence[int]], device: torch.device, fill: int) -> torch.Tensor:
    width = max((len(x) for x in lists), default=0)
    out = torch.full((len(lists), max(width, 1)), fill, dtype=torch.long)
    for i, x in enumerate(lists):
        if x:
            out[i, : len(x)] = torch.as_tensor(x, dtype=torch.long)
    return out.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else out


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], prior: Optional[torch.Tensor] = None
                    ) -> torch.Tensor:
    """Repetition, frequency and presence penalties over each row's generated ids (and prompt, for repetition).
    prior: a verification's [rows, n] device ids generated before each row beyond its host history (the drafts
    before it; -1: none), counted as generated."""
    vocab = logits.shape[1]
    dev = logits.device
    rep = to_device([r.params.repetition_penalty for r in rows], logits.dtype, dev)
    freq = to_device([r.params.frequency_penalty for r in rows], logits.dtype, dev)
    pres = to_device([r.params.presence_penalty for r in rows], logits.dtype, dev)
    out_ids = _pad([r.output_token_ids for r in rows], dev, vocab)
    if prior is not None and prior.numel():
        out_ids = torch.cat([out_ids, torch.where(prior >= 0, prior, vocab).long()], dim=1)
    counts = torch.zeros(len(rows), vocab + 1, device=dev, dtype=logits.dtype)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
    counts = counts[:, :vocab]
    if any(r.params.repetition_penalty != 1.0 for r in rows):
        prompt_ids = _pad([r.prompt_token_ids for r in rows], dev, vocab)
        seen = torch.zeros(len(rows), vocab + 1, device=dev, dtype=torch.bool)
        seen.scatter_(1, prompt_ids, True)
        seen = seen[:, :vocab] | (counts > 0)
        penalty = torch.where(seen, rep[:, None], torch.ones_like(logits))
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = logits - freq[:, None] * counts - pres[:, None] * (counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside top-k, outside the top-p nucleus and below min_p * max prob (to -inf)."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    remove = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    cum_before = probs.cumsum(dim=-1) - probs
    remove |= cum_before >= top_p[:, None]  # keep the smallest prefix whose mass reaches top_p
    remove |= probs < (min_p[:, None] * probs[:, :1])
    remove[:, 0] = False  # the most likely token always survives
    masked = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, masked)


@dataclass
class SamplerOutput:
    """Device tensors of one sampling call; to_host() is the only place that waits for the GPU."""

    tokens: torch.Tensor  # [n] int64
    num_logprobs: list[Optional[int]]
    lp_rows: Optional[torch.Tensor] = None  # indices of rows that asked for logprobs
    chosen_lp: Optional[torch.Tensor] = None  # [len(lp_rows)] logprob of the sampled token
    chosen_rank: Optional[torch.Tensor] = None  # [len(lp_rows)] its vocabulary rank (token_ranks)
    top_ids: Optional[torch.Tensor] = None  # [len(lp_rows), k]
    top_vals: Optional[torch.Tensor] = None

    def copy_to_host_async(self) -> None:
        """Start device->host copies into pinned memory (non-blocking) so to_host() only waits."""
        if self.tokens.device.type != "cuda":
            return
        self.tokens = pinned_copy(self.tokens)
        if self.chosen_lp is not None:
            self.chosen_lp, self.chosen_rank = pinned_copy(self.chosen_lp), pinned_copy(self.chosen_rank)
            self.top_ids, self.top_vals = pinned_copy(self.top_ids), pinned_copy(self.top_vals)

    def to_host(self) -> tuple[list[int], list[Optional[PositionLogprobs]]]:
        tokens = self.tokens.tolist()
        out: list[Optional[PositionLogprobs]] = [None] * len(tokens)
        if self.lp_rows is None:
            return tokens, out
        chosen, ranks = self.chosen_lp.tolist(), self.chosen_rank.tolist()
        ti, tv = self.top_ids.tolist(), self.top_vals.tolist()
        for j, i in enumerate(self.lp_rows.tolist()):
            k = self.num_logprobs[i]
            out[i] = position_logprobs(tokens[i], chosen[j], ranks[j], ti[j][:k], tv[j][:k])
        return tokens, out


def token_ranks(logprobs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Each row's vocabulary rank of the logprob `chosen[row]` (1 = most likely), counted as vLLM counts it: the
    entries whose logprob is >= it, so tied tokens rank after one another and a token outside the top-k always ranks
    below all k. One comparison and a sum per row, on the logprobs' device."""
    return (logprobs >= chosen[:, None]).sum(dim=-1)


def position_logprobs(token: int, logprob: float, rank: int, top_ids: Sequence[int],
                      top_vals: Sequence[float]) -> PositionLogprobs:
    """One position's {token: (logprob, rank)} in vLLM's order: the chosen token first, then the top-k ranked
    1..k (a chosen token among them takes its top-k rank, as in vLLM; they differ only between ties)."""
    d: PositionLogprobs = {token: (logprob, rank)}
    for r, (t, v) in enumerate(zip(top_ids, top_vals), 1):
        d[t] = (v, r)
    return d


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A device -> host copy into pinned memory, started without waiting (the step's event covers it)."""
    h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    h.copy_(t, non_blocking=True)
    return h


def _add_logit_bias_(logits: torch.Tensor, rows: list["SamplingRow"]) -> torch.Tensor:
    """Each row's logit_bias added to fp32 `logits` in place; returns them."""
    items = [(i, tok, b) for i, r in enumerate(rows) for tok, b in (r.params.logit_bias or {}).items()]
    logits.index_put_(_cells([(i, t) for i, t, _ in items], logits.device),
                      to_device([b for _, _, b in items], torch.float32, logits.device), accumulate=True)
    return logits


def _allow_only_(logits: torch.Tensor, allowed: list[tuple[int, list[int]]]) -> None:
    """Set every logit of row i outside its allowed ids to -inf, in place, for each (i, ids) of `allowed`."""
    dev = logits.device
    rows = to_device([i for i, _ in allowed], torch.long, dev)
    keep = torch.zeros(len(allowed), logits.shape[1], dtype=torch.bool, device=dev)
    lengths = torch.tensor([len(ids) for _, ids in allowed])
    cells = (upload(torch.repeat_interleave(torch.arange(len(allowed)), lengths), dev),
             to_device([t for _, ids in allowed for t in ids], torch.long, dev))
    keep.index_put_(cells, keep.new_ones(()))
    logits[rows] = logits[rows].masked_fill_(~keep, float("-inf"))


def _restrictions(rows: list[SamplingRow]) -> tuple[list, list]:
    """Each row's allowed ids (allowed_token_ids) and banned ids: min_tokens' stop tokens before the minimum, bad
    words whose prefix was just generated; as (row, ids) lists of the rows that have any."""
    allowed = [(i, r.params.allowed_token_ids) for i, r in enumerate(rows) if r.params.allowed_token_ids]
    bans = []
    for i, r in enumerate(rows):
        sp = r.params
        banned = []
        if r.generated < sp.min_tokens:
            banned = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(sp._eos_token_ids))
        if sp._bad_words_token_ids:
            latest = [*r.output_token_ids, *r.drafted] if r.drafted else r.output_token_ids
            banned += banned_tokens(sp._bad_words_token_ids, latest)
        if banned:
            bans.append((i, banned))
    return allowed, bans


def _restrict_(logits: torch.Tensor, allowed: list, bans: list) -> None:
    """-inf, in place, outside each row's allowed ids and at its banned ids (_restrictions' lists)."""
    if allowed:
        _allow_only_(logits, allowed)
    if bans:
        cells = _cells([(i, t) for i, banned in bans for t in banned], logits.device)
        logits.index_put_(cells, logits.new_full((), float("-inf")))  # a fill, not a copy


def _cells(pairs: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) pairs -> device index tensors for index_put_. Not a Python-list index: that would be copied
    from pageable memory and sync the stream, so every step would wait for the GPU (no async scheduling)."""
    return (to_device([r for r, _ in pairs], torch.long, device), to_device([t for _, t in pairs], torch.long, device))


def _logprob_tensors(raw_logprobs: torch.Tensor, sampled: torch.Tensor, out: SamplerOutput) -> None:
    want = [i for i, n in enumerate(out.num_logprobs) if n is not None]
    if not want:
        return
    k = max(out.num_logprobs[i] for i in want)
    rows = to_device(want, torch.long, sampled.device)
    sub = raw_logprobs[rows]
    out.lp_rows = torch.tensor(want)
    out.chosen_lp = sub.gather(1, sampled[rows, None]).squeeze(1)
    out.chosen_rank = token_ranks(sub, out.chosen_lp)
    out.top_vals, out.top_ids = sub.topk(max(k, 1), dim=-1)


class Sampler:
    def __init__(self, default_generator: Optional[torch.Generator] = None):
        self.default_generator = default_generator

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]
                 ) -> tuple[list[int], list[Optional[PositionLogprobs]]]:
        return self.sample(logits, rows).to_host()

    def sample_argmax(self, logits: torch.Tensor, token_bitmask: Optional[TokenBitmask] = None) -> SamplerOutput:
        """`sample` for rows whose params are all `argmax_only`: the same tokens, without building their rows
        (at 64 rows on a slow host CPU the per-row work costs more than the GPU's argmax). token_bitmask: as in
        `sample` (applied to a copy)."""
        if token_bitmask is not None:
            logits = apply_token_bitmask_(logits.clone(), token_bitmask)
        return SamplerOutput(tokens=greedy_tokens(logits), num_logprobs=[None] * logits.shape[0])

    def argmax_output(self, tokens: torch.Tensor) -> SamplerOutput:
        """`sample_argmax`'s result for rows whose argmax the LM head took itself (the model's greedy_tokens)."""
        return SamplerOutput(tokens=tokens, num_logprobs=[None] * tokens.shape[0])

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow], logits_owned: bool = False,
               token_bitmask: Optional[TokenBitmask] = None) -> SamplerOutput:
        """logits_owned: the caller hands `logits` over (the runner's fresh lm_head output), so min_tokens bans
        and the grammar mask may be written into it; otherwise the caller's tensor is left as it was.
        token_bitmask: structured outputs' allowed tokens of the constrained rows (on the logits' device), applied
        before anything else, logprobs included (as vLLM)."""
        num_lp = [r.params.logprobs for r in rows]
        greedy_mask = [r.params.greedy for r in rows]
        penalties = any(r.params.has_penalties for r in rows)
        biased = any(r.params.logit_bias for r in rows)
        allowed, bans = _restrictions(rows)
        # a greedy batch takes the argmax of the model's logits as they are (exact either way: fp16 / bf16 widen
        # to fp32 exactly), with its bans written as -inf in that dtype; anything else works on an fp32 copy.
        # (At 64 rows x 152K vocabulary the fp32 copy and its argmax cost ~50 us per decode step.)
        if not (all(greedy_mask) and not penalties and not biased and all(n is None for n in num_lp)):
            logits = logits.float() if logits.dtype != torch.float32 or logits_owned else logits.clone()
        elif (bans or allowed or token_bitmask is not None) and not logits_owned:
            logits = logits.clone()
        if token_bitmask is not None:
            apply_token_bitmask_(logits, token_bitmask)
        dev = logits.device
        raw_logprobs = logits.log_softmax(dim=-1) if any(n is not None for n in num_lp) else None
        _restrict_(logits, allowed, bans)
        if penalties:
            logits = apply_penalties(logits, rows)
        if biased:  # added to the fp32 copy
            _add_logit_bias_(logits, rows)

        sampled = greedy_tokens(logits)
        if not all(greedy_mask):
            probs = _shaped_probs(logits, rows)
            random_tokens = (probs / self._race_noise(probs, rows, greedy_mask)).argmax(dim=-1)
            if any(greedy_mask):
                sampled = torch.where(to_device(greedy_mask, torch.bool, dev), sampled, random_tokens)
            else:
                sampled = random_tokens

        out = SamplerOutput(tokens=sampled, num_logprobs=num_lp)
        if raw_logprobs is not None:
            _logprob_tensors(raw_logprobs, sampled, out)
        return out

    def _race_noise(self, probs: torch.Tensor, rows: list[SamplingRow], skip: list[bool]) -> torch.Tensor:
        """q ~ Exp(1) per element for the exponential race (argmax of p / q samples p); seeded rows draw theirs
        from their own generator (rows marked in `skip` keep the default's: their draw is not used)."""
        q = torch.empty_like(probs).exponential_(generator=self.default_generator)
        for i, r in enumerate(rows):
            if r.generator is not None and not skip[i]:
                q[i].exponential_(generator=r.generator)
        return q

    def draw_drafts(self, logits: torch.Tensor, rows: list[SamplingRow]
                    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """A draft model's tokens for one proposal step: the argmax for greedy rows (a deterministic draft), a draw
        from the row's processed distribution q for the others (logit_bias, temperature, top-k / top-p / min-p: as
        verify_drafts processes the target's, so q is near p). Returns the tokens and q (fp32 [rows, vocab]; greedy
        rows' q is not a distribution the draft was drawn from), or None for q when every row is greedy."""
        greedy = [r.params.greedy for r in rows]
        if all(greedy):
            return logits.argmax(dim=-1), None
        probs = _shaped_probs(_processed_logits(logits, rows), rows)
        tokens = (probs / self._race_noise(probs, rows, greedy)).argmax(dim=-1)
        if any(greedy):
            tokens = torch.where(to_device(greedy, torch.bool, logits.device), logits.argmax(dim=-1), tokens)
        return tokens, probs

    def verify_drafts(self, logits: torch.Tensor, rows: list[SamplingRow], drafts: "list[int] | torch.Tensor",
                      draft_probs: Optional[torch.Tensor] = None,
                      drawn: Optional[list[bool]] = None, prior: Optional[torch.Tensor] = None) -> "DraftVerdicts":
        """Speculative sampling, exact for any temperature / top-k / top-p / min-p / logit_bias: row i scores draft
        drafts[i] (-1: a row after the last draft, sampled as usual) under the model's processed distribution p.
        A deterministic draft d (n-gram, or a draft model's argmax) is accepted with probability p(d); where it is
        not, the row's token comes from p with d removed (renormalized). A draft drawn from a draft model's q
        (drawn[i]; q = draft_probs[i]) is accepted with probability min(1, p(d) / q(d)); where it is not, the token
        comes from max(0, p - q) (renormalized). Either way every emitted token is distributed as p (a
        deterministic draft is the case q = one-hot at d). Greedy rows: p is one-hot at the argmax. `drafts` may be
        a device tensor (-1 likewise). Penalties count each row's host history (SamplingRow.output_token_ids) and
        `prior` (apply_penalties: the drafts before the row), so row j's p is the one plain decoding would have
        after accepting them. allowed_token_ids and min_tokens' stop bans (row j counts j more generated tokens:
        SamplingRow.generated) and bad words (after the row's history and the drafts before it: SamplingRow.drafted) are
        applied as the sampler applies them, so a draft they exclude is rejected."""
        dev = logits.device
        allowed, bans = _restrictions(rows)
        if allowed or bans:  # (on a copy: the caller's logits stay as they are)
            logits = logits.float().clone()
            _restrict_(logits, allowed, bans)
        if any(r.params.has_penalties for r in rows):  # (before the bias, as the sampler orders them)
            logits = apply_penalties(logits.float(), rows, prior)
        logits = _processed_logits(logits, rows)
        greedy = [r.params.greedy for r in rows]
        if all(greedy):
            probs = torch.zeros_like(logits)
        else:
            probs = _shaped_probs(logits, rows)
        if any(greedy):
            g = to_device([i for i, x in enumerate(greedy) if x], torch.long, dev)
            probs[g] = 0.0
            probs[g, logits[g].argmax(dim=-1)] = 1.0
        if isinstance(drafts, torch.Tensor):  # (a draft model's, still on the device)
            d, has_draft = drafts.clamp_min(0), drafts >= 0
        else:
            d = to_device([max(x, 0) for x in drafts], torch.long, dev)
            has_draft = to_device([x >= 0 for x in drafts], torch.bool, dev)
        u = torch.empty(len(rows), device=dev).uniform_(generator=self.default_generator)
        for i, r in enumerate(rows):
            if r.generator is not None and not greedy[i]:
                u[i:i + 1].uniform_(generator=r.generator)
        p_draft = probs.gather(1, d[:, None])[:, 0]
        if draft_probs is None or not any(drawn or ()):
            accepted = has_draft & (u < p_draft)
            residual = probs.scatter(1, d[:, None], torch.where(has_draft, 0.0, p_draft)[:, None])
        else:
            is_drawn = to_device([bool(x) for x in drawn], torch.bool, dev) & has_draft
            q = torch.where(is_drawn[:, None], draft_probs.float(), 0.0)
            det = has_draft & ~is_drawn  # deterministic drafts: q one-hot at d
            q.scatter_add_(1, d[:, None], det.float()[:, None])
            q_draft = q.gather(1, d[:, None])[:, 0]
            accepted = has_draft & (u * q_draft < p_draft)
            residual = torch.where(has_draft[:, None], (probs - q).clamp_min_(0.0), probs)
            # p == q leaves no residual, and then no rejection either (bar rounding): keep p there
            residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, probs)
        tokens = (residual / self._race_noise(residual, rows, greedy)).argmax(dim=-1)
        return DraftVerdicts(tokens=tokens, accepted=accepted)


@dataclass
class DraftVerdicts:
    """verify_drafts' device results: per row, whether its draft is accepted and the token it emits if not."""

    tokens: torch.Tensor
    accepted: torch.Tensor

    def copy_to_host_async(self) -> None:
        if self.tokens.device.type == "cuda":
            self.tokens, self.accepted = pinned_copy(self.tokens), pinned_copy(self.accepted)

    def to_host(self) -> tuple[list[int], list[bool]]:
        return self.tokens.tolist(), self.accepted.tolist()


@dataclass
class SpecLogprobs:
    """Logprobs of a verification's rows for the requests that asked for them, on the device until to_host. A row
    emits either its draft (accepted) or the verification's own token there, known only on the host after
    acceptance, so both candidates' raw logprobs and ranks are taken ([rows, 2]: draft, own token; the row after the
    drafts: own token twice) with the row's top-k. Raw logprobs (the model's log-softmax), as the sampler's."""

    rows: list[int]  # the verification rows (indices into its logits) taken, in order
    num_logprobs: list[int]  # per taken row, its request's k
    cand: torch.Tensor  # [n, 2] token ids
    cand_lp: torch.Tensor  # [n, 2]
    cand_rank: torch.Tensor  # [n, 2]
    top_ids: torch.Tensor  # [n, kmax]
    top_vals: torch.Tensor

    @classmethod
    def take(cls, logits: torch.Tensor, rows: list[int], num_logprobs: list[int], drafts: torch.Tensor,
             own: torch.Tensor) -> "SpecLogprobs":
        """logits: the verification's; rows: the ones to take; drafts / own: every verification row's draft (-1
        after the last) and own token (device tensors)."""
        sel = to_device(rows, torch.long, logits.device)
        lp = logits[sel].float().log_softmax(dim=-1)
        own_t = own[sel].long()
        cand = torch.stack([torch.where(drafts[sel] >= 0, drafts[sel].long(), own_t), own_t], dim=1)
        cand_lp = lp.gather(1, cand)
        rank = torch.stack([token_ranks(lp, cand_lp[:, i]) for i in range(2)], dim=1)
        top_vals, top_ids = lp.topk(max(max(num_logprobs), 1), dim=-1)
        return cls(rows, num_logprobs, cand, cand_lp, rank, top_ids, top_vals)

    def copy_to_host_async(self) -> None:
        if self.cand.device.type == "cuda":
            for name in ("cand", "cand_lp", "cand_rank", "top_ids", "top_vals"):
                setattr(self, name, pinned_copy(getattr(self, name)))

    def to_host(self) -> dict[int, tuple]:
        """verification row -> (candidate ids, their logprobs, their ranks, top ids, top logprobs) (lists, top-k
        cut to the row's request's k)."""
        cand, lp, rank = self.cand.tolist(), self.cand_lp.tolist(), self.cand_rank.tolist()
        ti, tv = self.top_ids.tolist(), self.top_vals.tolist()
        return {r: (cand[j], lp[j], rank[j], ti[j][:k], tv[j][:k])
                for j, (r, k) in enumerate(zip(self.rows, self.num_logprobs))}


def verified_position_logprobs(entry: tuple, token: int) -> PositionLogprobs:
    """One emitted token's logprobs from its row's SpecLogprobs entry (the token is one of the two candidates)."""
    cand, lp, rank, top_ids, top_vals = entry
    i = cand.index(token)
    return position_logprobs(token, lp[i], rank[i], top_ids, top_vals)


def _processed_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """fp32 logits with each row's logit_bias added (on a copy: the caller's logits stay as they are)."""
    if any(r.params.logit_bias for r in rows):
        return _add_logit_bias_(logits.to(torch.float32, copy=True), rows)
    return logits.float()


def _shaped_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution each row samples from: fp32 logits / temperature, then top-k, top-p and min-p."""
    dev = logits.device
    temp = to_device([max(r.params.temperature, 1e-5) for r in rows], torch.float32, dev)
    scaled = logits / temp[:, None]
    if any(r.params.top_k > 0 or r.params.top_p < 1.0 or r.params.min_p > 0.0 for r in rows):
        top_k = to_device([r.params.top_k for r in rows], torch.long, dev)
        top_p = to_device([r.params.top_p for r in rows], torch.float32, dev)
        min_p = to_device([r.params.min_p for r in rows], torch.float32, dev)
        scaled = apply_top_k_top_p_min_p(scaled, top_k, top_p, min_p)
    return scaled.softmax(dim=-1)
