"""The kvq ops: opcheck, and attention against a float64 reference on fresh random data."""

import pytest
import torch

import kvq_ao.ops  # noqa: F401
from kvq_ao.kernels import composite
from kvq_ao.quant.codebook import nf_codebook
from kvq_ao.quant.uniform import AXIS_CHANNEL, AXIS_TOKEN

from attention_cases import ORDER, attention_case, reference_attention


@pytest.mark.parametrize("tq", [1, 7])
@pytest.mark.parametrize("bits", [(4, 4), (2, 3), (8, 8), (0, 2), (3, 0)])
@pytest.mark.parametrize("head_mask", [False, True])
@pytest.mark.parametrize("kind", ["int", "nf+outliers+pre-rope", "softcap"])
def test_attention_matches_float64_reference(tq, bits, head_mask, kind):
    extra = {"int": {}, "nf+outliers+pre-rope": dict(codebook=True, outliers=2, pre_rope=True),
             # a cap of 1.5 is below typical |logits| here, so capping changes the result
             "softcap": dict(softcap=1.5)}[kind]  # fmt: skip
    for seed in range(3):
        args = attention_case(seed, tq, *bits, head_mask=head_mask, **extra)
        out = torch.ops.kvq.attention(*args)
        ref = reference_attention(args)
        assert out.shape == ref.shape and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("target", composite.TARGETS)
@pytest.mark.parametrize("tq", [1, 7])
def test_every_form_of_the_composite_attention_matches_float64_reference(target, tq):
    """The eager op runs the "eager" form; inductor and export get the other two as decompositions.
    Each is checked here directly (the compile and export tests check them in their graphs)."""
    for seed in range(2):
        for softcap in (0.0, 2.0):
            args = attention_case(seed, tq, 3, 4, codebook=True, outliers=2, pre_rope=True, head_mask=True, softcap=softcap)
            out = composite.attention(*args, target=target)
            torch.testing.assert_close(out.double(), reference_attention(args), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="target must be one of"):
        composite.attention(*args, target="mps")


def test_softcap_changes_the_result_and_is_checked():
    """The capped cases above would pass vacuously if capping did nothing at their logits."""
    plain, capped = attention_case(0, 1), attention_case(0, 1, softcap=1.5)
    assert not torch.allclose(torch.ops.kvq.attention(*plain), torch.ops.kvq.attention(*capped), atol=1e-3)
    bad = list(capped)
    bad[ORDER.index("softcap")] = -1.0
    with pytest.raises(ValueError, match="softcap must be >= 0"):
        torch.ops.kvq.attention(*bad)


def test_query_with_nothing_to_attend_returns_zeros():
    args = list(attention_case(0, 1))
    args[ORDER.index("mask")] = torch.zeros_like(args[ORDER.index("mask")])  # nothing visible
    args[ORDER.index("side_pos")] = torch.full_like(args[ORDER.index("side_pos")], -1)  # no side entries
    assert torch.equal(torch.ops.kvq.attention(*args), torch.zeros(2, 6, 1, 32))


@pytest.mark.parametrize("tq", [1, 5])
@pytest.mark.parametrize("extra", [{}, dict(codebook=True, outliers=1, pre_rope=True), dict(softcap=3.0)],
                         ids=["int", "kvquant", "softcap"])  # fmt: skip
def test_opcheck_attention(tq, extra):
    torch.library.opcheck(torch.ops.kvq.attention.default, attention_case(1, tq, **extra))


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
    args = list(attention_case(0, 1))
    args[0] = torch.randn(2, 5, 1, 32)
    with pytest.raises(ValueError, match="5 query heads is not a multiple of 2"):
        torch.ops.kvq.attention(*args)
    args = list(attention_case(0, 1))
    args[ORDER.index("mask")] = args[ORDER.index("mask")].float()
    with pytest.raises(ValueError, match="mask must be a 4-D bool tensor"):
        torch.ops.kvq.attention(*args)
    args = list(attention_case(0, 1))
    args[ORDER.index("rope_inv_freq")] = torch.ones(5)
    with pytest.raises(ValueError, match="rope_inv_freq must be empty or head_dim/2"):
        torch.ops.kvq.attention(*args)
