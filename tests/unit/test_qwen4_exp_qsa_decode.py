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
from voltllm.model.models import qwen4_exp_qsa_decode as qsa

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


@pytest.mark.parametrize("ratio, page, budget, chunk", [(4, 16, 16, 7), (8, 4, 16, 64), (2, 16, 6, 1)])
def test_prompt_rows_match_reference(ratio, page, budget, chunk):
    """A multi-row chunk's rows past the budget (prompt_selection, cut into chunks of rows) select what the reference
    selects row by row and attend alike; the rows' own positions bound their selection (causal within the chunk)."""
    from voltllm.attention.torch_ref import TorchReferenceBackend

    case = chk.make_case([97], ratio, page, budget, seed=ratio + page)
    err, problems = chk.run_prompt_rows(case, TorchReferenceBackend(), 60, chunk)
    assert not problems, problems
    assert err < 1e-5, err


def test_prompt_rows_per_chunk_bounds_the_scores():
    case = chk.make_case([40], 4, 16, 16, seed=1)
    ix = case.indexer
    assert qsa.prompt_rows_per_chunk(ix, 39) == 1024  # short contexts: the row cap
    rows = qsa.prompt_rows_per_chunk(ix, 262143)  # 256K tokens, 64K blocks
    assert 1 <= rows and rows * ix.n_heads * (262144 // 4) * 8 <= qsa.SCORE_BYTES
    assert qsa.first_sparse_token(ix) == (16 // 4 + 1) * 4 - 1


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
                                  "ratio_lt_page_f16_lanes", "prompt_rows_split",
                                  "scores_kernel_f32", "scores_kernel_f16_r8", "chunk_scores_f32",
                                  "chunk_scores_f32_tiles", "chunk_scores_f16_r8"])
def test_paged_decode_kernel_over_virtual_tables_interp(interp_results, name):
    assert interp_results.get(name, "missing").startswith("ok"), interp_results.get(name)


@pytest.fixture(scope="module")
def interp_results() -> dict[str, str]:
    return run_interp_checks(HELPER, (), timeout=300)
