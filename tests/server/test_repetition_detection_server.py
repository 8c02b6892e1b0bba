"""repetition_detection on the tiny server through the openai client (extra_body, as vLLM's clients send it): chat
and completions, streamed and not, end where vLLM's rule says with finish_reason "repetition" and stop_reason
"repetition_detected"; bad values are 400s naming the field."""
from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.usefixtures("tiny_server")
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
RD = {"max_pattern_size": 8, "min_pattern_size": 1, "min_count": 3}


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.base + "/v1", api_key="x", max_retries=0, timeout=120)


def _repeats(tokens, rd) -> bool:
    n, c = len(tokens), rd["min_count"]
    return any(n >= p * c and tokens[n - p * c:] == tokens[n - p:] * c
               for p in range(max(1, rd["min_pattern_size"]), rd["max_pattern_size"] + 1))


def _expected(tokens, rd):
    """The output vLLM's rule leaves: up to the first token (before the last, where the length comes first) at
    which the tail repeats."""
    return next((tokens[:i] for i in range(1, len(tokens)) if _repeats(tokens[:i], rd)), tokens)


def _completion(client, **extra):
    return client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=60, temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True, **extra})


def test_completions_and_chat_stop_on_a_repeated_pattern(client):
    # two allowed tokens: by the 4th token the tail is aa or abab, a pattern of size 1 or 2 twice
    forced = {"allowed_token_ids": [100, 200], "repetition_detection": {"max_pattern_size": 2, "min_count": 2}}
    got = _completion(client, **forced).choices[0]
    assert got.finish_reason == "repetition" and got.stop_reason == "repetition_detected"
    assert 2 <= len(got.token_ids) <= 4 and _repeats(got.token_ids, {"min_pattern_size": 1, **forced[
        "repetition_detection"]})
    plain = _completion(client).choices[0].token_ids
    got = _completion(client, repetition_detection=RD).choices[0]
    want = _expected(plain, RD)
    assert got.token_ids == want
    assert got.finish_reason == ("repetition" if len(want) < len(plain) else "length")
    # vLLM's older flat fields, and a stream: the finish reason in its last choice chunk
    flat = {"max_repetition_pattern_size": 2, "repetition_min_count": 2, "allowed_token_ids": [100, 200]}
    chunks = list(client.completions.create(model="tiny", prompt="Hi", max_tokens=30, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True, **flat}))
    assert chunks[-1].choices[0].finish_reason == "repetition"
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=30, temperature=0,
                                          extra_body={"ignore_eos": True, **forced})
    assert chat.choices[0].finish_reason == "repetition"
    assert chat.choices[0].model_extra["stop_reason"] == "repetition_detected"
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=30, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True, **forced}))
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["repetition"]


@pytest.mark.parametrize("extra,param", [
    ({"repetition_detection": {"max_pattern_size": 4, "min_count": 1}}, "repetition_detection.min_count"),
    ({"repetition_detection": {"max_pattern_size": 4096, "min_count": 2}}, "repetition_detection.max_pattern_size"),
    ({"repetition_detection": {"max_pattern_size": 4, "min_count": 2, "size": 3}}, None),
    ({"repetition_detection": {"max_pattern_size": 4, "min_count": 2}, "repetition_min_count": 2},
     "repetition_detection")])
def test_bad_values_are_400s(client, extra, param):
    for call in (lambda: client.completions.create(model="tiny", prompt="Hi", max_tokens=4, extra_body=extra),
                 lambda: client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, extra_body=extra)):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        if param is not None:
            assert e.value.body["param"] == param
