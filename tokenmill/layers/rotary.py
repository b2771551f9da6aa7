"""Rotary position embedding with a precomputed cos/sin table (default, linear, llama3, LongRoPE and YaRN
frequency scaling)."""

import math
from typing import Optional, Sequence

import torch
from torch import nn

from tokenmill.kernels.rotary import rotary_embedding


def rope_inv_freq(head_dim: int, theta: float, kind: str = "default", factor: float = 1.0,
                  low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                  original_max_position: int = 8192,
                  freq_factors: Optional[Sequence[float]] = None, beta_fast: float = 32.0,
                  beta_slow: float = 1.0, truncate: bool = True) -> torch.Tensor:
    """The D/2 rotation frequencies, float32 (`head_dim` is the rotated width)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if kind == "linear":  # positions interpolated by `factor` (Gemma 3's global layers: 8)
        inv_freq = inv_freq / factor
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
        # interpolated, so the model sees its original context's frequencies stretched.
        wavelen = 2 * math.pi / inv_freq
        low_freq_wavelen = original_max_position / low_freq_factor
        high_freq_wavelen = original_max_position / high_freq_factor
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = torch.where(in_band, blended, scaled)
    if kind == "yarn":
        inv_freq = _yarn_blend(inv_freq, head_dim, theta, factor, original_max_position, beta_fast, beta_slow, truncate)
    # Per-frequency divisors: GGUF files carry llama3 scaling so; LongRoPE's short or long factors
    if freq_factors is not None:
        inv_freq = inv_freq / torch.as_tensor(freq_factors, dtype=torch.float32)
    return inv_freq


def _yarn_blend(inv_freq: torch.Tensor, dim: int, theta: float, factor: float, original_max_position: int,
                beta_fast: float, beta_slow: float, truncate: bool) -> torch.Tensor:
    """YaRN: frequencies that turn more than beta_fast times over the original context keep their value,
    those turning fewer than beta_slow times are interpolated by `factor`, with a linear ramp between."""
    def dim_of(rotations: float) -> float:  # the dimension whose frequency turns this often
        return dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


class RotaryEmbedding(nn.Module):
    """The table the rotary kernels read: [max_positions, head_dim], cos of the D/2 pair angles, then
    their sin, float32.

    `inv_freq` may cover fewer pairs than head_dim / 2 (partial rotary): the remaining pairs get
    cos 1, sin 0 and pass through unchanged; the model lays each head out so that its rotated pairs
    come first in both halves (models/phi3.py). `scale` multiplies the rotated pairs' cos and sin
    (LongRoPE's attention factor, which scales q.k by its square).
    """

    def __init__(self, head_dim: int, max_positions: int, inv_freq: torch.Tensor, device=None, scale: float = 1.0):
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)
        cos, sin = angles.cos() * scale, angles.sin() * scale
        passed = head_dim // 2 - inv_freq.shape[0]
        if passed:
            cos = torch.cat((cos, torch.ones(max_positions, passed)), dim=-1)
            sin = torch.cat((sin, torch.zeros(max_positions, passed)), dim=-1)
        cache = torch.cat((cos, sin), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos_sin_cache", cache.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hk, D] -> rotated (q, k)."""
        return rotary_embedding(positions, q, k, self.cos_sin_cache)
