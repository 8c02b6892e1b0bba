"""Speculative decoding: `--speculative-config` and the n-gram (prompt lookup) proposer.

The proposer guesses a request's next tokens by finding the most recent earlier occurrence of its last n tokens
(n from prompt_lookup_max down to prompt_lookup_min) in its own prompt and output, and proposing what followed
there. The scheduler adds the guesses to the request's next step; the model scores them all in that one step
(like a prompt chunk). Greedy requests accept the longest prefix that the model's own choices agree with, plus the
model's next token after it, so they produce exactly the tokens they would without speculation; sampled requests
accept each draft with the model's probability of it and otherwise sample from the rest of the distribution
(speculative sampling with a deterministic draft), so their tokens keep the model's distribution. Either way in
fewer steps when the text repeats itself (code edits, quoting, structured output).

A draft model (`"model": ...`, method "draft_model") proposes instead: the scheduler reserves the draft slots and
the runner's draft model (worker/draft_runner.py) fills them with its greedy choices before the step runs, so the
same verification applies (engine/draft_model.py checks the draft at configuration time).

A DFlash drafter (`"method": "dflash"`) drafts instead: one forward of a small block-diffusion model conditioned on
the target's hidden states fills the same reserved slots (engine/dflash.py, worker/dflash_runner.py).

MTP (`"method": "mtp"`) drafts with the target's own multi-token-prediction module (Qwen3-Next / Qwen3.5 checkpoints'
mtp.* weights), chained K times, in the same reserved slots (engine/mtp.py, worker/mtp_runner.py).

An EAGLE-3 head (`"method": "eagle3"`) drafts as MTP does, chaining its one decoder layer K times, fed by three of
the target's layers' hidden states (engine/eagle3.py, worker/eagle3_runner.py); an EAGLE-1 head (`"method": "eagle"`)
likewise, fed the target's last hidden state (engine/eagle1.py, worker/eagle1_runner.py).

Suffix decoding (`"method": "suffix"`) drafts on the host as the n-gram proposer does, from suffix automata of the
request's own tokens and of recent requests' outputs, a number of drafts that grows with the match
(engine/suffix_decoding.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

METHODS = ("ngram", "draft_model", "dflash", "mtp", "eagle", "eagle3", "suffix")
# vLLM's older method names that mean MTP on the targets built here
# vLLM's older / model-named spellings (Qwen3.5's MTP is the same layer as Qwen3-Next's)
_ALIASES = {"[ngram]": "ngram", "qwen3_next_mtp": "mtp", "qwen3_5_mtp": "mtp"}
# vLLM's keys for a drafter (draft model, DFlash, MTP): how it draws its drafts, whether it runs without CUDA graphs,
# and its KV cache dtype / attention backend (each also under its draft_ name), where only what the drafter here does
# is accepted (_drafter_options)
_DRAFTER_KEYS = {"draft_sample_method", "enforce_eager", "kv_cache_dtype", "draft_kv_cache_dtype", "attention_backend",
                 "draft_attention_backend"}
# vLLM's keys, per method; draft_tensor_parallel_size: 1 or the target's --tensor-parallel-size (EngineArgs checks it
# against the target's): whole on rank 0, or split as the target is; absent: split for MTP, DFlash and the EAGLE heads
# (they borrow the target's vocabulary-parallel tables), whole for a draft model (a small draft's per-layer all-reduces
# cost more than its weights' read on one GPU)
_SPLIT_DRAFTERS = ("mtp", "dflash", "eagle", "eagle3")  # drafters split over -tp ranks like the target (drafter_split)
_SUFFIX_KEYS = {"suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"}
# vLLM's dynamic speculative decoding: drafts per step by the step's batch size (the older name and the newer one)
_SCHEDULE_KEYS = ("num_speculative_tokens_per_batch_size", "speculative_token_schedule")
_KEYS = {"ngram": {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"},
         "suffix": {"method", "num_speculative_tokens"} | _SUFFIX_KEYS,
         "draft_model": {"method", "model", "num_speculative_tokens", "draft_tensor_parallel_size", "revision"}
         | _DRAFTER_KEYS,
         "dflash": {"method", "model", "num_speculative_tokens", "draft_tensor_parallel_size", "revision"}
         | _DRAFTER_KEYS,
         "mtp": {"method", "num_speculative_tokens", "draft_tensor_parallel_size"} | _DRAFTER_KEYS,
         "eagle": {"method", "model", "num_speculative_tokens", "draft_tensor_parallel_size", "revision"}
         | _DRAFTER_KEYS,
         "eagle3": {"method", "model", "num_speculative_tokens", "draft_tensor_parallel_size", "revision"}
         | _DRAFTER_KEYS}
# every method also takes vLLM's max_model_len: the longest sequence that drafts (beyond it, plain decoding)
_KEYS = {method: keys | set(_SCHEDULE_KEYS) | {"max_model_len"} for method, keys in _KEYS.items()}
# vLLM's methods refused here with a reason of their own
_REFUSED: dict[str, str] = {}
# draft_sample_method: "probabilistic" draws a sampled request's drafts from the drafter's own distribution q and
# verifies them with min(1, p / q); "greedy" takes the drafter's argmax for every request (verified as one-hot q, so
# sampled outputs keep the target's distribution either way). vLLM's default is greedy; this engine's is
# probabilistic, which it had before the key existed
DRAFT_SAMPLE_METHODS = ("probabilistic", "greedy")
# the attention backends a drafter may name: the one it shares with the target (--attention-backend's names)
_DRAFT_ATTENTION_BACKENDS = ("TRITON_ATTN", "FLASH_ATTN_V100", "TORCH_REF")


# the most drafts one step may take (num_speculative_tokens)
MAX_SPECULATIVE_TOKENS = 32

# a draft model's draft slot before the runner fills it (ScheduledRequest.spec_tokens)
DRAFT_PLACEHOLDER = -1


class SpeculativeConfigError(ValueError):
    """A --speculative-config this engine cannot apply."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # draft_model: the draft's path or Hub repo id as given, then (engine/draft_model.resolve_draft) its local path
    # and its HF config
    model: Optional[str] = None
    revision: Optional[str] = None
    draft_hf_config: Any = field(default=None, compare=False, repr=False)
    # a drafter's (draft model, DFlash, MTP): how it draws drafts for sampled requests (DRAFT_SAMPLE_METHODS), and
    # whether it runs without its CUDA graphs (the target keeps its own unless --enforce-eager)
    draft_sample_method: str = "probabilistic"
    draft_enforce_eager: bool = False
    # suffix decoding (vLLM's keys and defaults): the automata's depth (the match plus its draft), the requests whose
    # outputs are cached (0: none), drafts per matched token, and a draft token's least empirical probability
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # dynamic speculative decoding (vLLM's num_speculative_tokens_per_batch_size): (first, last, drafts) batch-size
    # ranges, sorted; empty: num_speculative_tokens at every batch size (drafts_for_batch)
    draft_schedule: tuple[tuple[int, int, int], ...] = ()
    # vLLM's max_model_len: a request drafts only while its tokens and drafts fit in it; as given, then (EngineArgs:
    # speculative_max_len) at most the target's --max-model-len and a draft model's positions
    max_model_len: Optional[int] = None
    # vLLM's draft_tensor_parallel_size as given (None: absent): 1 keeps a drafter whole on rank 0 under -tp, the
    # target's size splits it like the target; absent, drafter_split decides by method
    draft_tensor_parallel_size: Optional[int] = None

    def drafter_split(self, parallel: Any) -> bool:
        """Whether the drafter is split over the tensor-parallel ranks like the target (every rank runs it: MTP, DFlash
        and the EAGLE heads under -tp without -pp, unless draft_tensor_parallel_size is 1; a draft model when it is
        the target's), else whole on rank 0."""
        if parallel.tensor_parallel_size == 1 or parallel.pipeline_parallel_size > 1:
            return False
        if self.method == "draft_model":  # (split only when asked: draft_tensor_parallel_size the target's)
            return (self.draft_tensor_parallel_size or 1) > 1
        return self.method in _SPLIT_DRAFTERS and self.draft_tensor_parallel_size != 1

    def drafts_for_batch(self, batch_size: int) -> int:
        """The most drafts a request may take in a step of `batch_size` requests: the schedule's K for the range
        holding it (between ranges, and past the last, the K of the range before), at most num_speculative_tokens;
        0 turns speculation off for that step."""
        k = self.num_speculative_tokens
        for first, _last, drafts in self.draft_schedule:
            if first > batch_size:
                break
            k = min(drafts, self.num_speculative_tokens)
        return k

    @property
    def uses_suffix(self) -> bool:
        return self.method == "suffix"

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @property
    def uses_dflash(self) -> bool:
        return self.method == "dflash"

    @property
    def uses_mtp(self) -> bool:
        return self.method == "mtp"

    @property
    def uses_eagle3(self) -> bool:
        return self.method == "eagle3"

    @property
    def uses_eagle1(self) -> bool:
        return self.method == "eagle"

    @property
    def drafts_on_device(self) -> bool:
        """The scheduler reserves placeholder draft slots the runner fills (draft model, DFlash, MTP, EAGLE-1 / 3)."""
        return self.method in ("draft_model", "dflash", "mtp", "eagle", "eagle3")

    def drafts_room(self, num_tokens: int) -> Optional[int]:
        """The most drafts a request of num_tokens tokens may take under max_model_len (None: no such limit)."""
        return None if self.max_model_len is None else max(0, self.max_model_len - num_tokens)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpeculativeConfig":
        cfg = cls._parse(d)
        schedule = _draft_schedule(d)
        limit = d.get("max_model_len")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise SpeculativeConfigError(f"--speculative-config max_model_len must be a positive integer (the "
                                         f"longest sequence that takes drafts), got {limit!r}")
        return replace(cfg, draft_schedule=schedule, max_model_len=limit)

    @classmethod
    def _parse(cls, d: dict[str, Any]) -> "SpeculativeConfig":
        method = str(d.get("method") or "").lower()
        method = _ALIASES.get(method, method)
        if not method and d.get("model"):  # vLLM: a model without a method is a draft model
            method = "draft_model"
        if method in _REFUSED:
            raise SpeculativeConfigError(f"--speculative-config method {method!r}: {_REFUSED[method]}")
        if method not in METHODS:
            raise SpeculativeConfigError(f"--speculative-config method {d.get('method')!r} is not built yet "
                                         f"(built: {', '.join(METHODS)})")
        unknown = sorted(set(d) - _KEYS[method])
        if unknown and method == "mtp" and "model" in unknown:
            raise SpeculativeConfigError("--speculative-config method mtp drafts with the target checkpoint's own "
                                         "mtp.* weights: leave out \"model\"")
        if unknown:
            raise SpeculativeConfigError(f"--speculative-config: unsupported keys for {method}: {', '.join(unknown)}")
        if method == "suffix":
            return cls._suffix(d)
        k = d.get("num_speculative_tokens")
        _check_num_speculative_tokens(k)
        if method in ("draft_model", "dflash", "eagle", "eagle3"):
            return replace(cls._draft_model(d, k, method), **_drafter_options(d))
        if method == "mtp":  # its weights are the target's: nothing else to read
            return cls("mtp", k, draft_tensor_parallel_size=_draft_tp(d), **_drafter_options(d))
        hi = d.get("prompt_lookup_max", cls.prompt_lookup_max if d.get("prompt_lookup_min") is None
                   else max(cls.prompt_lookup_max, d["prompt_lookup_min"]))
        lo = d.get("prompt_lookup_min", min(cls.prompt_lookup_min, hi) if isinstance(hi, int) else 1)
        for name, v in (("prompt_lookup_max", hi), ("prompt_lookup_min", lo)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SpeculativeConfigError(f"--speculative-config {name} must be a positive integer, got {v!r}")
        if lo > hi:
            raise SpeculativeConfigError(f"--speculative-config prompt_lookup_min ({lo}) exceeds prompt_lookup_max "
                                         f"({hi})")
        return cls(method, k, hi, lo)

    @classmethod
    def _suffix(cls, d: dict[str, Any]) -> "SpeculativeConfig":
        """Suffix decoding's keys, checked as vLLM checks them; num_speculative_tokens, the most drafts a step may
        take, defaults to the tree depth (vLLM's default)."""
        def number(key: str, integer: bool) -> Any:
            v = d.get(key, getattr(cls, key))
            if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
                raise SpeculativeConfigError(f"--speculative-config {key} must be "
                                             f"{'an integer' if integer else 'a number'}, got {v!r}")
            return v

        depth = number("suffix_decoding_max_tree_depth", True)
        cached = number("suffix_decoding_max_cached_requests", True)
        factor = number("suffix_decoding_max_spec_factor", False)
        min_prob = number("suffix_decoding_min_token_prob", False)
        if depth < 1:
            raise SpeculativeConfigError(f"--speculative-config suffix_decoding_max_tree_depth {depth} must be >= 1")
        if cached < 0:
            raise SpeculativeConfigError(f"--speculative-config suffix_decoding_max_cached_requests {cached} must be "
                                         ">= 0 (0: no cache of earlier requests' outputs)")
        if factor < 0:
            raise SpeculativeConfigError(f"--speculative-config suffix_decoding_max_spec_factor {factor} must be "
                                         ">= 0")
        if not 0 <= min_prob <= 1:
            raise SpeculativeConfigError(f"--speculative-config suffix_decoding_min_token_prob {min_prob} must be in "
                                         "[0, 1]")
        k = d.get("num_speculative_tokens")
        if k is None:
            k = depth
            if k > MAX_SPECULATIVE_TOKENS:
                raise SpeculativeConfigError(
                    f"--speculative-config method suffix: num_speculative_tokens defaults to "
                    f"suffix_decoding_max_tree_depth ({depth}), above the {MAX_SPECULATIVE_TOKENS} drafts a step may "
                    f"take here; give num_speculative_tokens (1..{MAX_SPECULATIVE_TOKENS})")
        _check_num_speculative_tokens(k)
        return cls("suffix", k, suffix_decoding_max_tree_depth=depth, suffix_decoding_max_cached_requests=cached,
                   suffix_decoding_max_spec_factor=float(factor), suffix_decoding_min_token_prob=float(min_prob))

    @classmethod
    def _draft_model(cls, d: dict[str, Any], k: int, method: str = "draft_model") -> "SpeculativeConfig":
        model = d.get("model")
        if not isinstance(model, str) or not model:
            raise SpeculativeConfigError(f"--speculative-config method {method} needs \"model\": the draft "
                                         "model's path or Hugging Face repo id")
        tp = _draft_tp(d)
        revision = d.get("revision")
        if revision is not None and not isinstance(revision, str):
            raise SpeculativeConfigError(f"--speculative-config revision must be a string, got {revision!r}")
        return cls(method, k, model=model, revision=revision, draft_tensor_parallel_size=tp)

    def with_draft(self, path: str, hf_config: Any) -> "SpeculativeConfig":
        """This config with the draft resolved: its local path and HF config."""
        return replace(self, model=path, draft_hf_config=hf_config)


def _draft_tp(d: dict[str, Any]) -> Optional[int]:
    """draft_tensor_parallel_size as given (None: absent): any positive size here (EngineArgs: 1 or the target's)."""
    tp = d.get("draft_tensor_parallel_size")
    if tp is not None and (not isinstance(tp, int) or isinstance(tp, bool) or tp < 1):
        raise SpeculativeConfigError(f"--speculative-config draft_tensor_parallel_size must be a positive integer, got "
                                     f"{tp!r}")
    return tp


def _draft_schedule(d: dict[str, Any]) -> tuple[tuple[int, int, int], ...]:
    """vLLM's dynamic speculative decoding schedule, checked as vLLM checks it: [first, last, K] batch-size ranges
    (inclusive, positive, first <= last, K >= 0), apart and starting at 1; returned sorted. Its (batch size x
    context) form, five numbers a range, is refused."""
    given = [key for key in _SCHEDULE_KEYS if d.get(key) is not None]
    if not given:
        return ()
    if len(given) > 1:
        raise SpeculativeConfigError(f"--speculative-config: give {given[0]} or {given[1]}, not both (the same "
                                     "schedule under its older and newer names)")
    key, raw = given[0], d[given[0]]
    if not isinstance(raw, (list, tuple)) or not raw:
        raise SpeculativeConfigError(f"--speculative-config {key} must be a non-empty list of [first batch size, "
                                     "last batch size, num_speculative_tokens] ranges, e.g. [[1, 16, 4], [17, 64, 1], "
                                     "[65, 1024, 0]]")
    ranges = []
    for entry in raw:
        if isinstance(entry, (list, tuple)) and len(entry) == 5:
            raise SpeculativeConfigError(f"--speculative-config {key}: ranges of batch size and context length "
                                         f"(five numbers, {list(entry)}) are not built; give [first, last, K] "
                                         "batch-size ranges")
        if (not isinstance(entry, (list, tuple)) or len(entry) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in entry)):
            raise SpeculativeConfigError(f"--speculative-config {key}: each range is three integers [first batch "
                                         f"size, last batch size, num_speculative_tokens], got {entry!r}")
        first, last, k = entry
        if first < 1 or last < first:
            raise SpeculativeConfigError(f"--speculative-config {key}: batch-size range {first}..{last} must be "
                                         "positive with first <= last")
        if k < 0:
            raise SpeculativeConfigError(f"--speculative-config {key}: num_speculative_tokens {k} in range "
                                         f"{first}..{last} must be >= 0 (0: no speculation at those batch sizes)")
        ranges.append((first, last, k))
    ranges.sort()
    if ranges[0][0] != 1:
        raise SpeculativeConfigError(f"--speculative-config {key}: the first batch-size range must start at 1 (so "
                                     "every batch size has its number of drafts)")
    for (_, last, _), (first, _, _) in zip(ranges, ranges[1:]):
        if first <= last:
            raise SpeculativeConfigError(f"--speculative-config {key}: batch-size ranges overlap at {first}")
    return tuple(ranges)


def _check_num_speculative_tokens(k: Any) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise SpeculativeConfigError("--speculative-config needs num_speculative_tokens, an integer in "
                                     f"1..{MAX_SPECULATIVE_TOKENS}")


def _drafter_options(d: dict[str, Any]) -> dict[str, Any]:
    """The SpeculativeConfig fields of a drafter's vLLM keys; what the drafter here cannot do is refused by name."""
    method = d.get("draft_sample_method", "probabilistic")
    if method not in DRAFT_SAMPLE_METHODS:
        raise SpeculativeConfigError(f"--speculative-config draft_sample_method {method!r}: expected one of "
                                     f"{', '.join(DRAFT_SAMPLE_METHODS)}")
    eager = d.get("enforce_eager", False)
    if eager is None:  # vLLM: None follows the target's setting
        eager = False
    if not isinstance(eager, bool):
        raise SpeculativeConfigError(f"--speculative-config enforce_eager must be true or false, got {eager!r}")
    for key in ("kv_cache_dtype", "draft_kv_cache_dtype"):
        v = d.get(key)
        if v is not None and v != "auto":
            raise SpeculativeConfigError(f"--speculative-config {key} {v!r}: the drafter's KV cache is kept in the "
                                         "model's dtype here; only \"auto\" is built")
    for key in ("attention_backend", "draft_attention_backend"):
        v = d.get(key)
        if v is not None and v not in _DRAFT_ATTENTION_BACKENDS:
            raise SpeculativeConfigError(f"--speculative-config {key} {v!r}: the drafter runs on the target's "
                                         f"attention backend (names accepted: {', '.join(_DRAFT_ATTENTION_BACKENDS)})")
    return {"draft_sample_method": method, "draft_enforce_eager": eager}


class NgramIndex:
    """Where each n-gram (n in [lo, hi]) of a token sequence last ended with a token after it, kept up to date as
    tokens are appended (O(hi - lo + 1) dict updates per token, so a step's lookups stay O(1) at any length)."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.last_end: dict[tuple[int, ...], int] = {}
        self.seen = 0  # tokens indexed: n-grams ending before seen - 1 are registered

    def update(self, tokens: list[int]) -> None:
        """Register the n-grams that now have a follower (those ending at seen - 1 .. len(tokens) - 2)."""
        for end in range(max(self.seen - 1, 0), len(tokens) - 1):
            for n in range(self.lo, min(self.hi, end + 1) + 1):
                self.last_end[tuple(tokens[end - n + 1:end + 1])] = end
        self.seen = len(tokens)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix."""
        if k <= 0:
            return []
        self.update(tokens)
        for n in range(min(self.hi, len(tokens) - 1), self.lo - 1, -1):
            end = self.last_end.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end + 1:end + 1 + k]
        return []


def accept_drafts(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens a greedy verification emits: the drafts while they equal the model's choice at their position,
    then the model's choice where the first one differs (or after the last draft). targets[i] is the model's
    choice after the known tokens and drafts[:i] (len(targets) == len(drafts) + 1)."""
    out = []
    for d, t in zip(drafts, targets):
        if d != t:
            break
        out.append(d)
    out.append(targets[len(out)])
    return out


def accept_sampled(drafts: list[int], accepted: list[bool], tokens: list[int]) -> list[int]:
    """The tokens a sampled verification (Sampler.verify_drafts) emits: the drafts while accepted, then the
    replacement token of the first rejected one (or the token of the row after the last draft)."""
    out = []
    for d, ok, t in zip(drafts, accepted, tokens):
        if not ok:
            out.append(t)
            return out
        out.append(d)
    out.append(tokens[len(drafts)])
    return out


def spec_allowed(req: Any, max_new: Optional[int] = None) -> int:
    """How many draft tokens a request may take this step: none while a token is in flight (prompt logprobs are
    the prompt steps', before any draft); a thinking budget that no position of the step can reach, or a grammar
    not yet governing (ReasoningState.max_drafts); room left for the drafts and the model's next token. The
    verification applies the rest to each of its rows: the grammar's mask after the drafts before the row
    (GrammarMasks.verification), penalties (counting those drafts; speculation runs without async scheduling, so
    the host history is complete), bad words (after the history and those drafts), allowed_token_ids and
    min_tokens' stop bans, and it gives the logprobs (SpecLogprobs). Greedy and sampled requests alike:
    verification keeps their output distribution exact (Sampler.verify_drafts)."""
    reasoning = getattr(req, "reasoning", None)
    if req.num_pending:
        return 0
    room = req.max_tokens - req.num_output_tokens - 1
    k = max(0, min(room, max_new if max_new is not None else room))
    cap = reasoning.max_drafts() if reasoning is not None else None
    return k if cap is None else max(0, min(k, cap))


def check_width_and_vocab(draft_cfg: Any, target_cfg: Any, err: Any) -> Any:
    """A drafter that reads the target's hidden states and uses its embedding and LM head (DFlash, EAGLE-1) must have
    the target's hidden size and vocabulary (a multimodal target's text model's); err(message) makes the error to
    raise. Returns the target's text config."""
    target_text = target_cfg.get_text_config() if hasattr(target_cfg, "get_text_config") else target_cfg
    hidden, t_hidden = int(draft_cfg.hidden_size), int(target_text.hidden_size)
    if hidden != t_hidden:
        raise err(f"hidden size {hidden} differs from the target's {t_hidden} (it reads the target's hidden states "
                  "and embeddings)")
    t_vocab = int(target_text.vocab_size)
    vocab = getattr(draft_cfg, "vocab_size", None)
    if vocab is not None and int(vocab) != t_vocab:
        raise err(f"vocabulary of {vocab} ids differs from the target's {t_vocab} (it uses the target's LM head)")
    return target_text

