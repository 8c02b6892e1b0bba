"""GET /v1/models entries, in vLLM's ModelCard shape: id, object, created, owned_by, root, parent, max_model_len and
`permission`, a one-entry list with vLLM's ModelPermission values (clients written for OpenAI's older model objects
read it)."""
from __future__ import annotations

import uuid

from voltllm.entrypoints.openai.serving_common import ServerState


def _permission(perm_id: str, created: int) -> dict:
    # vLLM's defaults: sampling, logprobs and viewing allowed; no engine creation, search indices or fine-tuning
    return {"id": perm_id, "object": "model_permission", "created": created, "allow_create_engine": False,
            "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
            "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}


class ModelCards:
    """The cards of the served names and LoRA adapters. A name's permission id (`modelperm-<hex>`, as vLLM's) is
    made once and kept, so a card reads the same on each call (vLLM makes a new id per call)."""

    def __init__(self, state: ServerState):
        self.state = state
        self._permission_ids: dict[str, str] = {}

    def card(self, name: str) -> dict:
        state = self.state
        lora = state.lora_modules.get(name)  # a --lora-modules adapter: vLLM's parent (its base) and root (its path)
        root, parent = ((lora.lora_path, lora.base_model_name or state.served_model_names[0]) if lora is not None
                        else (state.model_path, None))
        perm_id = self._permission_ids.setdefault(name, f"modelperm-{uuid.uuid4().hex}")
        return {"id": name, "object": "model", "created": state.created, "owned_by": "voltllm",
                "root": root, "parent": parent, "max_model_len": state.max_model_len,
                "permission": [_permission(perm_id, state.created)]}

    def listing(self) -> dict:
        names = [*self.state.served_model_names, *self.state.lora_modules]
        return {"object": "list", "data": [self.card(n) for n in names]}
