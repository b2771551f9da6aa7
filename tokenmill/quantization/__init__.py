"""Quantized weights (quantization/fp8.py: FP8 e4m3 weights with per-row scales)."""

QUANTIZATION_METHODS = ("fp8",)  # what `quantization=` takes (online quantization at load)
