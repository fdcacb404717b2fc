"""8-bit scale and zero (kvq_ao.quant.metadata, the coding kvq_ao/format.py defines), checked in
float64 against what the format promises: the stored range covers each group, the scale is the
smallest grid step that does (within the rule's two extra steps), codes outside the span clamp."""

import pytest
import torch

from kvq_ao import format as fmt
from kvq_ao.quant import metadata


@pytest.mark.parametrize("levels,exponent", [(3, -9), (15, -11), (255, -15), (1, -7), (7, 2)])
def test_the_stored_range_covers_each_group_with_the_smallest_scale_that_does(levels, exponent):
    g = torch.Generator().manual_seed(levels)
    n = 4000
    # ranges spread over the codes' span (2**exponent * L .. 2**(exponent + 15.9) * L; a group all above or below 0
    # is widened to 0, up to twice as wide), some all above or below 0
    width = (2.0 ** (exponent + 0.5 + 14 * torch.rand(n, generator=g, dtype=torch.float64))) * levels
    lo = -width * torch.rand(n, generator=g, dtype=torch.float64)
    lo[: n // 10] = torch.rand(n // 10, generator=g, dtype=torch.float64) * width[: n // 10]  # groups above 0
    hi = lo + width
    hi[n // 10 : n // 5] = -torch.rand(n // 10, generator=g, dtype=torch.float64) * width[n // 10 : n // 5]  # groups below 0
    lo, hi = torch.minimum(lo, hi).float(), torch.maximum(lo, hi).float()
    s, z = metadata.encode_range(lo, hi, levels, exponent)
    assert s.dtype == z.dtype == torch.uint8
    scale, zero = metadata.decode(s, z, levels, exponent)
    lo0, hi0 = lo.double().clamp(max=0), hi.double().clamp(min=0)
    assert bool((zero.double() <= lo0).all()), "the zero lies above a group's minimum (or above 0)"
    assert bool((zero.double() + scale.double() * levels >= hi0 * (1 - 1e-6)).all()), "the range stops short of a group's maximum"
    need = (hi0 - lo0) / levels
    # one grid step (2**(1/16)) for the scale's rounding, one for the zero's (z / 256 of the range), float32 slack
    assert bool((scale.double() <= need * 2 ** (2 / 16) * 1.0001 + 2.0**exponent).all()), "a scale is more than two grid steps too large"
    # and the scale a code below would not do: too small for the range, or with its best zero not covering it
    below = metadata.scales(exponent)[(s.long() - 1).clamp(min=0)]
    _, zero_below = metadata._zero_codes(below, lo.clamp(max=0), levels)
    covers = (zero_below.double() <= lo0) & (zero_below.double() + below.double() * levels >= hi0)
    assert bool(((s == 0) | ~covers).all())


def test_groups_outside_the_codes_span_clamp_to_its_ends():
    lo = torch.tensor([-1e-12, -1e9, 0.0])
    hi = torch.tensor([1e-12, 1e9, 0.0])
    s, z = metadata.encode_range(lo, hi, 15, -4)
    assert s.tolist() == [0, 255, 0]  # the smallest scale, the largest (the range clamps), a zero group
    scale, zero = metadata.decode(s, z, 15, -4)
    assert float(scale[0]) == 2.0**-4 and float(zero[2]) == 0.0


def test_the_table_is_two_to_the_sixteenth_steps_in_float32():
    table = torch.tensor(fmt.scale_table(), dtype=torch.float64)
    want = 2.0 ** (torch.arange(256, dtype=torch.float64) / fmt.SCALE_STEPS)
    assert torch.equal(table, want.float().double())  # exactly float32 values, each the nearest to 2**(s/16)


def test_bad_formats_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="exponent must be an int in"):
        fmt.meta_ints(91)
    with pytest.raises(ValueError, match="8-bit metadata .* per-token groups"):
        fmt.check_format(4, fmt.AXIS_CHANNEL, 16, meta=fmt.meta_ints(0))
    with pytest.raises(ValueError, match="8-bit metadata .* per-token groups"):
        fmt.check_format(fmt.FLOAT_BITS, fmt.AXIS_TOKEN, 16, meta=fmt.meta_ints(0))
    with pytest.raises(ValueError, match="meta must be"):
        fmt.check_format(4, fmt.AXIS_TOKEN, 16, meta=255)
