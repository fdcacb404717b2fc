"""Bit packing of integer codes along the last axis, written in core ATen only.

Why this shape: the same functions run eagerly, inside `torch.compile` (inductor fuses them
into the attention kernel) and inside `torch.export` graphs that ExecuTorch and ONNX must take.
Those runtimes reject bit shifts (`aten.__rshift__`) and `torch.tensor` constants, so powers of
two are built in-graph and unpacking is float arithmetic that is exact on small integers.

Layout (planar): a row of n codes is cut into `values_per_word` planes of P = n / values_per_word
consecutive codes; word j holds code j of every plane, plane i in bits [i*bits, (i+1)*bits).
2, 4 and 8 bits: word j is byte j (4, 2, 1 planes). 3 bits: 8 planes, 24-bit words stored as
three byte planes (bytes j, P + j, 2P + j are word j's low, middle and high byte), so 3 bits are
really 3 bits. Why planar and not consecutive codes per word: code d then comes from byte d % P
at a shift chosen by d // P, both affine in d within a plane, so inductor vectorizes the unpack
along the head dimension (consecutive codes per word need a gather per element; measured 4-15x
slower for the fused decode attention on CPU).
"""

from __future__ import annotations

import torch

from kvq_ao.format import PACKED_BITS, word_layout

SUPPORTED_BITS = PACKED_BITS  # the name the config and tests use


def packed_size(n: int, bits: int) -> int:
    """Bytes needed for `n` codes of `bits` bits along the packed axis."""
    values, nbytes = word_layout(bits)
    if n % values:
        raise ValueError(f"{bits}-bit packing needs the packed axis to be a multiple of {values}, got {n}")
    return n // values * nbytes


def _powers_of_two(count: int, step: int, device: torch.device) -> torch.Tensor:
    """[2**0, 2**step, ...] as int32, built in-graph (no tensor constants)."""
    exponents = torch.arange(0, count * step, step, device=device, dtype=torch.int32)
    return torch.pow(2, exponents).to(torch.int32)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in [0, 2**bits) along the last axis into uint8 (planar layout, see above)."""
    values, nbytes = word_layout(bits)
    *lead, n = codes.shape
    packed_size(n, bits)  # validates divisibility
    if bits == 8:
        return codes.to(torch.uint8)
    planes = codes.to(torch.int32).reshape(*lead, values, n // values)
    weights = _powers_of_two(values, bits, codes.device).unsqueeze(-1)
    word = (planes * weights).sum(-2, dtype=torch.int32)  # [..., P]
    if nbytes == 1:
        return word.to(torch.uint8)
    byte_weights = _powers_of_two(nbytes, 8, codes.device).unsqueeze(-1)
    byte_planes = torch.div(word.unsqueeze(-2), byte_weights, rounding_mode="floor") & 255  # [..., 3, P]
    return byte_planes.to(torch.uint8).reshape(*lead, nbytes * (n // values))


def unpack_float(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack` as float32 codes (exact: words stay below 2**24): [..., n*bits/8] -> [..., n].

    Float, because dequantization multiplies the codes by a float scale next anyway, and floor and
    multiply by powers of two vectorize where integer division by a per-element divisor does not.
    """
    values, nbytes = word_layout(bits)
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8, got {packed.dtype}")
    x = packed.to(torch.float32)
    if bits == 8:
        return x
    *lead, m = packed.shape
    words_per_row = m // nbytes
    if nbytes == 1:
        word = x
    else:
        byte_weights = _powers_of_two(nbytes, 8, packed.device).to(torch.float32).unsqueeze(-1)
        word = (x.reshape(*lead, nbytes, words_per_row) * byte_weights).sum(-2)
    # integer powers (exact), then an exact float division: a float pow may be approximated when vectorized
    plane_weights = _powers_of_two(values, bits, packed.device).to(torch.float32).unsqueeze(-1)
    shifted = torch.floor(word.unsqueeze(-2) / plane_weights)  # [..., planes, P]: word >> (i * bits)
    codes = shifted - 2.0**bits * torch.floor(shifted * 2.0**-bits)  # & (2**bits - 1)
    return codes.reshape(*lead, values * words_per_row)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack`: uint8 [..., n*bits/8] -> uint8 codes [..., n]."""
    if bits == 8 and packed.dtype == torch.uint8:
        return packed
    return unpack_float(packed, bits).to(torch.uint8)


__all__ = ["pack", "packed_size", "unpack", "unpack_float", "word_layout", "SUPPORTED_BITS"]
