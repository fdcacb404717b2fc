"""Bit packing of integer codes along the last axis, written in core ATen only.

Why this shape: the same functions run eagerly, inside `torch.compile` (inductor fuses them
into the attention kernel) and inside `torch.export` graphs that ExecuTorch and ONNX must take.
Those runtimes reject bit shifts (`aten.__rshift__`) and `torch.tensor` constants, so unpacking
is a floor-divide by powers of two followed by `& mask`, with the powers built in-graph.

Layout: `values_per_word` consecutive codes form one little-endian word of `bytes_per_word`
bytes. 2, 4 and 8 bits pack 4, 2 and 1 codes into one byte; 3 bits pack 8 codes into 3 bytes
(a real 3-bit store, not 3 bits in a nibble).
"""

from __future__ import annotations

import math

import torch

SUPPORTED_BITS = (2, 3, 4, 8)


def word_layout(bits: int) -> tuple[int, int]:
    """Return (values_per_word, bytes_per_word) for a bit width."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    word_bits = math.lcm(bits, 8)
    return word_bits // bits, word_bits // 8


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
    """Pack integer codes in [0, 2**bits) along the last axis into uint8."""
    values, nbytes = word_layout(bits)
    *lead, n = codes.shape
    packed_size(n, bits)  # validates divisibility
    if bits == 8:
        return codes.to(torch.uint8)
    words = codes.to(torch.int32).reshape(*lead, n // values, values)
    word = (words * _powers_of_two(values, bits, codes.device)).sum(-1, dtype=torch.int32)
    if nbytes == 1:
        return word.to(torch.uint8)
    byte_weights = _powers_of_two(nbytes, 8, codes.device)
    out = torch.div(word.unsqueeze(-1), byte_weights, rounding_mode="floor") & 255
    return out.to(torch.uint8).reshape(*lead, n // values * nbytes)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack`: uint8 [..., n*bits/8] -> uint8 codes [..., n]."""
    values, nbytes = word_layout(bits)
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8, got {packed.dtype}")
    if bits == 8:
        return packed
    *lead, m = packed.shape
    if nbytes == 1:
        shifts = torch.pow(2, torch.arange(0, 8, bits, device=packed.device)).to(torch.uint8)
        codes = torch.div(packed.unsqueeze(-1), shifts, rounding_mode="floor") & (2**bits - 1)
        return codes.reshape(*lead, m * values)
    byte_words = packed.to(torch.int32).reshape(*lead, m // nbytes, nbytes)
    word = (byte_words * _powers_of_two(nbytes, 8, packed.device)).sum(-1, dtype=torch.int32)
    codes = torch.div(word.unsqueeze(-1), _powers_of_two(values, bits, packed.device), rounding_mode="floor")
    codes = codes & (2**bits - 1)
    return codes.to(torch.uint8).reshape(*lead, m // nbytes * values)
