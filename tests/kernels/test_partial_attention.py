"""Partial attention over a shard of the cache (context parallelism) and the exact merge of shards.

`kvq::decode_attention_partial` (native on CPU) and `kvq::chunk_attention_partial` (streaming
reference) against the float64 reference with shifted RoPE positions, and a cache cut into shards
at random group-aligned points: the merged shards equal the unsplit ops, for every format.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvq_ao import masks
from kvq_ao.parallel.merge import merge_partials
from kvq_ao.kernels import cpu, reference
from kvq_ao.format import AXIS_CHANNEL, AXIS_TOKEN
from kvq_ao.ops import ATTENTION_FIELDS, filled, reference_arguments

from attention_cases import (FORMATS, STREAM_FORMATS, TOLERANCE, attend, expected_streaming, native_case, op_args,
                             positional, reference_attention, streaming_case)  # fmt: skip

_BODY = ("codes", "scale", "zero", "out_val", "out_idx")


def shard(named: dict, start: int, stop: int) -> dict:
    """The case's cache positions [start, stop) as a cache of their own (arguments of the partial
    ops with position_offset=start): body slices, the mask's columns (or bounds) shifted, body
    bounds clipped, and the side entries whose positions fall in the shard."""
    out = dict(named)
    length = stop - start
    for p in ("k", "v"):
        o = named[p]
        sliced = reference.body_slice(filled(o, named["q"]), start, stop)
        out[p] = o.replace(**{f: None if getattr(o, f) is None else getattr(sliced, f) for f in _BODY})
    mask = named["mask"]
    out["mask"] = (mask - start).clamp(0, length) if masks.is_bounds(mask) else mask[..., start:stop]
    out["body_start"] = min(max(named["body_start"] - start, 0), length)
    out["body_end"] = (named["body_end"] - start).clamp(out["body_start"], length)
    pos = named["side_pos"]
    mine = (pos >= start) & (pos < stop)
    out["side_pos"] = torch.where(mine, pos - start, torch.full_like(pos, -1))
    return out


def cuts(t: int, grid: int, points: list[int]) -> list[int]:
    """Shard boundaries on the group grid: 0, the points rounded down to it, t."""
    inner = sorted({p // grid * grid for p in points if 0 < p // grid * grid < t})
    return [0, *inner, t]


def grid_of(named: dict) -> int:
    groups = [named[p].group for p in ("k", "v") if not named[p].is_float and named[p].axis == AXIS_CHANNEL]
    return max([g for g in groups if g] or [1])


def merged(named: dict, bounds: list[int], decode: bool) -> tuple[torch.Tensor, torch.Tensor]:
    op = torch.ops.kvq.decode_attention_partial if decode else torch.ops.kvq.chunk_attention_partial
    parts = [op(**op_args(shard(named, a, b)), position_offset=a) for a, b in zip(bounds[:-1], bounds[1:])]
    return merge_partials([o for o, _ in parts], [lse for _, lse in parts])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), k_fmt=FORMATS, v_fmt=FORMATS, ratio=st.sampled_from([1, 3]), d=st.sampled_from([64, 128]),
       blocks=st.integers(1, 6), offset=st.sampled_from([0, 5, 96]), pre_rope=st.booleans(), softcap=st.sampled_from([0.0, 2.5]),
       side=st.sampled_from(["empty", "some"]), window=st.sampled_from([0, 9]))  # fmt: skip
def test_native_partial_decode_matches_float64(seed, k_fmt, v_fmt, ratio, d, blocks, offset, pre_rope, softcap, side, window):
    """(out, lse) of the native kernel with RoPE positions shifted by the offset, against float64."""
    body_end = max(1, 16 * blocks - 3 - seed % 9)
    named = native_case(seed, k_fmt=k_fmt, v_fmt=v_fmt, ratio=ratio, d=d, blocks=blocks, body_end=body_end, side=side,
                        window=window, pre_rope=pre_rope, softcap=softcap)  # fmt: skip
    out, lse = torch.ops.kvq.decode_attention_partial(**op_args(named), position_offset=offset)
    want, want_lse = reference_attention(named, position_offset=offset, with_lse=True)
    tol = TOLERANCE[torch.float32]
    assert out.dtype == lse.dtype == torch.float32 and lse.shape == named["q"].shape[:-1]
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), want_lse, rtol=tol, atol=tol)
    # the streaming reference (what other devices run) agrees
    ref_out, ref_lse = reference.streaming_attention(**reference_arguments(named), position_offset=offset, with_lse=True)
    torch.testing.assert_close(ref_out.double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(ref_lse.double(), want_lse, rtol=tol, atol=tol)


def test_partial_decode_is_the_native_kernel_and_checks_its_offset():
    assert cpu.is_loaded() and torch._C._dispatch_has_kernel_for_dispatch_key("kvq::decode_attention_partial", "CPU")
    named = native_case(1)
    with pytest.raises(ValueError, match="position_offset must be >= 0"):
        torch.ops.kvq.decode_attention_partial(**op_args(named), position_offset=-1)


def test_a_shard_that_sees_nothing_has_lse_minus_infinity_and_weighs_nothing():
    named = native_case(2, side="empty")
    named["mask"] = torch.zeros_like(named["mask"])
    out, lse = torch.ops.kvq.decode_attention_partial(**op_args(named))
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())
    full = native_case(2)
    o2, l2 = torch.ops.kvq.decode_attention_partial(**op_args(full))
    mo, ml = merge_partials([out, o2], [lse, l2])
    torch.testing.assert_close(mo, o2, rtol=0, atol=0)
    torch.testing.assert_close(ml, l2, rtol=0, atol=0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), k_fmt=FORMATS, v_fmt=FORMATS, blocks=st.integers(2, 9), pre_rope=st.booleans(),
       points=st.lists(st.integers(1, 150), max_size=3), window=st.sampled_from([0, 21]), left_pad=st.sampled_from([0, 17]))  # fmt: skip
def test_decode_over_shards_merges_to_the_unsplit_op(seed, k_fmt, v_fmt, blocks, pre_rope, points, window, left_pad):
    """A cache cut into 1-4 contiguous shards (sink and window in the shards that hold their
    positions): the merged partials equal the unsplit native op and the float64 reference."""
    named = native_case(seed, k_fmt=k_fmt, v_fmt=v_fmt, blocks=blocks, body_end=16 * blocks - 5, pre_rope=pre_rope,
                        window=window, left_pad=left_pad)  # fmt: skip
    t = named["k"].codes.shape[2]
    out, _ = merged(named, cuts(t, grid_of(named), points), decode=True)
    whole = attend(named, torch.ops.kvq.decode_attention)
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), reference_attention(named), rtol=2e-5, atol=2e-5)


def test_shards_far_into_a_long_cache_rotate_at_their_true_positions():
    """Shards starting near 2^17: float32 RoPE angles of offset + index are the unsplit op's angles
    of the same positions (the float64 reference takes exact angles, too far off out here)."""
    named = native_case(4, hkv=1, ratio=3, batch=1, blocks=2**13, k_fmt=(4, AXIS_CHANNEL, 16, False, 1), pre_rope=True)
    t = named["k"].codes.shape[2]
    out, _ = merged(named, [0, t // 2, t - 64, t], decode=True)
    torch.testing.assert_close(out, attend(named, torch.ops.kvq.decode_attention), rtol=1e-5, atol=1e-5)
    shifted = shard(named, t // 2, t)
    wrong, _ = torch.ops.kvq.decode_attention_partial(**op_args(shifted))  # no offset: rotated at the wrong positions
    right, _ = torch.ops.kvq.decode_attention_partial(**op_args(shifted), position_offset=t // 2)
    assert not torch.allclose(wrong, right, atol=1e-3)


@pytest.mark.parametrize("k_fmt, v_fmt", list(zip(STREAM_FORMATS, STREAM_FORMATS[3:] + STREAM_FORMATS[:3])))
@pytest.mark.parametrize("tq, per_query, window", [(1, False, None), (37, True, None), (64, True, 30)])
def test_chunk_over_shards_merges_to_the_unsplit_op(k_fmt, v_fmt, tq, per_query, window):
    """Prefill chunks (per-query body ends, causal and sliding-window bounds) over 3 shards."""
    named = streaming_case(3, tq, k_fmt, v_fmt, length=150, pre_rope=True, per_query=per_query, window=window)
    t = named["k"].codes.shape[2]
    out, lse = merged(named, cuts(t, max(grid_of(named), 16), [48, 112]), decode=False)
    torch.testing.assert_close(out, attend(named, torch.ops.kvq.chunk_attention), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), expected_streaming(named), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("op", ["decode_attention_partial", "chunk_attention_partial"])
def test_opcheck_partial_ops(op):
    if op == "decode_attention_partial":
        named = native_case(3, k_fmt=(3, AXIS_CHANNEL, 16, True, 1), pre_rope=True)
    else:
        named = streaming_case(5, 9, (4, AXIS_CHANNEL, True, 1), (2, AXIS_TOKEN, False, 0), pre_rope=True, per_query=True)
    assert tuple(ATTENTION_FIELDS)[-1] == "softcap"
    torch.library.opcheck(getattr(torch.ops.kvq, op).default, (*positional(named), 7))


def test_merge_partials_refuses_mismatched_inputs():
    with pytest.raises(ValueError, match="one lse per output"):
        merge_partials([torch.zeros(1, 1, 1, 4)], [])


@pytest.mark.parametrize("k_fmt", [(4, AXIS_CHANNEL, 16, False, 0), (3, AXIS_CHANNEL, 16, True, 1)], ids=["k4", "k3-lanes"])
@pytest.mark.parametrize("offset", [100_000, 1_000_000, 1_500_000, 3_000_000])
def test_pre_rope_angles_millions_of_radians_out_match_the_reference(offset, k_fmt):
    """Shards 100k to 3M tokens in, against the reference, which rotates with torch's float32 angles
    as the model does. Below 2^20 radians a tile's cos/sin come from `AngleRuns` (seeds carried over
    ten tiles, the float angles' rounding corrected: without that correction the output is off by
    2.5e-3 at 100k); past it from `angles`, on both sides of 2^21 radians, where its sin/cos switches
    from the float32 FMA reduction to the one in double. 3-bit keys take the tables with a lane a
    token where the build has AVX-512 VBMI (`AngleRuns::fill_lanes`, or `angles` transposed)."""
    named = native_case(5, hkv=1, ratio=3, batch=1, blocks=40, k_fmt=k_fmt, pre_rope=True)
    out, lse = torch.ops.kvq.decode_attention_partial(**op_args(named), position_offset=offset)
    ref, ref_lse = reference.streaming_attention(**reference_arguments(named), position_offset=offset, with_lse=True)
    torch.testing.assert_close(out, ref.to(out.dtype), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse, ref_lse.to(lse.dtype), rtol=1e-4, atol=1e-4)
