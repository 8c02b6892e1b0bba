"""vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters loaded and unloaded while the server runs
(only with --allow-runtime-lora-updating, vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING; without it the routes do not
exist: 404).

Load: the adapter is read and checked here, in the API process, against the model and --max-lora-rank (as
--lora-modules are at start), before it is registered: a path with no adapter is a 404, an adapter that fails its
checks a 400, and either changes nothing. A name already loaded is a 400 unless `load_inplace` is true: then the new
adapter replaces it under a new lora_int_id, so the engine never takes the old load's weights or prefix-cache blocks
for it, and the old load is removed from the engine (the requests running with it finish with it). Unload: requests
naming the adapter get the model-not-found 404 from then on; the engine drops it from CPU memory and its GPU slot
once the requests already running with it have finished. Loads and unloads run one at a time.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, Optional

from pydantic import BaseModel

from voltllm.entrypoints.openai.errors import OpenAIError, bad_request

logger = logging.getLogger("voltllm")


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False
    # vLLM's flag for adapters on fused 3D MoE expert tensors: taken, the reader tells the form from the weights
    is_3d_lora_weight: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    # vLLM takes it and goes by the name alone (clients cannot know the server's ids): so does voltllm
    lora_int_id: Optional[int] = None


class RuntimeLoRAs:
    """The load / unload routes' state: one operation at a time, and the next lora_int_id (after --lora-modules')."""

    def __init__(self, state: Any):
        self.state = state
        self.lock = asyncio.Lock()
        self.ids = itertools.count(max((r.lora_int_id for r in state.lora_modules.values()), default=0) + 1)

    async def load(self, req: LoadLoRAAdapterRequest) -> str:
        from voltllm.lora.adapter import LoRAAdapterError, LoRAAdapterNotFoundError, read_adapter
        from voltllm.lora.request import LoRARequest

        state, name = self.state, req.lora_name
        if not name or not req.lora_path:
            raise bad_request("both 'lora_name' and 'lora_path' must be given (non-empty strings)",
                              "lora_path" if name else "lora_name")
        if name in state.served_model_names:
            raise bad_request(f"{name!r} is a served model name (--served-model-name); give the adapter another name",
                              "lora_name")
        async with self.lock:
            old = state.lora_modules.get(name)
            if old is not None and not req.load_inplace:
                raise bad_request(f"LoRA adapter {name!r} is already loaded (from {old.lora_path}); to replace it, "
                                  "send load_inplace: true, or unload it first", "lora_name")
            lora = LoRARequest(name, next(self.ids), req.lora_path, old.base_model_name if old is not None else None)
            config = state.engine.config
            try:  # (a file read: off the event loop)
                await asyncio.to_thread(read_adapter, lora, config.model.hf_config, config.lora.max_lora_rank,
                                        config.lora.lora_dtype)
            except LoRAAdapterNotFoundError as e:
                raise OpenAIError(str(e), 404, "lora_path") from None
            except LoRAAdapterError as e:
                raise bad_request(str(e), "lora_path") from None
            state.lora_modules[name] = lora
            if old is not None:  # (sent after every request of the old load: those finish with it)
                state.engine.remove_lora(old.lora_int_id)
        logger.info("LoRA adapter %r loaded from %s%s", name, req.lora_path, " (in place)" if old is not None else "")
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, req: UnloadLoRAAdapterRequest) -> str:
        state, name = self.state, req.lora_name
        if not name:
            raise bad_request("'lora_name' must be given (a non-empty string) to unload an adapter", "lora_name")
        async with self.lock:
            lora = state.lora_modules.pop(name, None)
            if lora is None:
                loaded = ", ".join(repr(n) for n in state.lora_modules) or "none"
                raise OpenAIError(f"LoRA adapter {name!r} is not loaded (loaded: {loaded})", 404, "lora_name")
            state.engine.remove_lora(lora.lora_int_id)
        logger.info("LoRA adapter %r unloaded", name)
        return f"Success: LoRA adapter '{name}' removed successfully."
