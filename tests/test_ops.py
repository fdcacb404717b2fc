"""The kvq ops: opcheck, and attention against a float64 reference on fresh random data."""

import pytest
import torch

import kvq_ao.ops  # noqa: F401
from kvq_ao.quant.uniform import AXIS_CHANNEL, AXIS_TOKEN


def _quantized(x, bits, axis, group):
    if bits == 0:
        return x.clone(), torch.zeros(0, dtype=torch.float16), torch.zeros(0, dtype=torch.float16)
    return torch.ops.kvq.quantize(x, bits, axis, group, torch.float16)


def _case(seed, tq, bits_k=4, bits_v=4, k_axis=AXIS_CHANNEL, v_axis=AXIS_TOKEN, hq=6, hkv=2, t=64, d=32, n_side=5,
          body_start=1, body_end=40, head_mask=False):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hq, tq, d, generator=g)
    k = torch.randn(2, hkv, t, d, generator=g) * 2
    v = torch.randn(2, hkv, t, d, generator=g)
    kq, vq = _quantized(k, bits_k, k_axis, 16), _quantized(v, bits_v, v_axis, 16)
    side_k = torch.randn(2, hkv, n_side, d, generator=g)
    side_v = torch.randn(2, hkv, n_side, d, generator=g)
    # sink at position 0, window positions 40..42, one empty slot
    side_pos = torch.tensor([0, 40, 41, 42, -1])
    total = 43
    q_pos = torch.arange(total - tq, total)
    mask = (torch.arange(t)[None, :] <= q_pos[:, None]).expand(2, hq if head_mask else 1, tq, t).clone()
    if head_mask:
        mask[:, 1, :, 5:9] = False
    args = (q, *kq, *vq, side_k, side_v, side_pos, torch.tensor(body_end), mask, body_start, d**-0.5,
            bits_k, k_axis, 16, bits_v, v_axis, 16)  # fmt: skip
    return args


def _reference(args):
    """float64: build logical K/V (body in [start, end), side elsewhere) and do softmax attention."""
    (q, kc, ks, kz, vc, vs, vz, side_k, side_v, side_pos, body_end, mask, body_start, scaling,
     kb, ka, kg, vb, va, vg) = args  # fmt: skip
    k = torch.ops.kvq.dequantize(kc, ks, kz, kb, ka, kg, torch.float64)
    v = torch.ops.kvq.dequantize(vc, vs, vz, vb, va, vg, torch.float64)
    t = k.shape[2]
    valid = torch.zeros(t, dtype=torch.bool)
    valid[body_start : int(body_end)] = True
    for i, p in enumerate(side_pos.tolist()):
        if p >= 0 and not (body_start <= p < int(body_end)):
            k[:, :, p], v[:, :, p] = side_k[:, :, i].double(), side_v[:, :, i].double()
            valid[p] = True
    n = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n, 1), v.repeat_interleave(n, 1)
    scores = (q.double() @ k.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~(mask & valid), float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("tq", [1, 7])
@pytest.mark.parametrize("bits", [(4, 4), (2, 3), (8, 8), (0, 2), (3, 0)])
@pytest.mark.parametrize("head_mask", [False, True])
def test_attention_matches_float64_reference(tq, bits, head_mask):
    for seed in range(3):
        args = _case(seed, tq, *bits, head_mask=head_mask)
        out = torch.ops.kvq.attention(*args)
        ref = _reference(args)
        assert out.shape == ref.shape and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_query_with_nothing_to_attend_returns_zeros():
    args = list(_case(0, 1))
    args[11] = torch.zeros_like(args[11])  # mask: nothing visible
    args[9] = torch.full_like(args[9], -1)  # no side entries
    assert torch.equal(torch.ops.kvq.attention(*args), torch.zeros(2, 6, 1, 32))


@pytest.mark.parametrize("tq", [1, 5])
def test_opcheck_attention(tq):
    torch.library.opcheck(torch.ops.kvq.attention.default, _case(1, tq))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("axis", [AXIS_TOKEN, AXIS_CHANNEL])
def test_opcheck_quantize_and_dequantize(bits, axis):
    x = torch.randn(1, 2, 32, 64)
    torch.library.opcheck(torch.ops.kvq.quantize.default, (x, bits, axis, 16, torch.float16))
    codes, scale, zero = torch.ops.kvq.quantize(x, bits, axis, 16, torch.float16)
    torch.library.opcheck(torch.ops.kvq.dequantize.default, (codes, scale, zero, bits, axis, 16, torch.float32))


def test_ops_reject_bad_arguments_with_clear_errors():
    x = torch.randn(1, 1, 32, 64)
    with pytest.raises(ValueError, match="bits must be one of"):
        torch.ops.kvq.quantize(x, 5, AXIS_TOKEN, 16, torch.float16)
    with pytest.raises(ValueError, match="does not divide head_dim"):
        torch.ops.kvq.quantize(x, 4, AXIS_TOKEN, 24, torch.float16)
    with pytest.raises(ValueError, match="whole blocks of 48 tokens"):
        torch.ops.kvq.quantize(x, 4, AXIS_CHANNEL, 48, torch.float16)
    args = list(_case(0, 1))
    args[0] = torch.randn(2, 5, 1, 32)
    with pytest.raises(ValueError, match="5 query heads is not a multiple of 2"):
        torch.ops.kvq.attention(*args)
    args = list(_case(0, 1))
    args[11] = args[11].float()
    with pytest.raises(ValueError, match="mask must be a 4-D bool tensor"):
        torch.ops.kvq.attention(*args)
