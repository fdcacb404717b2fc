"""Streaming multi-token attention (`kvq.chunk_attention`) and key-position bounds masks.

The streaming kernel is checked against the float64 reference on random data for every format,
causal / sliding-window / left-padded masks given as bounds or dense, chunk sizes 1-512 and
block sizes that cut the body into many pieces; the bounds are checked against the dense masks
transformers builds.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.masking_utils import (
    causal_mask_function,
    chunked_causal_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)

from attention_cases import STREAM_FORMATS as FORMATS
from attention_cases import expected_streaming as expected
from attention_cases import attend, op_args, streaming_case
from kvq_ao import masks
from kvq_ao.kernels.reference import streaming_attention
from kvq_ao.ops import reference_arguments
from kvq_ao.format import AXIS_TOKEN

@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    tq=st.sampled_from([1, 2, 5, 16, 33]),
    k_fmt=st.sampled_from(FORMATS),
    v_fmt=st.sampled_from([f for f in FORMATS if f[0] == 0 or f[1] == AXIS_TOKEN or f[3] == 0]),
    block=st.sampled_from([16, 32, 48, 1024]),
    window=st.sampled_from([None, 1, 9, 30]),
    pad=st.sampled_from([(0, 0), (0, 3), (20, 0)]),
    pre_rope=st.booleans(),
    softcap=st.sampled_from([0.0, 5.0]),
    gqa=st.sampled_from([(2, 2), (6, 2), (8, 1)]),
    per_query=st.booleans(),
    tile=st.sampled_from([1, 4, 256]),
)
def test_streaming_attention_matches_the_float64_reference(seed, tq, k_fmt, v_fmt, block, window, pad, pre_rope, softcap, gqa,
                                                           per_query, tile):  # fmt: skip
    named = streaming_case(seed, tq, k_fmt, v_fmt, hq=gqa[0], hkv=gqa[1], window=window, pad=pad, pre_rope=pre_rope,
                           softcap=softcap, per_query=per_query)  # fmt: skip
    got = streaming_attention(**reference_arguments(named), block=block, tile=tile)
    torch.testing.assert_close(got.double(), expected(named), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("tq", [1, 64, 512])
@pytest.mark.parametrize("fmt", [FORMATS[1], FORMATS[2], FORMATS[7]])  # FORMATS[7]: calibrated key ranges
def test_chunks_up_to_512_queries_over_many_blocks(tq, fmt):
    named = streaming_case(3, tq, fmt, FORMATS[3], length=tq + 700, pre_rope=fmt[2], window=300 if tq == 64 else None)
    got = attend(named, torch.ops.kvq.chunk_attention)  # the op, as the model calls it
    torch.testing.assert_close(got.double(), expected(named), rtol=2e-5, atol=2e-5)
    small_blocks = streaming_attention(**reference_arguments(named), block=64, tile=48)
    torch.testing.assert_close(small_blocks, got, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("target", ["export", "inductor"])
def test_per_query_body_ends_in_the_dense_reference_forms(target):
    from kvq_ao.ops import run_reference

    named = streaming_case(4, 24, FORMATS[2], FORMATS[3], per_query=True, pre_rope=True, residual=20)
    assert named["body_end"].unique().numel() > 1
    torch.testing.assert_close(run_reference((), op_args(named), target=target).double(), expected(named), rtol=2e-5, atol=2e-5)


def test_dense_and_bounds_masks_give_the_same_result():
    named = streaming_case(5, 9, FORMATS[2], FORMATS[4], window=12, pad=(0, 4))
    dense = dict(named, mask=masks.dense(named["mask"], named["k"].codes.shape[2]))
    torch.testing.assert_close(attend(dense, torch.ops.kvq.chunk_attention), attend(named, torch.ops.kvq.chunk_attention))


def test_a_fully_padded_query_gets_zeros():
    named = streaming_case(7, 4, FORMATS[1], FORMATS[3], pad=(0, 60), length=50)  # row 1 is all padding
    out = attend(named, torch.ops.kvq.chunk_attention)
    assert out[1].abs().max() == 0 and out[0].abs().min() > 0


def test_bad_bounds_are_refused_by_name():
    named = streaming_case(1, 4, FORMATS[1], FORMATS[3])
    with pytest.raises(ValueError, match=r"int64 mask bounds must be \[batch, 1, q_len, 2\]"):
        attend(dict(named, mask=named["mask"][:, :, :2]), torch.ops.kvq.chunk_attention)
    one = streaming_case(1, 1, FORMATS[1], FORMATS[3])
    with pytest.raises(ValueError, match="mask must be (a 4-D )?bool"):  # decode takes the dense mask only
        attend(one, torch.ops.kvq.decode_attention)


def test_opcheck_chunk_attention_with_bounds():
    named = streaming_case(2, 8, FORMATS[2], FORMATS[3], window=10, pre_rope=True)
    torch.library.opcheck(torch.ops.kvq.chunk_attention.default, (), op_args(named))


# --------------------------------------------------------------------------- bounds from transformers' arguments
@pytest.mark.parametrize("window", [None, 5, 64])
@pytest.mark.parametrize("padding", [None, [0, 3], [7, 0]])
@pytest.mark.parametrize("q_offset,q_length", [(0, 17), (40, 9), (100, 2)])
def test_interval_bounds_equal_transformers_dense_masks(window, padding, q_offset, q_length):
    batch, kv_length = 2, 160
    attention_mask = None
    if padding is not None:
        attention_mask = torch.ones(batch, q_offset + q_length, dtype=torch.long)
        for row, p in enumerate(padding):
            attention_mask[row, :p] = 0
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    bounds = masks.interval_bounds(batch, q_length, q_offset, 0, fn, attention_mask, window, "cpu")
    assert bounds is not None
    want = sdpa_mask(batch_size=batch, q_length=q_length, kv_length=kv_length, q_offset=q_offset, mask_function=fn,
                     attention_mask=attention_mask, allow_is_causal_skip=False, local_size=window)  # fmt: skip
    assert torch.equal(masks.dense(bounds, kv_length), want.expand(batch, 1, q_length, kv_length))


def test_masks_that_are_not_intervals_get_no_bounds():
    holes = torch.ones(1, 20, dtype=torch.long)
    holes[0, 5] = 0  # padding in the middle of a row: not left padding
    assert masks.interval_bounds(1, 4, 16, 0, causal_mask_function, holes, None, "cpu") is None
    chunked = chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))
    assert masks.interval_bounds(1, 8, 8, 0, chunked, None, 4, "cpu") is None
