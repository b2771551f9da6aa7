"""Random weights for benchmarks and tests: deterministic from a seed, generated on the device."""

import torch
from torch import nn


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02, generator_device=None) -> None:
    """Fill every parameter: matrices ~ N(0, std), norm weights ~ 1 + U(-0.1, 0.1), biases ~ N(0, std).

    Each parameter gets its own generator seeded from (seed, its index), so values do not depend on
    what else the model holds. `generator_device="cpu"` draws on the CPU and copies to the parameter's
    device, which gives bit-identical weights on every machine (used to compare CPU and CUDA runs).
    """
    # Parameters derived from another one (an FP8 weight's scales) are not drawn, so that the others
    # get the indices, and the values, they have in the full-precision model.
    drawn = [(n, p) for n, p in model.named_parameters() if not getattr(p, "derived", False)]
    for index, (name, param) in enumerate(sorted(drawn, key=lambda item: item[0])):
        device = torch.device(generator_device) if generator_device is not None else param.device
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)
        target = torch.empty(param.shape, dtype=torch.float32, device=device)
        if name.endswith("norm.weight"):
            target.uniform_(0.9, 1.1, generator=gen)
        else:
            target.normal_(0.0, std, generator=gen)
        fill = getattr(param, "dummy_fill", None)
        if fill is not None:  # a quantized weight: its method quantizes the full-precision values
            fill(param, target)
        else:
            param.data.copy_(target.to(param.device, param.dtype))
