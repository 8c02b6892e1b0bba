"""ModelRunner._fill_pending: input ids that the step in flight is still sampling are taken on the device from
its sampled rows; one slice copy when both index lists are one run, an index copy otherwise (async scheduling)."""
from types import SimpleNamespace

import pytest
import torch

from voltllm.worker.runner import ModelRunner


@pytest.mark.parametrize("dst,src", [
    ([0, 1, 2, 3], [0, 1, 2, 3]),  # steady decoding: the same requests in the same order
    ([2, 3, 4], [1, 2, 3]),  # a request before them finished / a prompt row first: shifted runs
    ([0, 1, 2], [0, 2, 3]),  # a request in between finished: a gap in the sampled rows
    ([5, 9], [3, 0]),  # prompt chunks between them, order changed (preemption)
    ([7], [4]),
])
def test_pending_tokens_land_in_their_rows(dst, src):
    prev = torch.randperm(1000)[:6] + 10  # the previous step's sampled tokens
    runner = SimpleNamespace(_prev_tokens=prev, device=torch.device("cpu"))
    buf = SimpleNamespace(input_ids=torch.full((12,), -1, dtype=torch.long))
    ModelRunner._fill_pending(runner, buf, dst, src)
    want = torch.full((12,), -1, dtype=torch.long)
    want[torch.tensor(dst)] = prev[torch.tensor(src)]
    assert torch.equal(buf.input_ids, want)
