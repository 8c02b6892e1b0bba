"""InputBuffers: a step of at most max_seqs tokens and rows uses the compact layout (one byte buffer, one upload
copy; CUDA graphs are captured on it), a longer one the wide per-array layout; either way the device arrays
hold what prepare staged. The engine gives the same tokens whichever layout its steps use."""
import numpy as np
import pytest
import torch

from voltllm.worker.input_buffers import InputBuffers


def _stage(h, n_tok, rows, width, seed):
    rng = np.random.default_rng(seed)
    want = {"input_ids": rng.integers(0, 1 << 40, n_tok), "positions": rng.integers(0, 1 << 20, n_tok),
            "slot_mapping": rng.integers(-1, 1 << 30, n_tok), "query_start_loc": np.sort(rng.integers(0, n_tok, rows + 1)),
            "seq_lens": rng.integers(1, 4096, rows), "state_slots": rng.integers(0, 100, rows)}
    for k, v in want.items():
        h[k][: len(v)] = v
    table = rng.integers(0, 1 << 20, (rows, width))
    h["block_tables"][: rows * width] = table.ravel()
    return want, table


@pytest.mark.parametrize("n_tok,rows,compact", [(8, 8, True), (3, 5, True), (9, 2, False), (40, 8, False)])
def test_device_arrays_hold_the_staged_step(n_tok, rows, compact):
    buf = InputBuffers(max_tokens=48, max_seqs=8, max_blocks_per_seq=6, device=torch.device("cpu"))
    raw = buf._raw
    for step in range(3):  # layouts may alternate between steps
        h = buf.host_set(n_tok, rows)
        assert buf.fits_compact(n_tok, rows) == compact
        want, table = _stage(h, n_tok, rows, 4, seed=step)
        buf.upload(n_tok, rows, 4, state_slots=True)
        assert (buf.input_ids.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()) == compact
        for k, v in want.items():
            got = getattr(buf, k)[: len(v)]
            assert got.dtype == (torch.int32 if k in ("query_start_loc", "seq_lens") else torch.long)
            assert np.array_equal(got.numpy(), v), k
        assert np.array_equal(buf.block_tables[:rows, :4].numpy(), table)
    buf.select_compact()  # what graph capture and replay read
    assert buf.input_ids.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
    assert buf.query_start_loc.numel() == 9 and buf.seq_lens.numel() == 8


def test_compact_fields_do_not_overlap():
    buf = InputBuffers(max_tokens=64, max_seqs=5, max_blocks_per_seq=2, device=torch.device("cpu"))
    buf.select_compact()
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                   for t in (buf.input_ids, buf.positions, buf.slot_mapping, buf.state_slots, buf.query_start_loc,
                             buf.seq_lens))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert all(p % 8 == 0 for p, _ in spans)


def test_engine_tokens_do_not_depend_on_the_layout(tmp_path):
    """max_num_seqs 4: the prompt steps (5-30 tokens per prompt) use the wide layout, the decode steps the compact
    one; the same prompts one at a time with max_num_seqs 64 (every step compact) give the same greedy tokens."""
    from tiny_models import make_model
    from voltllm import LLM, SamplingParams

    path = make_model(str(tmp_path / "m"), "llama")
    prompts = [list(range(3, 3 + n)) for n in (5, 30, 12, 7, 21, 4)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    small = LLM(path, device="cpu", max_num_seqs=4, max_model_len=128)
    got = [o.outputs[0].token_ids for o in small.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    big = LLM(path, device="cpu", max_num_seqs=64, max_model_len=128)
    want = [big.generate({"prompt_token_ids": p}, sp)[0].outputs[0].token_ids for p in prompts]
    assert got == want
    buf = small.engine.runner.buffers
    assert not buf.fits_compact(30, 1) and buf.fits_compact(4, 4)
