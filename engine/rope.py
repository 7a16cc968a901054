"""Rotary position embeddings, with the Llama-3 and linear frequency scalings (DESIGN §8).

The rotation is the Hugging Face "rotate half" form: a head vector `x` is split into halves
`(x1, x2)` and rotated as `(x1·cos - x2·sin, x2·cos + x1·sin)`, with frequency i shared by
element i of each half.
"""

from __future__ import annotations

import math

import torch

from engine.config import ModelConfig, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """The `head_dim // 2` rotation frequencies (radians per position), float64.

    Llama 3 scaling keeps high frequencies (wavelength < original_ctx / high_freq_factor), divides
    low ones (wavelength > original_ctx / low_freq_factor) by `factor`, and blends linearly in
    between, by how many wavelengths fit in the original context.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None or scaling.rope_type == "linear":
        return inv_freq
    old_ctx = float(scaling.original_max_position_embeddings)
    low, high, factor = scaling.low_freq_factor, scaling.high_freq_factor, scaling.factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, blended)
    return torch.where(wavelen < old_ctx / high, inv_freq, scaled)


class Rotary:
    """Cos/sin tables for one model; `cos_sin(positions)` per forward, `apply` per layer."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        scaling = config.rope_scaling
        self.position_scale = (
            1.0 / scaling.factor if scaling and scaling.rope_type == "linear" else 1.0
        )
        self.inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, scaling).to(
            device=device, dtype=torch.float32
        )

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, `[len(positions), head_dim // 2]` float32, for integer positions."""
        pos = positions.to(device=self.inv_freq.device, dtype=torch.float32) * self.position_scale
        angles = pos[:, None] * self.inv_freq[None, :]
        return angles.cos(), angles.sin()

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate `x` `[tokens, heads, head_dim]` by the per-token angles; computed in float32."""
        half = x.shape[-1] // 2
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
