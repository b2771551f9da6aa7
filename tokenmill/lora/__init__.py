"""Multi-LoRA: PEFT adapters, their GPU slots, and the per-step LoRA context of the linear layers."""
