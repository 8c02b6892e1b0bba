"""An adapter unloaded (/v1/unload_lora_adapter) while a beam search runs with it: the engine's removal waits for the
search to end. The search sends its step requests one step at a time, so between two steps no request holds the
adapter: removed then, every later step would read it again from its path (whatever that holds by then: after an
in-place reload, the new weights) and find none of its beams' blocks in the prefix cache."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tiny_models import make_model
from voltllm.config import EngineArgs
from voltllm.engine.async_llm import AsyncLLM


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    config = EngineArgs(model=make_model(str(tmp_path_factory.mktemp("tiny")), "llama"), device="cpu",
                        enable_lora=True, max_lora_rank=8).create_engine_config()
    eng = AsyncLLM(config)  # (not started: the messages are recorded instead of sent)
    eng.sent = []
    eng._send = eng.sent.append
    return eng


def test_removal_waits_for_the_beam_searches_using_the_adapter(engine):
    engine._beam_searches.update(a=SimpleNamespace(lora_int_id=3), b=SimpleNamespace(lora_int_id=3),
                                 c=SimpleNamespace(lora_int_id=None))
    engine.remove_lora(3)
    engine.remove_lora(5)  # no search uses it: at once
    assert engine.sent == [("remove_lora", 5)]
    del engine._beam_searches["a"]
    engine._beam_search_ended()
    assert engine.sent == [("remove_lora", 5)]  # b still runs with it
    del engine._beam_searches["b"]
    engine._beam_search_ended()
    assert engine.sent == [("remove_lora", 5), ("remove_lora", 3)]
    engine._beam_search_ended()
    assert engine.sent.count(("remove_lora", 3)) == 1
