"""Prompt embeddings as input (vLLM's --enable-prompt-embeds): a prompt given as its rows of input embeddings
[tokens, hidden] instead of token ids (offline `{"prompt_embeds": tensor}`, over HTTP /v1/completions'
`prompt_embeds`: base64 of a `torch.save`d tensor).

The engine runs such a prompt as placeholder token ids (PLACEHOLDER_ID, one per row: the scheduler, the KV cache and
the usage count tokens as usual) whose embedding rows the runner replaces with the given ones, as it replaces image
placeholders with a vision tower's rows (worker/prompt_embeds_rows.py). Its prefix-cache blocks are keyed by the
rows' content: every span of rows (SPAN_ROWS, or fewer so that no span crosses a KV block) carries a hash of its bytes
into the block it falls in (cache/prefix.py's content spans), so two prompts share blocks exactly as far as their
embeddings agree, block by block.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
from typing import Any

import torch

from voltllm.engine.frontend import InvalidPromptError

PLACEHOLDER_ID = 0
SPAN_ROWS = 16
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _refused(message: str) -> InvalidPromptError:
    return InvalidPromptError(message, "prompt_embeds")


def decode_base64_embeds(value: Any) -> torch.Tensor:
    """A tensor from base64 text of `torch.save(tensor)` (vLLM's wire form), read with torch.load's weights_only
    loader (plain tensors only: no code runs)."""
    if not isinstance(value, (str, bytes)):
        raise _refused("prompt_embeds must be base64 text of a torch.save()d tensor, or a list of them")
    try:
        raw = base64.b64decode(value, validate=True)
        loaded = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except (binascii.Error, ValueError) as e:
        raise _refused(f"prompt_embeds is not valid base64: {e}") from None
    except Exception as e:  # (torch.load's errors for data that is no saved tensor vary by cause)
        raise _refused(f"prompt_embeds is not a torch.save()d tensor: {type(e).__name__}: {e}") from None
    if not isinstance(loaded, torch.Tensor):
        raise _refused(f"prompt_embeds must hold one tensor, got {type(loaded).__name__}")
    return loaded


def check_prompt_embeds(embeds: Any, hidden_size: int) -> torch.Tensor:
    """The rows as the engine takes them: a 2-D floating CPU tensor [tokens, hidden_size] (a batch of one
    [1, tokens, hidden_size] is squeezed, as vLLM does), finite; InvalidPromptError otherwise."""
    if not isinstance(embeds, torch.Tensor):
        raise _refused(f"prompt_embeds must be a torch tensor, got {type(embeds).__name__}")
    if embeds.dim() == 3 and embeds.shape[0] == 1:
        embeds = embeds[0]
    if embeds.dim() != 2:
        raise _refused(f"prompt_embeds must be [tokens, hidden_size], got shape {list(embeds.shape)}")
    if embeds.dtype not in FLOAT_DTYPES:
        raise _refused(f"prompt_embeds must be float16, bfloat16 or float32, got {embeds.dtype}")
    if embeds.shape[0] == 0:
        raise _refused("prompt_embeds has no rows")
    if embeds.shape[1] != hidden_size:
        raise _refused(f"prompt_embeds rows have {embeds.shape[1]} values; this model's hidden size is "
                                 f"{hidden_size}")
    embeds = embeds.detach().to("cpu").contiguous()
    if not bool(torch.isfinite(embeds).all()):
        raise _refused("prompt_embeds holds inf or NaN values")
    return embeds


def embeds_spans(embeds: torch.Tensor, block_size: int = SPAN_ROWS) -> tuple[tuple[int, int, bytes], ...]:
    """(start, end, hash of the rows' bytes) for every gcd(SPAN_ROWS, block_size) rows: the prefix-cache keys of the
    blocks they fall in (the dtype is hashed too: the same values in another dtype are other embeddings to the model).
    The span length divides the block size, so a block's key depends on its own rows only."""
    rows = math.gcd(SPAN_ROWS, block_size)
    flat = embeds.contiguous().view(torch.uint8).reshape(embeds.shape[0], -1).numpy()
    tag = str(embeds.dtype).encode()
    spans = []
    for start in range(0, embeds.shape[0], rows):
        end = min(start + rows, embeds.shape[0])
        h = hashlib.blake2b(tag, digest_size=16)
        h.update(flat[start:end].tobytes())
        spans.append((start, end, h.digest()))
    return tuple(spans)
