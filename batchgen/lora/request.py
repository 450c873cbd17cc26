"""vLLM's `LoRARequest`: which adapter a prompt runs under."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`), named by
    `lora_name` and identified by `lora_int_id` (>= 1; equal ids are one adapter)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
