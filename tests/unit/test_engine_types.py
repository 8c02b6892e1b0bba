"""EngineCoreOutput crosses the engine -> API process boundary pickled with a positional __reduce__: every field
(a field added later too) must survive the round trip."""
import dataclasses
import pickle

from voltllm.engine.types import EngineCoreOutput


def test_engine_core_output_round_trips_every_field():
    values = {"request_id": "cmpl-1-0", "new_token_ids": [5, 6], "finish_reason": "stop", "stop_reason": 7,
              "new_logprobs": [{5: (-0.1, 1)}, {6: (-0.2, 3)}], "prompt_logprobs": [None, {3: (-1.5, 2)}],
              "num_cached_tokens": 16,
              "first_token_time": 1.5, "last_token_time": 2.5, "scheduled_time": 0.5, "pooled": None}
    assert [f.name for f in dataclasses.fields(EngineCoreOutput)] == list(values)  # a new field: extend both
    o = EngineCoreOutput(**values)
    back = pickle.loads(pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == o and dataclasses.asdict(back) == values and back.finished
    assert pickle.loads(pickle.dumps(EngineCoreOutput("x", []))) == EngineCoreOutput("x", [])


def test_a_pooled_embedding_round_trips():
    import torch

    o = EngineCoreOutput("embd-1", [], "stop", pooled=torch.tensor([0.6, 0.8]))
    back = pickle.loads(pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL))
    assert back.finish_reason == "stop" and torch.equal(back.pooled, o.pooled)
