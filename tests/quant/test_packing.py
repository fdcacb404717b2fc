"""Bit packing and uniform quantization: property tests (hypothesis) against exact references."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq_ao.quant.packing import pack, packed_size, unpack
from kvq_ao.quant.uniform import AXIS_CHANNEL, AXIS_TOKEN, dequantize_uniform, quantize_uniform

BITS = [2, 3, 4, 8]


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from(BITS), lead=st.lists(st.integers(1, 4), min_size=0, max_size=3),
       words=st.integers(1, 16), seed=st.integers(0, 2**31 - 1))  # fmt: skip
def test_pack_unpack_is_lossless(bits, lead, words, seed):
    n = words * (8 if bits == 3 else 8 // bits)
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (*lead, n), generator=g, dtype=torch.int64).to(torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape[-1] == n * bits // 8  # really packed, 3-bit included
    assert torch.equal(unpack(packed, bits), codes)


def test_three_bit_layout_matches_hand_computed_planar_words():
    # 16 codes = 8 planes of P = 2: word j holds codes j, 2 + j, 4 + j, ... at shifts 0, 3, 6, ...;
    # its three bytes sit at j, P + j and 2P + j.
    codes = torch.tensor([5, 1, 7, 0, 2, 6, 3, 3, 4, 1, 0, 7, 6, 2, 1, 5], dtype=torch.uint8)
    words = [sum(int(codes[2 * i + j]) << (3 * i) for i in range(8)) for j in range(2)]
    expected = [(w >> (8 * b)) & 255 for b in range(3) for w in words]
    assert torch.equal(pack(codes, 3), torch.tensor(expected, dtype=torch.uint8))


@pytest.mark.parametrize("bits", [2, 4])
def test_byte_layout_matches_hand_computed_planar_bytes(bits):
    # 8 codes in 8 / bits planes of P codes: byte j holds code i*P + j at shift i*bits.
    codes = torch.tensor([3, 0, 2, 1, 1, 3, 0, 2], dtype=torch.uint8)
    values = 8 // bits
    p = 8 // values
    expected = [sum(int(codes[i * p + j]) << (bits * i) for i in range(values)) for j in range(p)]
    assert torch.equal(pack(codes, bits), torch.tensor(expected, dtype=torch.uint8))


def test_packing_rejects_bad_widths_and_lengths():
    with pytest.raises(ValueError, match="bits must be one of"):
        pack(torch.zeros(8, dtype=torch.uint8), 5)
    with pytest.raises(ValueError, match="multiple of 8"):
        packed_size(12, 3)


def _half_step(scale: torch.Tensor, axis: int, group: int, shape) -> torch.Tensor:
    s = scale.double() / 2
    if axis == AXIS_TOKEN:
        return s.repeat_interleave(group, dim=-1).reshape(shape)
    return s.repeat_interleave(group, dim=-2).reshape(shape)


@settings(max_examples=80, deadline=None)
@given(
    bits=st.sampled_from(BITS),
    axis=st.sampled_from([AXIS_TOKEN, AXIS_CHANNEL]),
    group=st.sampled_from([8, 16, 32]),
    blocks=st.integers(1, 4),
    heads=st.integers(1, 3),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    scale_dtype=st.sampled_from([torch.float16, torch.float32]),
    magnitude=st.sampled_from([1e-3, 1.0, 30.0]),
    constant_groups=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_quantize_dequantize_error_is_at_most_half_a_step(bits, axis, group, blocks, heads, dtype, scale_dtype,
                                                          magnitude, constant_groups, seed):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    t, d = (blocks * group, 32) if axis == AXIS_CHANNEL else (blocks * 3, group * 2)
    x = (torch.randn(1, heads, t, d, generator=g) * magnitude).to(dtype)
    if constant_groups:  # whole tensor constant within every group: zero range
        x = torch.full_like(x, 0.37 * magnitude)
    packed, scale, zero = quantize_uniform(x, bits, axis, group, scale_dtype)
    y = dequantize_uniform(packed, scale, zero, bits, axis, group, torch.float32)
    assert torch.isfinite(y).all() and torch.isfinite(scale.float()).all()
    err = (x.double() - y.double()).abs()
    # half a step of the stored scale, plus float32 rounding of code * scale + zero (relative to the data range)
    bound = _half_step(scale, axis, group, x.shape) + 4e-7 * x.double().abs().max() + 1e-12
    assert (err <= bound).all(), float((err - bound).max())
    representable = torch.equal(x.to(scale_dtype).double(), x.double())
    if constant_groups and representable:  # a constant the metadata can hold is reproduced exactly
        assert torch.equal(y.double(), x.double())


def test_group_must_divide_head_dim():
    with pytest.raises(ValueError, match="does not divide head_dim"):
        quantize_uniform(torch.randn(1, 1, 4, 48), 4, AXIS_TOKEN, 32)
