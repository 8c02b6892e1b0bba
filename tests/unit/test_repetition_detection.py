"""repetition_detection (vLLM's): the incremental detector against the rule written out (the output's tail is a
pattern of min..max tokens repeated min_count times), the fields' checks, and the scheduler's stop check: after EOS /
stop tokens / length, held back by min_tokens, and a verified speculative run cut at the token that repeats."""
import random

import pytest

from voltllm import RepetitionDetectionParams, SamplingParams
from voltllm.engine.request import Request, RequestStatus
from voltllm.engine.scheduler import Scheduler
from voltllm.engine.types import EngineCoreRequest
from voltllm.sampling.params import SamplingParamsError
from voltllm.sampling.repetition import RepetitionDetector


def _rule(tokens, lo, hi, count) -> bool:
    """vLLM's rule, written out: some p in [max(1, lo), hi] whose last p tokens, repeated count times, are the tail."""
    return any(len(tokens) >= p * count and tokens[len(tokens) - p * count:] == tokens[len(tokens) - p:] * count
               for p in range(max(1, lo), hi + 1))


def _first_hit(tokens, **kw):
    det = RepetitionDetector(RepetitionDetectionParams(**kw))
    return next((i for i, t in enumerate(tokens) if det.append(t)), None)


@pytest.mark.parametrize("pattern", [[7], [1, 2], [4, 5, 6], [9, 8, 7, 6, 5]])
@pytest.mark.parametrize("count", [2, 3, 5])
def test_a_pattern_is_found_on_the_token_that_completes_its_count(pattern, count):
    noise = [100, 101, 102, 103]
    tokens = noise + pattern * count + [200]
    hit = _first_hit(tokens, max_pattern_size=5, min_pattern_size=1, min_count=count)
    assert hit == len(noise) + len(pattern) * count - 1


def test_no_detection_below_min_count_or_outside_the_sizes():
    assert _first_hit([1, 2, 3, 1, 2, 3], max_pattern_size=3, min_pattern_size=2, min_count=3) is None
    assert _first_hit([1, 2, 3, 1, 2, 3, 1, 2, 4], max_pattern_size=3, min_pattern_size=2, min_count=3) is None
    # a 2-token pattern three times, with sizes 3..5 asked for
    assert _first_hit([10, 20] * 3, max_pattern_size=5, min_pattern_size=3, min_count=3) is None
    # a 6-token pattern with max_pattern_size 5
    assert _first_hit([1, 2, 3, 4, 5, 6] * 4, max_pattern_size=5, min_pattern_size=1, min_count=2) is None
    assert _first_hit([1, 2, 3, 4, 5, 6] * 4, max_pattern_size=6, min_pattern_size=1, min_count=2) == 11
    # min_pattern_size 0 means 1
    assert _first_hit([3, 4, 4], max_pattern_size=2, min_pattern_size=0, min_count=2) == 2


def test_the_detector_follows_the_rule_on_every_prefix():
    rng = random.Random(0)
    for trial in range(300):
        lo = rng.randint(0, 4)
        hi = rng.randint(max(lo, 1), 8)
        count = rng.randint(2, 4)
        alphabet = rng.randint(2, 4)
        tokens = [rng.randrange(alphabet) for _ in range(rng.randint(1, 60))]
        det = RepetitionDetector(RepetitionDetectionParams(max_pattern_size=hi, min_pattern_size=lo, min_count=count))
        for i, t in enumerate(tokens):
            assert det.append(t) == _rule(tokens[: i + 1], lo, hi, count), (trial, tokens[: i + 1], lo, hi, count)


def test_the_window_keeps_max_pattern_size_tokens():
    det = RepetitionDetector(RepetitionDetectionParams(max_pattern_size=4, min_pattern_size=1, min_count=2))
    for t in range(1000):
        det.append(t)
    assert len(det.window) == 4 and sum(len(q) for q in det.positions.values()) == 4


def test_fields_are_checked_naming_the_field():
    cases = [(dict(max_pattern_size=-1, min_count=2), "repetition_detection.max_pattern_size"),
             (dict(max_pattern_size=2, min_pattern_size=3, min_count=2), "repetition_detection.min_pattern_size"),
             (dict(max_pattern_size=4, min_count=1), "repetition_detection.min_count"),
             (dict(max_pattern_size=4), "repetition_detection.min_count"),
             (dict(max_pattern_size=4096, min_count=2), "repetition_detection.max_pattern_size"),
             (dict(max_pattern_size=2048, min_count=11), "repetition_detection.min_count"),
             (dict(max_pattern_size=1, min_count=1001), "repetition_detection.min_count"),
             (dict(max_pattern_size="4", min_count=2), "repetition_detection.max_pattern_size"),
             (dict(max_pattern_size=4, min_count=True), "repetition_detection.min_count")]
    for fields, name in cases:
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(repetition_detection=fields)
        assert str(e.value).startswith(name + " "), (fields, str(e.value))
    with pytest.raises(SamplingParamsError, match="unknown fields"):
        SamplingParams(repetition_detection={"max_pattern_size": 4, "min_count": 2, "window": 3})
    with pytest.raises(SamplingParamsError, match="must be an object"):
        SamplingParams(repetition_detection=[4, 1, 2])


def test_dicts_and_objects_are_taken_and_zero_sizes_ask_for_nothing():
    sp = SamplingParams(repetition_detection={"max_pattern_size": 8, "min_pattern_size": 2, "min_count": 3})
    assert sp.repetition_detection == RepetitionDetectionParams(8, 2, 3)
    assert SamplingParams(repetition_detection=RepetitionDetectionParams(8, 0, 2)).repetition_detection.min_count == 2
    assert SamplingParams(repetition_detection=RepetitionDetectionParams()).repetition_detection is None
    assert SamplingParams(repetition_detection={"max_pattern_size": 0, "min_count": 0}).repetition_detection is None
    assert sp.clone().repetition_detection == sp.repetition_detection
    assert _request(SamplingParams()).repetition is None  # no detector, no per-token cost


def _request(sp, prompt=(1, 2, 3)):
    return Request(EngineCoreRequest("r", list(prompt), sp), max_model_len=1024)


def _feed(req, tokens):
    """Append tokens one by one as Scheduler.update does; the status of the first that finishes, and its index."""
    for i, t in enumerate(tokens):
        req.all_token_ids.append(t)
        status = Scheduler._check_stop(req, t, req.num_output_tokens, req.num_tokens >= 1024)
        if status is not None:
            return status, i
    return None, None


REP = {"max_pattern_size": 5, "min_pattern_size": 2, "min_count": 3}


def test_the_stop_check_finishes_with_vllms_reasons():
    req = _request(SamplingParams(max_tokens=100, repetition_detection=REP))
    assert _feed(req, [10, 20, 10, 20, 10, 20, 10]) == (RequestStatus.FINISHED_REPETITION, 5)
    assert req.stop_reason == "repetition_detected" and RequestStatus.FINISHED_REPETITION.value == "repetition"
    assert RequestStatus.FINISHED_REPETITION.finished
    # the prompt is not part of the output the rule reads
    req = _request(SamplingParams(max_tokens=100, repetition_detection=REP), prompt=[10, 20, 10, 20])
    assert _feed(req, [10, 20, 10, 20, 10, 20]) == (RequestStatus.FINISHED_REPETITION, 5)


def test_stops_and_length_come_first_and_min_tokens_holds_it_back():
    req = _request(SamplingParams(max_tokens=100, stop_token_ids=[20], repetition_detection=REP))
    assert _feed(req, [10, 20]) == (RequestStatus.FINISHED_STOPPED, 1)
    req = _request(SamplingParams(max_tokens=6, repetition_detection=REP))
    assert _feed(req, [10, 20] * 4) == (RequestStatus.FINISHED_LENGTH, 5)
    # min_tokens 8: the pattern is there from token 6 on, the check waits for the 8th token (still repeating)
    req = _request(SamplingParams(max_tokens=100, min_tokens=8, repetition_detection=REP))
    assert _feed(req, [10, 20] * 6) == (RequestStatus.FINISHED_REPETITION, 7)
    # ... and a tail that no longer repeats at min_tokens does not stop it
    req = _request(SamplingParams(max_tokens=100, min_tokens=8, repetition_detection=REP))
    assert _feed(req, [10, 20, 10, 20, 10, 20, 30, 40, 50]) == (None, None)


def test_a_verified_speculative_run_is_cut_at_the_repeating_token():
    sched = Scheduler.__new__(Scheduler)  # (_append_verified reads only its draft counters)
    sched.num_draft_tokens = sched.num_accepted_tokens = sched.num_drafts = 0
    sched.drafted_per_pos, sched.accepted_per_pos = [0] * 4, [0] * 4
    req = _request(SamplingParams(max_tokens=100, repetition_detection=REP))
    _feed(req, [10, 20, 10, 20])
    kept, status = sched._append_verified(req, [10, 20, 10, 20], [10, 20, 10, 20, 10], 1024)
    assert kept == [10, 20] and status is RequestStatus.FINISHED_REPETITION
    assert (sched.num_drafts, sched.drafted_per_pos, sched.accepted_per_pos) == (1, [1] * 4, [1] * 4)
    assert req.output_token_ids == [10, 20] * 3 and req.stop_reason == "repetition_detected"

