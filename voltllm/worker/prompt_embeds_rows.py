"""A step's prompt-embedding rows (--enable-prompt-embeds, engine/prompt_embeds.py): the given rows of the prompt tokens
the step computes, in place of their placeholder ids' embeddings. They reach the model as a vision tower's rows do,
extra["image_embeds"] = (token indices, rows) (the model copies them over its embedding lookup), merged with a step's
image rows when it has both; rank 0 broadcasts them to the other tensor-parallel ranks after the step's input ids."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

from voltllm.host_to_device import upload


def needs_rows(scheduled: Sequence[Any]) -> bool:
    """Whether the step computes prompt tokens of a request given as embeddings (such a step runs eagerly: no graph
    replays the row copy)."""
    return any(s.request.prompt_embeds is not None and s.start < s.request.num_prompt_tokens for s in scheduled)


def gather_rows(scheduled: Sequence[Any], query_start_loc: Sequence[int]) -> Optional[tuple[np.ndarray, torch.Tensor]]:
    """(the step's token indices, their rows [k, hidden] on the host) for the prompt tokens of embedding requests;
    None when the step has none. query_start_loc: each request's first token in the step."""
    at, rows = [], []
    for i, s in enumerate(scheduled):
        req = s.request
        if req.prompt_embeds is None or s.start >= req.num_prompt_tokens:
            continue
        end = min(s.start + s.num_new_tokens, req.num_prompt_tokens)
        at.append(np.arange(end - s.start, dtype=np.int64) + query_start_loc[i])
        rows.append(req.prompt_embeds[s.start:end])
    if not rows:
        return None
    dtypes = {r.dtype for r in rows}
    return np.concatenate(at), torch.cat(rows if len(dtypes) == 1 else [r.float() for r in rows])


def apply_rows(extra: dict, at: np.ndarray, rows: torch.Tensor, device: torch.device) -> None:
    """Hand the model the rows (on the device, in its dtype) for tokens `at`, after any image rows of the step."""
    index = upload(torch.from_numpy(at), device)
    images = extra.get("image_embeds")
    if images is not None:
        index, rows = torch.cat([images[0], index]), torch.cat([images[1], rows.to(images[1].dtype)])
    extra["image_embeds"] = (index, rows)
