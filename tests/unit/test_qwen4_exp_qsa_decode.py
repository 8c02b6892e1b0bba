"""Qwen4-Exp QSA decode rows on the device path (qwen4_exp_qsa_decode: pooled keys stored when blocks complete,
scores + top-k, virtual block tables over P-token pages) against the torch reference (QSAIndexer.selection +
sparse_attention), on fresh random data: the selected token sets must be equal and the attention close. Rows below
and above budget + ratio in one batch, odd lengths, rows completing a block this step, graph padding rows; ratio
below, equal to and twice the KV page. The Triton paged decode kernel over the same tables runs under the
interpreter (_qsa_decode_interp_check.py)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from interp_util import run_interp_checks

HELPER = Path(__file__).with_name("_qsa_decode_interp_check.py")
_spec = importlib.util.spec_from_file_location("_qsa_decode_interp_check", HELPER)
chk = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = chk  # dataclasses need the module registered
_spec.loader.exec_module(chk)

MIXED = [7, 16, 23, 40, 41, 64, 99, 100, 129]


@pytest.mark.parametrize("ratio, page, budget", [(4, 16, 16), (4, 4, 16), (8, 4, 16), (4, 8, 8), (2, 16, 6)])
@pytest.mark.parametrize("seed", [1, 2])
def test_selection_and_attention_match_reference(ratio, page, budget, seed):
    from voltllm.attention.torch_ref import TorchReferenceBackend

    case = chk.make_case(MIXED, ratio, page, budget, seed=seed * 10 + ratio, pad_rows=2)
    # rows both ways: some contexts drop blocks, some are plain causal
    assert min(MIXED) < budget + ratio <= max(MIXED)
    err, problems = chk.run_case(case, TorchReferenceBackend())
    assert not problems, problems
    assert err < 1e-5, err


def test_long_rows_select_budget_tokens_and_short_rows_everything():
    case = chk.make_case(MIXED, 4, 16, 16, seed=7)
    vmeta, page = chk.run_selection(case)
    lens = vmeta.seq_lens.tolist()
    for n, got in zip(MIXED, lens):
        tail = n - n // 4 * 4
        assert got == (n if n < 16 + 4 else 16 + tail), (n, got)
    assert page == 4 and vmeta.max_seq_len <= 16 + 4


def test_pooled_keys_are_needed():
    """Pooled keys computed when blocks complete are what scores read: leaving the prompt's out (zeros) changes the
    selection of rows past the budget."""
    case = chk.make_case(MIXED, 4, 16, 16, seed=3)
    case.pooled.zero_()
    _, want = chk.reference(case)
    vmeta, page = chk.run_selection(case)
    got = chk.selected_slots(vmeta, page, len(MIXED))
    assert any(not torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("name", ["ratio_lt_page_nosplit", "ratio_eq_page_split", "ratio_two_pages_fma",
                                  "ratio_lt_page_f16_lanes"])
def test_paged_decode_kernel_over_virtual_tables_interp(interp_results, name):
    assert interp_results.get(name, "missing").startswith("ok"), interp_results.get(name)


@pytest.fixture(scope="module")
def interp_results() -> dict[str, str]:
    return run_interp_checks(HELPER, (), timeout=300)
