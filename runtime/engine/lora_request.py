"""Which LoRA adapter an offline request runs, as vLLM's `LLM.generate(..., lora_request=)`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """Adapter `lora_name`, read from PEFT folder `lora_path` on first use; `lora_int_id`
    (>= 1) names it to the engine: one id per adapter, the prefix cache is keyed by it."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: must be >= 1, got {self.lora_int_id}")
