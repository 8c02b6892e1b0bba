"""serving_embedding.embedding_bytes, the bytes behind /v1/embeddings' base64, bytes and bytes_only answers: each
embed_dtype's exact values (numpy has no bfloat16 / fp8: their bits) in each byte order."""
import sys

import numpy as np
import pytest
import torch

from voltllm.entrypoints.openai.serving_embedding import embedding_bytes

VALUES = torch.tensor([0.1, -0.5, 1.0, 3.0e-3, -0.25], dtype=torch.float32)


@pytest.mark.parametrize("embed_dtype,np_dtype,torch_dtype", [
    ("float32", "f4", torch.float32), ("float16", "f2", torch.float16), ("bfloat16", "i2", torch.bfloat16),
    ("fp8_e4m3", "u1", torch.float8_e4m3fn), ("fp8_e5m2", "u1", torch.float8_e5m2)])
@pytest.mark.parametrize("endianness,order", [("native", "="), ("little", "<"), ("big", ">")])
def test_values_and_byte_orders(embed_dtype, np_dtype, torch_dtype, endianness, order):
    raw = embedding_bytes(VALUES, embed_dtype, endianness)
    assert len(raw) == VALUES.numel() * torch_dtype.itemsize
    array = np.frombuffer(raw, dtype=order + np_dtype).astype("=" + np_dtype)
    back = torch.from_numpy(array)
    if np_dtype in ("i2", "u1"):
        back = back.view(torch_dtype)
    assert torch.equal(back.float(), VALUES.to(torch_dtype).float())


def test_native_is_this_machines_order_and_one_byte_values_have_none():
    mine = "little" if sys.byteorder == "little" else "big"
    assert embedding_bytes(VALUES, "float16", "native") == embedding_bytes(VALUES, "float16", mine)
    assert embedding_bytes(VALUES, "float16", "little") != embedding_bytes(VALUES, "float16", "big")
    assert embedding_bytes(VALUES, "fp8_e4m3", "little") == embedding_bytes(VALUES, "fp8_e4m3", "big")
