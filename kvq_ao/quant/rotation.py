"""Orthogonal rotations of head_dim, applied to keys or values before they are quantized.

A rotated vector x R (R orthogonal) has the same dot products as x once the query is rotated the
same way: (q R)(k R)^T = q k^T; and a weighted sum of rotated values, rotated back, is the weighted
sum of the values: (P V R) R^T = P V. So the cache stores rotated keys and values, attention reads
them with a rotated query and rotates its output back, and no kernel changes: the rotation is two
[*, D] x [D, D] products a token outside the kernels.

Why rotate: a key's energy sits in a few channels (outliers, the channels RoPE leaves slow); a
random rotation spreads it over all D channels, so the coordinates of a rotated vector look like
samples of one Gaussian whose spread is the vector's norm / sqrt(D) (QuaRot, SpinQuant,
TurboQuant, llama.cpp's rotated caches). A per-vector range then fits every coordinate, and no
outlier slots or per-channel metadata are needed to keep the few large channels.

The rotation is a randomized Hadamard matrix, H diag(s) / sqrt(D) with fixed random signs s, where
D is a power of two (Sylvester's construction), else a random orthogonal matrix from the QR of a
Gaussian matrix; both drawn from a fixed seed, so a cache, its calibration and an exported program
agree on it without storing it.
"""

from __future__ import annotations

import functools

import torch

ROTATIONS = ("none", "hadamard")
SEED = 0x5EED


@functools.lru_cache(maxsize=32)
def _matrix(head_dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED + head_dim)
    if head_dim > 0 and head_dim & (head_dim - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < head_dim:  # Sylvester: [[H, H], [H, -H]]
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (head_dim,), generator=g).to(torch.float64) * 2 - 1
        r = signs[:, None] * h / head_dim**0.5
    else:
        q, upper = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64))
        r = q * torch.sign(torch.diagonal(upper))[None, :]  # the sign fix makes QR's Q Haar-distributed
    return r.to(torch.float32)


@functools.lru_cache(maxsize=32)
def _on(head_dim: int, device: torch.device) -> torch.Tensor:
    return _matrix(head_dim).to(device)


def rotation_matrix(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The [head_dim, head_dim] float32 orthogonal matrix R that keys and values are rotated by
    (x -> x R): randomized Hadamard for power-of-two head_dims, random orthogonal otherwise. One
    tensor per head_dim and device, shared by every layer (read-only)."""
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 2:
        raise ValueError(f"a rotation needs a head_dim >= 2, got {head_dim!r}")
    return _on(head_dim, torch.device(device))


def rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x [..., D] rotated: x R, computed in float32 (or x's wider dtype), returned in x's dtype."""
    wide = torch.promote_types(x.dtype, torch.float32)
    return (x.to(wide) @ r.to(wide)).to(x.dtype)


def unrotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x [..., D] rotated back: x R^T (R is orthogonal), computed as `rotate`."""
    wide = torch.promote_types(x.dtype, torch.float32)
    return (x.to(wide) @ r.to(wide).T).to(x.dtype)


__all__ = ["ROTATIONS", "rotate", "rotation_matrix", "unrotate"]
