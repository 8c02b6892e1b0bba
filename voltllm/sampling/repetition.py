"""vLLM's repetition_detection: finish a request whose output ends in a token pattern of min_pattern_size ..
max_pattern_size tokens repeated min_count times (a reasoning model looping "Wait, let me reconsider..." until
max_tokens). The scheduler feeds each output token to the request's RepetitionDetector (engine/scheduler.py
_check_stop); the request finishes with finish_reason "repetition" and stop_reason "repetition_detected"."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

from voltllm.sampling.params import SamplingParamsError

# vLLM's hard limits on the fields, and its default server cap on max_pattern_size (ModelConfig's
# max_repetition_detection_pattern_size: 2048) with its scan budget (10 x the cap for max_pattern_size x min_count)
MAX_ABSOLUTE_PATTERN_SIZE = 65536
MAX_ABSOLUTE_MIN_COUNT = 1000
MAX_PATTERN_SIZE = 2048
MAX_SCAN_WORK = 10 * MAX_PATTERN_SIZE
STOP_REASON = "repetition_detected"


@dataclass
class RepetitionDetectionParams:
    """vLLM's fields: max_pattern_size 0 turns detection off; min_pattern_size 0 means 1; min_count >= 2 when on."""
    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                _bad(name, f"must be an integer >= 0, got {value!r}")
        if self.min_pattern_size > self.max_pattern_size:
            _bad("min_pattern_size", f"must be <= max_pattern_size ({self.max_pattern_size}), got "
                                     f"{self.min_pattern_size} (max_pattern_size 0 turns detection off)")
        if self.max_pattern_size > MAX_PATTERN_SIZE:
            _bad("max_pattern_size", f"must be at most {MAX_PATTERN_SIZE} (vLLM's default server limit), got "
                                     f"{self.max_pattern_size}")
        if self.min_count > MAX_ABSOLUTE_MIN_COUNT:
            _bad("min_count", f"must be at most {MAX_ABSOLUTE_MIN_COUNT}, got {self.min_count}")
        if self.max_pattern_size > 0 and self.min_count < 2:
            _bad("min_count", f"must be >= 2 to detect a repeated pattern, got {self.min_count} (max_pattern_size 0 "
                              "turns detection off)")
        work = self.max_pattern_size * self.min_count
        if work > MAX_SCAN_WORK:
            _bad("min_count", f"max_pattern_size x min_count = {work} is more than the scan budget of "
                              f"{MAX_SCAN_WORK} (vLLM's): reduce max_pattern_size or min_count")

    @property
    def active(self) -> bool:
        return self.max_pattern_size > 0


def _bad(field: str, why: str) -> None:
    raise SamplingParamsError(f"repetition_detection.{field} {why}")


def repetition_params(value: Any) -> Optional[RepetitionDetectionParams]:
    """A RepetitionDetectionParams, or one made from a dict of its fields (None stays None)."""
    if value is None or isinstance(value, RepetitionDetectionParams):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"max_pattern_size", "min_pattern_size", "min_count"})
        if unknown:
            raise SamplingParamsError(f"repetition_detection has unknown fields {unknown} (its fields are "
                                      "max_pattern_size, min_pattern_size, min_count)")
        return RepetitionDetectionParams(**value)
    raise SamplingParamsError(f"repetition_detection must be an object with max_pattern_size, min_pattern_size and "
                              f"min_count, got {value!r}")


class RepetitionDetector:
    """Incremental form of vLLM's check over a request's output tokens: the tail is a pattern of p tokens repeated
    c times exactly when each of its last p x (c - 1) tokens equals the token p before it. So each period p keeps
    the length of that run ending at the newest token; a new token x extends the runs of the periods p where the
    token p back is x too and ends all others. Only those periods are visited (the positions of x among the last
    max_pattern_size tokens), so a token costs at most max_pattern_size steps, usually a few."""
    __slots__ = ("lo", "hi", "repeats", "num_tokens", "window", "positions", "runs")

    def __init__(self, params: RepetitionDetectionParams):
        self.lo = max(1, params.min_pattern_size)
        self.hi = params.max_pattern_size
        self.repeats = params.min_count - 1  # the copies before the newest one
        self.num_tokens = 0
        self.window: deque[int] = deque()  # the last hi tokens (after append)
        self.positions: dict[int, deque[int]] = {}  # token -> its positions in the window, oldest first
        self.runs: dict[int, int] = {}  # period -> run ending at the newest token (absent: 0)

    def append(self, token: int) -> bool:
        """Take the next output token; True when the output now ends in a repeated pattern."""
        i = self.num_tokens
        self.num_tokens += 1
        q = self.positions.get(token)
        runs, found = {}, False
        if q is None:
            self.positions[token] = deque((i,))
        else:
            prev = self.runs
            for j in q:  # (the window holds positions i - hi .. i - 1: periods 1 .. hi)
                p = i - j
                if p < self.lo:  # (oldest first: the periods only get shorter)
                    break
                r = prev.get(p, 0) + 1
                runs[p] = r
                if r >= p * self.repeats:
                    found = True
            q.append(i)
        self.runs = runs
        self.window.append(token)
        if len(self.window) > self.hi:  # the next token asks about periods up to hi: position i - hi leaves
            old = self.window.popleft()
            q = self.positions[old]
            q.popleft()
            if not q:
                del self.positions[old]
        return found
