"""Rotary position embedding applied to cached keys at their own positions (pre-RoPE keys).

KVQuant quantizes keys *before* RoPE: the per-channel structure of keys (a few channels with
large magnitude) is cleanest there, and RoPE mixes channel pairs with position-dependent angles.
The cache stores pre-RoPE keys and the attention op rotates them after dequantization.

The model's own rotary module defines the rotation: `inv_freq` (which already carries
rope_theta and static scaling such as linear or llama3) and `attention_scaling` (a factor on
cos/sin, as in YaRN). `rotate` reproduces transformers' `apply_rotary_pos_emb` exactly
(cos = cos(pos * inv_freq) * scaling, halves rotated as in `rotate_half`); `unrotate` inverts it.
"""

from __future__ import annotations

import torch


def _freqs(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Angles [T, D/2], computed as transformers' rotary module computes them."""
    return positions.float()[:, None] * inv_freq.float()[None, :]


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's angles, [T, D] (halves repeated, as transformers lays them out)."""
    freqs = _freqs(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    """RoPE of x [..., T, D] at `positions` [T] (as the model applies it)."""
    return rotate_with(x, *cos_sin(positions, inv_freq), scaling)


def rotate_with(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scaling: float) -> torch.Tensor:
    """RoPE of x [..., T, D] given the `cos_sin` table of its positions."""
    return x * (cos * scaling) + _rotate_half(x) * (sin * scaling)


def unrotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    """Inverse of `rotate`: the pre-RoPE keys of post-RoPE keys x [..., T, D]."""
    cos, sin = cos_sin(positions, inv_freq)
    return (x * cos - _rotate_half(x) * sin) / scaling


__all__ = ["cos_sin", "rotate", "rotate_with", "unrotate"]
