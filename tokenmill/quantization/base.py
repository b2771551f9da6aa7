"""What a weight method and a quantization config are (the layers implement them, layers/linear.py,
layers/fp8_linear.py and, for mixture-of-experts layers, layers/fused_moe.py).

A layer holds one method object, chosen when the model is built or loaded; the method creates the
layer's weight parameters, converts them once every checkpoint tensor is in, and multiplies with
them. The step path then calls the method and never asks which format the weights are in.
"""

from abc import ABC, abstractmethod
from typing import ClassVar, Optional

import torch
from torch import nn

from tokenmill.errors import ModelLoadError


class QuantizeMethodBase(ABC):
    """How one layer stores its weights and computes with them. A method object holds no reference
    to its layer (the layer holds the method), so a freed model is freed by reference counting."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        """Register the layer's weight parameters (with their weight loaders), before loading."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Once every checkpoint tensor is in: convert the weights to the form apply() reads."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [M, K] -> x W^T (+ bias) [M, N] in x's dtype."""


class QuantizationConfig(ABC):
    """A quantization format: which method each layer gets."""

    name: ClassVar[str]

    @abstractmethod
    def get_linear_method(self, layer: nn.Module) -> Optional[QuantizeMethodBase]:
        """The method for this linear layer (None: the layer keeps its unquantized method)."""

    def get_moe_method(self, layer: nn.Module) -> Optional[QuantizeMethodBase]:
        """The method for a mixture-of-experts layer's experts (layers/fused_moe.py's FusedMoE; None:
        they keep their unquantized method). By default a format refuses (FP8 gives layers/fp8_moe.py's
        method): experts silently left in 16 bits would not be the model the user asked for."""
        raise ModelLoadError(f"quantization {self.name!r} cannot quantize the experts of mixture-of-experts "
                             f"models yet; load this model without quantization")
