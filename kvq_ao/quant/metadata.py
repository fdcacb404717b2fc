"""8-bit scale and zero of per-token groups: the coding `kvq_ao.format` defines, in torch.

At head_dim 64 a float16 scale and zero per vector cost half a bit of every element; one byte each
costs a quarter. The scale is a code on a log grid (16 steps an octave above 2**e, e a format
number) and the zero a fraction z / 256 of the group's range below 0 (format.py's docstring gives
the exact arithmetic). Encoding uses float32 multiplies, subtractions and compares only, no log2
and no division, so the reference, the native and Triton quantizers and an ONNX runtime store the
same bytes.
"""

from __future__ import annotations

import torch

from kvq_ao.format import SCALE_STEPS, ZERO_STEPS, scale_table

_OCTAVE = scale_table()[:SCALE_STEPS]  # float32(2**(i / 16)), i < 16: SCALE_TABLE[16 k + i] = 2**k * _OCTAVE[i]


def scales(exponent: int, device=None, codes: torch.Tensor | None = None) -> torch.Tensor:
    """S[c] = 2**e * SCALE_TABLE[c] (float32, exact) of `codes`, or of all 256 codes.

    Built in the graph from the codes (16 selects of Python floats, times a power of two) rather
    than read from a table tensor: an exported program then holds no constant tensor, and every
    runtime computes the same exact values."""
    c = torch.arange(256, device=device) if codes is None else codes.long()
    within = c % SCALE_STEPS
    fraction = torch.zeros(c.shape, dtype=torch.float32, device=c.device)
    for i, value in enumerate(_OCTAVE):
        fraction = torch.where(within == i, value, fraction)
    return fraction * torch.pow(2.0, (c // SCALE_STEPS).float() + exponent)


def decode(scale_code: torch.Tensor, zero_code: torch.Tensor, levels: int, exponent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) float32 of uint8 codes: scale = S[s], zero = -(scale * float(L * z)) * 2**-8."""
    scale = scales(exponent, codes=scale_code)
    zero = -(scale * (zero_code.float() * levels)) * (1.0 / ZERO_STEPS)
    return scale, zero


def _zero_codes(scale: torch.Tensor, lo: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(z, zero): the smallest z in [0, 255] whose zero lies at or below lo (255 if none), a count
    over the 256 candidates (zero(z) falls as z grows)."""
    steps = torch.arange(ZERO_STEPS, device=scale.device).float() * levels
    candidates = -(scale.unsqueeze(-1) * steps) * (1.0 / ZERO_STEPS)
    z = (candidates > lo.unsqueeze(-1)).sum(-1).clamp(max=ZERO_STEPS - 1)
    zero = -(scale * (z.float() * levels)) * (1.0 / ZERO_STEPS)
    return z, zero


def encode_range(lo: torch.Tensor, hi: torch.Tensor, levels: int, exponent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 (scale code, zero code) of groups with minimum lo and maximum hi (float32, any shape),
    by format.py's rule: the range widened to contain 0, the smallest scale code from c0 on (at
    most two steps up) whose stored range covers it."""
    lo, hi = lo.float().clamp(max=0.0), hi.float().clamp(min=0.0)
    table = scales(exponent, lo.device)
    scaled = table * levels  # fl(S[c] * L)
    c0 = (scaled < (hi - lo).unsqueeze(-1)).sum(-1)
    chosen = None
    for step in (2, 1, 0):  # the first covering of c0, c0 + 1, c0 + 2, else the last: picked from the top down
        c = (c0 + step).clamp(max=255)
        scale = table[c]
        z, zero = _zero_codes(scale, lo, levels)
        covers = (zero <= lo) & (zero + scaled[c] >= hi)
        chosen = (c, z) if chosen is None else (torch.where(covers, c, chosen[0]), torch.where(covers, z, chosen[1]))
    return chosen[0].to(torch.uint8), chosen[1].to(torch.uint8)


def group_range8(g: torch.Tensor, dim: int, levels: int, exponent: int):
    """(zero, scale) float32 as stored (decoded) and (zero code, scale code) uint8 of each group of g
    along `dim` (kept): what a quantizer codes the group against, and what it stores."""
    s, z = encode_range(g.amin(dim=dim, keepdim=True), g.amax(dim=dim, keepdim=True), levels, exponent)
    scale, zero = decode(s, z, levels, exponent)
    return zero, scale, z, s


__all__ = ["decode", "encode_range", "group_range8", "scales"]
