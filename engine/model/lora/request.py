"""A request's adapter (`LoRARequest`, vLLM's shape) and the one error every refusal raises."""

from __future__ import annotations

from dataclasses import dataclass


class LoRAError(ValueError):
    """An adapter that cannot be served: `code` is the OpenAI-style error code the server returns
    with a 400 (`lora_not_found`, `lora_invalid`, `lora_unsupported`, `lora_rank_too_large`,
    `lora_disabled`)."""

    def __init__(self, message: str, code: str = "lora_invalid") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """Run a request with adapter `lora_name` read from the PEFT folder `lora_path`. `lora_int_id`
    is vLLM's numeric id, kept for signature compatibility (names identify adapters here)."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise LoRAError("lora_name must be a non-empty string")
