"""How the compat prefill joins a step's requests (voltllm/attention/compat_backend.py): the runs of equal requests
and the varlen plan. The kernels and attention they drive are checked in tests/unit/_fp8_kv_interp_check.py (CPU)
and tests/gpu/test_fp8_kv_gpu.py."""
import torch

from voltllm.attention.compat_backend import equal_runs, varlen_pieces


def _qsl(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def test_equal_runs_join_consecutive_equal_requests_only():
    qsl = _qsl([3, 3, 1, 2, 3, 3, 3])
    ctx = [3, 3, 9, 9, 3, 5, 5]
    assert equal_runs(qsl, ctx) == [(0, 2, 3, 3), (3, 1, 2, 9), (4, 1, 3, 3), (5, 2, 3, 5)]
    assert equal_runs(qsl, ctx, join=False) == [(0, 1, 3, 3), (1, 1, 3, 3), (3, 1, 2, 9), (4, 1, 3, 3),
                                                (5, 1, 3, 5), (6, 1, 3, 5)]
    assert equal_runs(_qsl([1, 1, 4]), [7, 0, 0]) == []  # one-row and empty sequences are not prefill


def test_varlen_plan_pieces_and_offsets():
    # requests (query rows, context): A (3, 3), B (2, 6), a decode row, C (4, 10), D (2, 2); workspace of 12 rows
    qsl = _qsl([3, 2, 1, 4, 2])
    ctx = [3, 6, 40, 10, 2]
    pieces = varlen_pieces(qsl, ctx, group=2, ws_rows=12, device=torch.device("cpu"))
    # the decode row splits A + B from C; C + D would need 12 rows: they fit exactly
    assert [p.seqs for p in pieces] == [[0, 1], [3, 4]]
    a_b, c_d = pieces
    assert (a_b.row0, a_b.row1, a_b.max_q, a_b.max_ctx) == (0, 5, 3, 6)
    assert a_b.bridge.tolist() == [[0, 1], [3, 6], [0, 3]]  # block-table row, context, first workspace row
    # group-head major: (head 0, A) rows 0-2, (0, B) 3-4, (1, A) 5-7, (1, B) 8-9
    assert a_b.cu_q.tolist() == [0, 3, 5, 8, 10]
    assert a_b.k_start.tolist() == [0, 3, 0, 3, 9]
    assert a_b.k_len.tolist() == [3, 6, 3, 6]
    assert (c_d.row0, c_d.row1) == (6, 12)
    assert c_d.bridge.tolist() == [[3, 4], [10, 2], [0, 10]]
    assert c_d.cu_q.tolist() == [0, 4, 6, 10, 12]
    assert c_d.k_start.tolist() == [0, 10, 0, 10, 12]
    assert all(t.dtype == torch.int32 for p in pieces for t in (p.bridge, p.cu_q, p.k_start, p.k_len))


def test_varlen_plan_splits_at_the_workspace():
    pieces = varlen_pieces(_qsl([5, 5, 5]), [5, 5, 5], group=1, ws_rows=9, device=torch.device("cpu"))
    assert [p.seqs for p in pieces] == [[0], [1], [2]]
    pieces = varlen_pieces(_qsl([5, 5, 5]), [5, 5, 5], group=1, ws_rows=10, device=torch.device("cpu"))
    assert [p.seqs for p in pieces] == [[0, 1], [2]]
