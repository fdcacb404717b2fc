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


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = _freqs(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    return emb.cos(), emb.sin()


def rotated_scores(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                   scaling: float) -> torch.Tensor:  # fmt: skip
    """q [..., n, D] . rotate(k [..., T, D]) -> [..., n, T], without forming the rotated keys.

    With halves q = (q1, q2), k = (k1, k2) and per-frequency angles: q . R k =
    sum_j k1_j (cos_j q1_j + sin_j q2_j) + k2_j (cos_j q2_j - sin_j q1_j), i.e. the query turned
    back by each key's angle. Each half of k is read once and nothing is concatenated, so
    inductor keeps unpack, dequantize and rotation in one loop without a float [T, D] buffer.
    """
    half = k.shape[-1] // 2
    freqs = _freqs(positions, inv_freq)
    cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
    q1, q2 = q[..., :half].unsqueeze(-2), q[..., half:].unsqueeze(-2)  # [..., n, 1, D/2]
    k1, k2 = k[..., :half].unsqueeze(-3), k[..., half:].unsqueeze(-3)  # [..., 1, T, D/2]
    return (k1 * (cos * q1 + sin * q2) + k2 * (cos * q2 - sin * q1)).sum(-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    """RoPE of x [..., T, D] at `positions` [T] (as the model applies it)."""
    cos, sin = _cos_sin(positions, inv_freq)
    return x * (cos * scaling) + _rotate_half(x) * (sin * scaling)


def unrotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    """Inverse of `rotate`: the pre-RoPE keys of post-RoPE keys x [..., T, D]."""
    cos, sin = _cos_sin(positions, inv_freq)
    return (x * cos - _rotate_half(x) * sin) / scaling
