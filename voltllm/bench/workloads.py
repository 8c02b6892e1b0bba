"""Request sets sent with at most C in flight: the prefix-cache scenarios of `voltllm bench`, and its concurrency
scenario given --num-prompts.

- PrefixRepetition (`--scenario prefix`): vLLM's prefix_repetition dataset as token ids. P random prefixes of L
  tokens; each prefix serves N / P requests, each the prefix followed by a fresh random suffix of S tokens; the
  requests are shuffled (as vLLM shuffles them) and sent with at most C in flight.
- MultiTurn (`--scenario multi-turn`): T conversations of K turns. Turn k's prompt is the whole history (every earlier
  user turn and the engine's own answer to it, as token ids) followed by a new user turn of U random tokens. The
  conversations interleave: a finished turn puts its conversation at the back of a FIFO, so between two turns of one
  conversation the turns of the T - 1 others run (the reuse distance at which a small GPU pool has evicted the
  history and a CPU tier of the prefix cache still holds it).

Both hand out requests through a RequestSource, and so does the concurrency scenario given --num-prompts
(stream_of: N random requests, at most C in flight): the runner (in process or against a server) asks for the next
request whenever it has a free slot and reports each answer's token ids back, which a conversation's next turn needs.
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch

from voltllm.config import ConfigError


@dataclass(frozen=True)
class PrefixRepetition:
    """vLLM's --prefix-repetition-* flags and --num-prompts."""

    prefix_len: int = 256
    suffix_len: int = 256
    num_prefixes: int = 10
    output_len: int = 128
    num_prompts: int = 100
    # the prefix set is drawn once per configuration (the warm runs find the cold run's prefixes cached) instead of
    # fresh per run
    reuse_prefixes: bool = False

    def check(self) -> None:
        for flag, v in (("--prefix-repetition-prefix-len", self.prefix_len),
                        ("--prefix-repetition-suffix-len", self.suffix_len),
                        ("--prefix-repetition-num-prefixes", self.num_prefixes),
                        ("--prefix-repetition-output-len", self.output_len), ("--num-prompts", self.num_prompts)):
            if v < 1:
                raise ConfigError(f"{flag} must be >= 1, got {v}")
        if self.num_prompts % self.num_prefixes:
            raise ConfigError(f"--num-prompts {self.num_prompts} must be a multiple of "
                              f"--prefix-repetition-num-prefixes {self.num_prefixes}: each prefix serves the same "
                              "number of requests")

    @property
    def prompt_len(self) -> int:
        return self.prefix_len + self.suffix_len

    @property
    def max_request_len(self) -> int:
        return self.prompt_len + self.output_len

    def describe(self) -> dict:
        return {"prefix_len": self.prefix_len, "suffix_len": self.suffix_len, "num_prefixes": self.num_prefixes,
                "output_len": self.output_len, "num_prompts": self.num_prompts,
                "reuse_prefixes": self.reuse_prefixes}


@dataclass(frozen=True)
class MultiTurn:
    """T conversations (--multi-turn-num-conversations) of K user turns each (--multi-turn-num-turns: the requests of
    a conversation), U tokens per user turn (--multi-turn-input-len), O tokens per answer (--multi-turn-output-len)."""

    num_conversations: int = 16
    num_turns: int = 8
    input_len: int = 128
    output_len: int = 128

    def check(self) -> None:
        for flag, v in (("--multi-turn-num-conversations", self.num_conversations),
                        ("--multi-turn-num-turns", self.num_turns), ("--multi-turn-input-len", self.input_len),
                        ("--multi-turn-output-len", self.output_len)):
            if v < 1:
                raise ConfigError(f"{flag} must be >= 1, got {v}")

    @property
    def num_prompts(self) -> int:
        return self.num_conversations * self.num_turns

    @property
    def max_request_len(self) -> int:
        """The last turn's prompt and answer: K user turns and K answers."""
        return self.num_turns * (self.input_len + self.output_len)

    def describe(self) -> dict:
        return {"num_conversations": self.num_conversations, "num_turns": self.num_turns,
                "input_len": self.input_len, "output_len": self.output_len}


@dataclass(frozen=True)
class BenchRequest:
    index: int  # send order in the run
    prompt: list[int]
    output_len: int
    group: int  # the shared prefix's index (prefix) or the conversation's (multi-turn)
    turn: Optional[int] = None  # 1-based turn of its conversation (multi-turn)
    seed_offset: Optional[int] = None  # its sampling seed is the base seed + this (None: + index)
    # seconds after the run's start before which it is not sent (--request-rate with --num-prompts); None: when a
    # slot frees
    not_before: Optional[float] = None

    @property
    def seed(self) -> int:
        """The offset of its sampling seed: fixed by what the request is (a conversation's turn), not by when the
        answers before it came back, so sampled runs with fixed seeds repeat."""
        return self.index if self.seed_offset is None else self.seed_offset


class RequestSource:
    """Hands out a run's requests in order; `next()` is None while the next one waits for an answer (or none is
    left), `done()` takes each answer's token ids."""

    wants_answers = False  # whether done() needs the answers' token ids (a server is asked for them)

    def __init__(self, total: int):
        self.total = total
        self.handed_out = 0

    @property
    def exhausted(self) -> bool:
        return self.handed_out >= self.total

    def next(self) -> Optional[BenchRequest]:
        raise NotImplementedError

    def done(self, req: BenchRequest, output_ids: list[int]) -> None:
        pass


def _random_ids(gen: torch.Generator, n: int, length: int, vocab_size: int) -> list[list[int]]:
    return torch.randint(0, vocab_size, (n, length), generator=gen).tolist()


class FixedSource(RequestSource):
    """Requests fixed up front, handed out in order."""

    def __init__(self, requests: list[BenchRequest]):
        super().__init__(len(requests))
        self.requests = requests

    def next(self) -> Optional[BenchRequest]:
        if self.exhausted:
            return None
        self.handed_out += 1
        return self.requests[self.handed_out - 1]


def stream_of(prompts: list[list[int]], output_lens: list[int], arrivals: Optional[list[float]] = None) -> FixedSource:
    """The concurrency scenario's requests with --num-prompts: sent in this order, the next whenever one ends, and
    with arrivals (--request-rate) not before its time."""
    return FixedSource([BenchRequest(i, p, n, 0, not_before=arrivals[i] if arrivals is not None else None)
                        for i, (p, n) in enumerate(zip(prompts, output_lens))])


class PrefixRepetitionSource(FixedSource):
    """The requests of one prefix-repetition run, fixed up front: prefixes from prefix_seed, suffixes and the order
    from seed (reuse_prefixes: the caller passes one prefix_seed for every run of a configuration)."""

    def __init__(self, spec: PrefixRepetition, vocab_size: int, seed: int, prefix_seed: Optional[int] = None):
        prefixes = _random_ids(torch.Generator().manual_seed(seed if prefix_seed is None else prefix_seed),
                               spec.num_prefixes, spec.prefix_len, vocab_size)
        suffixes = _random_ids(torch.Generator().manual_seed(seed ^ 0x5FF1C5), spec.num_prompts, spec.suffix_len,
                               vocab_size)
        per = spec.num_prompts // spec.num_prefixes
        pairs = [(g, prefixes[g] + suffixes[g * per + j]) for g in range(spec.num_prefixes) for j in range(per)]
        random.Random(seed).shuffle(pairs)
        super().__init__([BenchRequest(i, prompt, spec.output_len, g) for i, (g, prompt) in enumerate(pairs)])


class ConversationSource(RequestSource):
    """The turns of T conversations, interleaved round robin: the user turns are drawn up front from the seed, the
    answers are the engine's own (reported through done())."""

    wants_answers = True

    def __init__(self, spec: MultiTurn, vocab_size: int, seed: int):
        super().__init__(spec.num_prompts)
        self.spec = spec
        gen = torch.Generator().manual_seed(seed)
        self.user_turns = [_random_ids(gen, spec.num_turns, spec.input_len, vocab_size)
                           for _ in range(spec.num_conversations)]
        self.history: list[list[int]] = [[] for _ in range(spec.num_conversations)]
        self.turns_sent = [0] * spec.num_conversations
        self.ready = deque(range(spec.num_conversations))  # conversations whose next turn can be sent, oldest first

    def next(self) -> Optional[BenchRequest]:
        if not self.ready:
            return None
        c = self.ready.popleft()
        k = self.turns_sent[c]
        self.turns_sent[c] += 1
        self.handed_out += 1
        prompt = self.history[c] + self.user_turns[c][k]
        return BenchRequest(self.handed_out - 1, prompt, self.spec.output_len, c, k + 1,
                            seed_offset=c * self.spec.num_turns + k)

    def done(self, req: BenchRequest, output_ids: list[int]) -> None:
        if len(output_ids) != req.output_len:
            raise RuntimeError(f"conversation {req.group} turn {req.turn}: the answer has {len(output_ids)} token ids, "
                               f"not the forced {req.output_len}")
        self.history[req.group] = req.prompt + list(output_ids)
        if self.turns_sent[req.group] < self.spec.num_turns:
            self.ready.append(req.group)


def make_source(spec: PrefixRepetition | MultiTurn, vocab_size: int, seed: int, plan_seed: int) -> RequestSource:
    """The run's request source: seed is the run's, plan_seed the configuration's (the prefixes of reuse_prefixes)."""
    if isinstance(spec, PrefixRepetition):
        return PrefixRepetitionSource(spec, vocab_size, seed, plan_seed if spec.reuse_prefixes else None)
    return ConversationSource(spec, vocab_size, seed)
