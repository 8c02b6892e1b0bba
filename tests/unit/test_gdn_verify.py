"""Speculative verification on Gated DeltaNet state (CPU, torch path): the checkpointed delta rule equals the
recurrent reference on every prefix; StateCache's checkpoint rows, keep_accepted and settle; a layer's verification
step then keep_accepted equals one-token steps up to the last accepted draft (the same check the Triton
interpreter runs with the kernels: tests/unit/_gdn_decode_interp_check.py)."""
import pytest
import torch

from interp_util import load_script
from pathlib import Path

from voltllm.kernels import gdn_ref as R
from voltllm.model.state_cache import StateCache

CHECK = load_script(Path(__file__).with_name("_gdn_decode_interp_check.py"))


def test_checkpointed_rule_equals_recurrent_prefixes():
    g = torch.Generator().manual_seed(0)
    lens, hk, hv, dk, dv, nc = [4, 1, 3], 2, 4, 8, 6, 3
    t, m, num_slots = sum(lens), len(lens), 5
    q, k = (torch.randn(t, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(t, hv, dv, generator=g)
    gl, beta = -torch.rand(t, hv, generator=g), torch.rand(t, hv, generator=g)
    rows = torch.randn(num_slots + 1 + num_slots * nc, hv, dk, dv, generator=g)
    old = rows.clone()
    slots, init = torch.tensor([3, 0, 4]), torch.tensor([True, False, True])
    qsl = [0, 4, 5, 8]
    out = R.gated_delta_rule_checkpointed(q, k, v, gl, beta, rows, slots, qsl, init, num_slots + 1, nc)
    for i in range(m):
        s, e, slot = qsl[i], qsl[i + 1], int(slots[i])
        for j in range(e - s):
            o, st = R.recurrent_gated_delta_rule(q[s:s + j + 1], k[s:s + j + 1], v[s:s + j + 1], gl[s:s + j + 1],
                                                 beta[s:s + j + 1], old[slot] if init[i] else None)
            torch.testing.assert_close(out[s:s + j + 1], o, rtol=1e-5, atol=1e-5)
            row = slot if j == e - s - 1 else num_slots + 1 + slot * nc + j
            torch.testing.assert_close(rows[row], st, rtol=1e-5, atol=1e-5)
    # rows of other slots and unused checkpoints are untouched
    for slot in (1, 2):
        assert torch.equal(rows[slot], old[slot])
    assert torch.equal(rows[num_slots + 1 + 4 * nc + 2], old[num_slots + 1 + 4 * nc + 2])
    with pytest.raises(ValueError, match="checkpoints"):
        R.gated_delta_rule_checkpointed(q, k, v, gl, beta, rows, slots, qsl, init, num_slots + 1, 2)


def test_state_cache_checkpoint_rows_and_keep_accepted():
    c = StateCache(num_layers=2, num_slots=3, conv_shape=(3, 8), ssm_shape=(2, 4, 4), conv_dtype=torch.float32,
                   checkpoints=2)
    assert c.conv[0].shape[0] == 4 and c.conv_rows[0].shape[0] == 4 + 3 * 2 and c.checkpoint_base == 4
    assert c.conv[1].data_ptr() == c.conv_rows[1].data_ptr()  # the slots are the first rows of the row space
    for rows in c.conv_rows + c.ssm_rows:
        rows.copy_(torch.arange(rows.shape[0], dtype=torch.float32).view(-1, *[1] * (rows.dim() - 1)))
    # slot 2 accepted 1 of 2 drafts -> its checkpoint row 4 + 2*2 + 1; slot 0 accepted both -> keeps its own state
    c.keep_accepted(torch.tensor([2, 0]), torch.tensor([2, 2]), torch.tensor([1, 2]))
    for rows in c.conv_rows + c.ssm_rows:
        assert rows[2].flatten()[0] == 9 and rows[0].flatten()[0] == 0 and rows[1].flatten()[0] == 1
    with pytest.raises(RuntimeError, match="no speculative checkpoints"):
        StateCache(1, 1, (3, 8), (2, 4, 4), torch.float32).keep_accepted(torch.tensor([0]), torch.tensor([1]),
                                                                        torch.tensor([0]))


def test_settle_ignores_slots_allocated_again():
    c = StateCache(1, 2, (3, 8), (2, 4, 4), torch.float32, checkpoints=1)
    slot = c.allocate("a")
    lease = c.lease[slot]
    c.note_step([slot], [0], [9])
    c.settle(slot, lease, 7)
    assert c.num_tokens[slot] == 7
    c.free("a")
    again = c.allocate("b")
    assert again == slot and c.lease[slot] != lease
    c.settle(slot, lease, 5)  # a stale verdict (its request was preempted while the step ran)
    assert c.num_tokens[slot] == 0


def test_layer_verification_step_torch():
    assert CHECK.run_layer_verify("cpu", False).startswith("ok")


def test_walks_regrouped_for_the_torch_path():
    """A verification as decode rows with walks (a graph step's form) on the torch path == the prompt-form step."""
    assert CHECK.run_layer_walks("cpu", False).startswith("ok")


def test_verification_rows_are_checked():
    from tiny_models import tiny_gdn_layer
    from voltllm.model.layers.gdn import HybridBatch

    layer = tiny_gdn_layer("cpu")
    cache = StateCache(1, 2, layer.conv_state_shape, layer.ssm_state_shape, torch.float32, checkpoints=1)
    x = torch.randn(3, 32)
    batch = HybridBatch(cache, torch.tensor([0]), torch.tensor([True]), [0, 3], False, drafts=[2],
                        host_rows=([0], [True]))
    with pytest.raises(RuntimeError, match="checkpoints per slot"):
        layer(x, batch)


def test_window_checkpoints_hold_the_window_after_each_draft():
    """gdn_verify.WindowCheckpoints (Qwen4-Exp's PLE extras): checkpoint row j of a drafting request's slot holds the
    last `width` rows of [its old window | its rows 0 .. j]; a request without drafts (a prompt chunk) and other
    slots' rows are untouched; keep_accepted then leaves each slot at its last accepted position's window."""
    from voltllm.model.layers.gdn import HybridBatch
    from voltllm.model.layers.gdn_verify import WindowCheckpoints

    width, k, c = 3, 4, 2
    cache = StateCache(1, 4, (1, 1), (1, 1, 1), torch.float32, checkpoints=k, extras={"w": ((width, c), torch.float32)})
    cache.extra_rows["w"].copy_(torch.randn(cache.extra_rows["w"].shape))
    before = cache.extra_rows["w"].clone()
    qsl, slots, drafts = [0, 4, 9, 11], [2, 0, 3], [3, 0, 1]  # request 1: a 5-row prompt chunk, no drafts
    batch = HybridBatch(cache, torch.tensor(slots), torch.tensor([True, True, True]), qsl, decode_only=False)
    batch.drafts, batch.host_rows = drafts, (slots, [True] * 3)
    x = torch.randn(qsl[-1], c)
    plan = WindowCheckpoints.build(batch, width)
    plan.save(x, cache.extra["w"], cache.extra_rows["w"])
    written = set()
    for i in (0, 2):
        seq = torch.cat([before[slots[i]], x[qsl[i]:qsl[i + 1]]])
        for j in range(drafts[i]):
            row = cache.checkpoint_base + slots[i] * k + j
            assert torch.equal(cache.extra_rows["w"][row], seq[j + 1:j + 1 + width])
            written.add(row)
    untouched = [r for r in range(before.shape[0]) if r not in written]
    assert torch.equal(cache.extra_rows["w"][untouched], before[untouched])
    cache.extra["w"][2] = 7.0  # (the step's own write: the window after the last row)
    cache.keep_accepted(torch.tensor([2]), torch.tensor([3]), torch.tensor([1]))  # one of three drafts accepted
    assert torch.equal(cache.extra["w"][2], torch.cat([before[2], x[0:4]])[2:2 + width])
