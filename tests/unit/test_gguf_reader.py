"""voltllm.model.loader.gguf_reader.open_gguf: the gguf library's reader over a plain view of the memory map reads
the same header and tensors as the library's own reader (every field's parts, types and contents; every tensor's
name, type, shape, offset and bytes)."""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")


def _write(path):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.name", "tiny ünïcode")
    w.add_uint32("llama.block_count", 3)
    w.add_float32("llama.rope.freq_base", 10000.5)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" if i % 7 else "" for i in range(300)])
    w.add_array("tokenizer.ggml.scores", [float(-i) for i in range(300)])
    w.add_array("tokenizer.ggml.token_type", [i % 3 for i in range(300)])
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((300, 32)).astype(np.float16))
    w.add_tensor("output_norm.weight", rng.standard_normal(32).astype(np.float32))
    w.add_tensor("blk.0.attn_q.weight", rng.standard_normal((32, 64)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_open_gguf_reads_what_the_library_reads(tmp_path):
    from voltllm.model.loader.gguf_reader import open_gguf

    path = tmp_path / "tiny.gguf"
    _write(path)
    ours, theirs = open_gguf(str(path)), gguf.GGUFReader(str(path), "r")
    assert isinstance(ours, gguf.GGUFReader) and type(ours.data) is np.ndarray
    assert list(ours.fields) == list(theirs.fields) and "tokenizer.ggml.tokens" in ours.fields
    for name, f in theirs.fields.items():
        g = ours.fields[name]
        assert (g.offset, g.types, g.data) == (f.offset, f.types, f.data), name
        assert len(g.parts) == len(f.parts) and all(np.array_equal(a, b) for a, b in zip(g.parts, f.parts)), name
        assert g.contents() == f.contents(), name
    assert ours.fields["tokenizer.ggml.tokens"].contents()[:2] == ["", "tok1"]
    assert ours.fields["general.name"].contents() == "tiny ünïcode"
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors] and len(ours.tensors) == 3
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, a.data_offset, a.n_elements) == (b.tensor_type, b.data_offset, b.n_elements)
        assert np.array_equal(a.shape, b.shape) and np.array_equal(a.data, b.data)
