"""LoRARequest: which adapter a request runs with (vLLM's class: `LoRARequest(lora_name, lora_int_id, lora_path)`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LoRARequest:
    """An adapter: its name, a positive integer id (vLLM's "globally unique" id: the engine takes one (name, id) as one
    adapter, and remove_lora goes by the id) and the directory holding adapter_config.json and
    adapter_model.safetensors. base_model_name: the served model it is listed under (/v1/models `parent`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("LoRARequest: lora_name must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be an integer > 0, got "
                             f"{self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path (the adapter's directory) is required")

    # vLLM's aliases
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
