"""The kvq ops: opcheck, and attention against a float64 reference on fresh random data."""

import pytest
import torch

import kvq_ao.ops  # noqa: F401
from kernels import composite
from kvq_ao.quant.codebook import nf_codebook
from kvq_ao.quant.uniform import AXIS_CHANNEL, AXIS_TOKEN


ORDER = ("q", "k_codes", "k_scale", "k_zero", "k_codebook", "k_out_val", "k_out_idx", "v_codes", "v_scale", "v_zero",
         "v_codebook", "v_out_val", "v_out_idx", "side_k", "side_v", "side_pos", "body_end", "mask", "rope_inv_freq",
         "body_start", "scaling", "rope_scale", "k_bits", "k_axis", "k_group", "v_bits", "v_axis", "v_group")  # fmt: skip


def op_args(named: dict) -> tuple:
    """The kvq.attention argument tuple from named arguments."""
    return tuple(named[n] for n in ORDER)


def _quantized(x, bits, axis, group, codebook=None, outliers=0, g=None):
    """(codes, scale, zero, codebook, out_val, out_idx) of x in one format (bits 0: float)."""
    empty = torch.zeros(0)
    if bits == 0:
        return (x.clone(), torch.zeros(0, dtype=torch.float16), torch.zeros(0, dtype=torch.float16), empty,
                x.new_zeros(*x.shape[:-1], 0), x.new_zeros(*x.shape[:-1], 0, dtype=torch.uint8))  # fmt: skip
    cb = empty if codebook is None else codebook
    lo = hi = empty
    if outliers:  # thresholds that make a few entries per vector outliers
        lo = -1.5 * torch.ones(x.shape[1], x.shape[-1])
        hi = 1.5 * torch.ones(x.shape[1], x.shape[-1])
    codes, scale, zero, out_val, out_idx, _ = torch.ops.kvq.quantize(x, bits, axis, group, torch.float16, cb, lo, hi, outliers)
    return codes, scale, zero, cb, out_val, out_idx


def _case(seed, tq, bits_k=4, bits_v=4, k_axis=AXIS_CHANNEL, v_axis=AXIS_TOKEN, hq=6, hkv=2, t=64, d=32, n_side=5,
          body_start=1, body_end=40, head_mask=False, codebook=False, outliers=0, pre_rope=False):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hq, tq, d, generator=g)
    k = torch.randn(2, hkv, t, d, generator=g) * 2
    v = torch.randn(2, hkv, t, d, generator=g)
    cb_k = nf_codebook(bits_k) if codebook and bits_k in (2, 3, 4) else None
    cb_v = nf_codebook(bits_v) if codebook and bits_v in (2, 3, 4) else None
    kq = _quantized(k, bits_k, k_axis, 16, cb_k, outliers)
    vq = _quantized(v, bits_v, v_axis, 16, cb_v, outliers)
    side_k = torch.randn(2, hkv, n_side, d, generator=g)
    side_v = torch.randn(2, hkv, n_side, d, generator=g)
    # sink at position 0, window positions 40..42, one empty slot
    side_pos = torch.tensor([0, 40, 41, 42, -1])
    total = 43
    q_pos = torch.arange(total - tq, total)
    mask = (torch.arange(t)[None, :] <= q_pos[:, None]).expand(2, hq if head_mask else 1, tq, t).clone()
    if head_mask:
        mask[:, 1, :, 5:9] = False
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)) if pre_rope else torch.zeros(0)
    named = dict(q=q, side_k=side_k, side_v=side_v, side_pos=side_pos, body_end=torch.tensor(body_end), mask=mask,
                 rope_inv_freq=inv_freq, body_start=body_start, scaling=d**-0.5, rope_scale=1.25 if pre_rope else 1.0,
                 k_bits=bits_k, k_axis=k_axis, k_group=16, v_bits=bits_v, v_axis=v_axis, v_group=16)  # fmt: skip
    for prefix, parts in (("k", kq), ("v", vq)):
        for name, tensor in zip(("codes", "scale", "zero", "codebook", "out_val", "out_idx"), parts):
            named[f"{prefix}_{name}"] = tensor
    return op_args(named)


def _rotate64(x, positions, inv_freq, scale):
    """RoPE in float64, written out as the rotation of channel pairs (i, i + D/2)."""
    half = x.shape[-1] // 2
    ang = positions.double()[:, None] * inv_freq.double()[None, :]
    c, s = torch.cos(ang) * scale, torch.sin(ang) * scale
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _reference(args):
    """float64: build logical K/V (body in [start, end), side elsewhere) and do softmax attention."""
    a = dict(zip(ORDER, args))
    k = torch.ops.kvq.dequantize(a["k_codes"], a["k_scale"], a["k_zero"], a["k_codebook"], a["k_out_val"],
                                 a["k_out_idx"], a["k_bits"], a["k_axis"], a["k_group"], torch.float64)  # fmt: skip
    v = torch.ops.kvq.dequantize(a["v_codes"], a["v_scale"], a["v_zero"], a["v_codebook"], a["v_out_val"],
                                 a["v_out_idx"], a["v_bits"], a["v_axis"], a["v_group"], torch.float64)  # fmt: skip
    side_k, side_v, side_pos = a["side_k"].double(), a["side_v"].double(), a["side_pos"]
    t = k.shape[2]
    if a["rope_inv_freq"].numel():  # keys stored pre-RoPE: rotate every key at its own position
        k = _rotate64(k, torch.arange(t), a["rope_inv_freq"], a["rope_scale"])
        side_k = _rotate64(side_k, side_pos.clamp(min=0), a["rope_inv_freq"], a["rope_scale"])
    body_start, body_end, q = a["body_start"], int(a["body_end"]), a["q"]
    valid = torch.zeros(t, dtype=torch.bool)
    valid[body_start:body_end] = True
    for i, p in enumerate(side_pos.tolist()):
        if p >= 0 and not (body_start <= p < body_end):
            k[:, :, p], v[:, :, p] = side_k[:, :, i], side_v[:, :, i]
            valid[p] = True
    n = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n, 1), v.repeat_interleave(n, 1)
    scores = (q.double() @ k.transpose(-1, -2)) * a["scaling"]
    scores = scores.masked_fill(~(a["mask"] & valid), float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("tq", [1, 7])
@pytest.mark.parametrize("bits", [(4, 4), (2, 3), (8, 8), (0, 2), (3, 0)])
@pytest.mark.parametrize("head_mask", [False, True])
@pytest.mark.parametrize("kind", ["int", "nf+outliers+pre-rope"])
def test_attention_matches_float64_reference(tq, bits, head_mask, kind):
    extra = dict(codebook=True, outliers=2, pre_rope=True) if kind != "int" else {}
    for seed in range(3):
        args = _case(seed, tq, *bits, head_mask=head_mask, **extra)
        out = torch.ops.kvq.attention(*args)
        ref = _reference(args)
        assert out.shape == ref.shape and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("target", composite.TARGETS)
@pytest.mark.parametrize("tq", [1, 7])
def test_every_form_of_the_composite_attention_matches_float64_reference(target, tq):
    """The eager op runs the "eager" form; inductor and export get the other two as decompositions.
    Each is checked here directly (the compile and export tests check them in their graphs)."""
    for seed in range(2):
        args = _case(seed, tq, 3, 4, codebook=True, outliers=2, pre_rope=True, head_mask=True)
        out = composite.attention(*args, target=target)
        torch.testing.assert_close(out.double(), _reference(args), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="target must be one of"):
        composite.attention(*args, target="mps")


def test_query_with_nothing_to_attend_returns_zeros():
    args = list(_case(0, 1))
    args[ORDER.index("mask")] = torch.zeros_like(args[ORDER.index("mask")])  # nothing visible
    args[ORDER.index("side_pos")] = torch.full_like(args[ORDER.index("side_pos")], -1)  # no side entries
    assert torch.equal(torch.ops.kvq.attention(*args), torch.zeros(2, 6, 1, 32))


@pytest.mark.parametrize("tq", [1, 5])
@pytest.mark.parametrize("extra", [{}, dict(codebook=True, outliers=1, pre_rope=True)], ids=["int", "kvquant"])
def test_opcheck_attention(tq, extra):
    torch.library.opcheck(torch.ops.kvq.attention.default, _case(1, tq, **extra))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("axis", [AXIS_TOKEN, AXIS_CHANNEL])
@pytest.mark.parametrize("kind", ["int", "nf+outliers"])
def test_opcheck_quantize_and_dequantize(bits, axis, kind):
    x = torch.randn(1, 2, 32, 64)
    cb = nf_codebook(bits) if kind != "int" and bits != 8 else torch.zeros(0)
    n_out = 2 if kind != "int" else 0
    lo, hi = (-torch.ones(2, 64), torch.ones(2, 64)) if n_out else (torch.zeros(0), torch.zeros(0))
    args = (x, bits, axis, 16, torch.float16, cb, lo, hi, n_out)
    torch.library.opcheck(torch.ops.kvq.quantize.default, args)
    codes, scale, zero, out_val, out_idx, _ = torch.ops.kvq.quantize(*args)
    torch.library.opcheck(torch.ops.kvq.dequantize.default, (codes, scale, zero, cb, out_val, out_idx, bits, axis, 16, torch.float32))


def test_ops_reject_bad_arguments_with_clear_errors():
    x = torch.randn(1, 1, 32, 64)
    e = torch.zeros(0)

    def quantize(bits, axis, group, cb=e, lo=e, hi=e, n=0):
        return torch.ops.kvq.quantize(x, bits, axis, group, torch.float16, cb, lo, hi, n)

    with pytest.raises(ValueError, match="bits must be one of"):
        quantize(5, AXIS_TOKEN, 16)
    with pytest.raises(ValueError, match="does not divide head_dim"):
        quantize(4, AXIS_TOKEN, 24)
    with pytest.raises(ValueError, match="whole blocks of 48 tokens"):
        quantize(4, AXIS_CHANNEL, 48)
    with pytest.raises(ValueError, match="codebook must hold 2\\*\\*bits levels"):
        quantize(3, AXIS_TOKEN, 16, cb=nf_codebook(2))
    with pytest.raises(ValueError, match="outlier thresholds must be"):
        quantize(3, AXIS_TOKEN, 16, lo=torch.zeros(2, 64), hi=torch.zeros(2, 64), n=1)
    args = list(_case(0, 1))
    args[0] = torch.randn(2, 5, 1, 32)
    with pytest.raises(ValueError, match="5 query heads is not a multiple of 2"):
        torch.ops.kvq.attention(*args)
    args = list(_case(0, 1))
    args[ORDER.index("mask")] = args[ORDER.index("mask")].float()
    with pytest.raises(ValueError, match="mask must be a 4-D bool tensor"):
        torch.ops.kvq.attention(*args)
    args = list(_case(0, 1))
    args[ORDER.index("rope_inv_freq")] = torch.ones(5)
    with pytest.raises(ValueError, match="rope_inv_freq must be empty or head_dim/2"):
        torch.ops.kvq.attention(*args)
