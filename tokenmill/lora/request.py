"""What a request names to run with a LoRA adapter."""

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for a request: `lora_name` is how it is known (the served model name in the
    API server), `lora_int_id` its unique positive id (the engine keys slots, caches and the prefix
    cache by it), `lora_path` a directory as PEFT saves it (adapter_config.json and
    adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
