"""repetition_detection over HTTP (chat and completions): vLLM's object and its older flat fields reach the
SamplingParams; bad values, both spellings at once and beam search are 400s naming the field."""
import pytest

from voltllm import RepetitionDetectionParams


def _chat(**body):
    from voltllm.entrypoints.openai.protocol import ChatCompletionRequest

    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **body)


def _completion(**body):
    from voltllm.entrypoints.openai.protocol import CompletionRequest

    return CompletionRequest(prompt="x", **body)


def _params(req):
    from voltllm.entrypoints.openai.serving_common import make_params

    req.check()
    return make_params(lambda: req.sampling_params(16, None))


@pytest.mark.parametrize("make", [_chat, _completion], ids=["chat", "completions"])
def test_the_http_fields_reach_the_sampling_params(make):
    want = RepetitionDetectionParams(max_pattern_size=8, min_pattern_size=2, min_count=3)
    assert _params(make(repetition_detection={"max_pattern_size": 8, "min_pattern_size": 2,
                                              "min_count": 3})).repetition_detection == want
    # vLLM's older flat spelling
    assert _params(make(max_repetition_pattern_size=8, min_repetition_pattern_size=2,
                        repetition_min_count=3)).repetition_detection == want
    assert _params(make()).repetition_detection is None
    assert _params(make(repetition_detection=None, max_repetition_pattern_size=0)).repetition_detection is None


@pytest.mark.parametrize("make", [_chat, _completion], ids=["chat", "completions"])
def test_bad_http_values_are_400s_naming_the_field(make):
    from voltllm.entrypoints.openai.errors import OpenAIError

    for body, param in [({"repetition_detection": {"max_pattern_size": 4, "min_count": 1}},
                         "repetition_detection.min_count"),
                        ({"repetition_detection": {"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}},
                         "repetition_detection.min_pattern_size"),
                        ({"max_repetition_pattern_size": -1, "repetition_min_count": 2},
                         "repetition_detection.max_pattern_size"),
                        ({"repetition_detection": {"max_pattern_size": 4, "min_count": 2},
                          "repetition_min_count": 2}, "repetition_detection"),
                        ({"use_beam_search": True, "repetition_detection": {"max_pattern_size": 4, "min_count": 2}},
                         "repetition_detection")]:
        with pytest.raises(OpenAIError) as e:
            _params(make(**body))
        assert e.value.status == 400 and e.value.param == param, (body, e.value.param, str(e.value))


def test_messages_ends_the_turn_on_a_repetition():
    """Not a stop sequence: "repetition_detected" is no text the model wrote."""
    from voltllm.engine.outputs import CompletionOutput
    from voltllm.entrypoints.openai.serving_messages import stop_reason

    out = CompletionOutput(0, "ab ab", [1, 2, 1, 2], finish_reason="repetition", stop_reason="repetition_detected")
    assert stop_reason(out, False) == ("end_turn", None)
    out = CompletionOutput(0, "ab", [1, 2], finish_reason="stop", stop_reason="ab")
    assert stop_reason(out, False) == ("stop_sequence", "ab")
