"""The kvq ops: opcheck, and attention against a float64 reference on fresh random data.

Decode attention (one query token) runs the native CPU kernel here (conftest loads it); chunk
attention and the reference's own forms are checked too. tests/kernels/test_native_cpu.py
compares the native kernel with the reference over many more formats and shapes."""

import pytest
import torch

import kvq_ao.ops  # noqa: F401
from kvq_ao.format import Operand, format_ints
from kvq_ao.kernels import reference
from kvq_ao.ops import reference_arguments
from kvq_ao.quant.codebook import nf_codebook
from kvq_ao.quant.uniform import AXIS_CHANNEL, AXIS_TOKEN

from attention_cases import attend, attention_case, map_tensors, positional, reference_attention, with_operand


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
        out = attend(args)
        ref = reference_attention(args)
        assert out.shape == ref.shape and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("target", reference.TARGETS)
@pytest.mark.parametrize("tq", [1, 7])
def test_every_form_of_the_reference_attention_matches_float64_reference(target, tq):
    """The eager op runs the "eager" form; inductor and export get the other two as decompositions.
    Each is checked here directly (the compile and export tests check them in their graphs)."""
    for seed in range(2):
        for softcap in (0.0, 2.0):
            args = attention_case(seed, tq, 3, 4, codebook=True, outliers=2, pre_rope=True, head_mask=True, softcap=softcap)
            out = reference.attention(**reference_arguments(args), target=target)
            torch.testing.assert_close(out.double(), reference_attention(args), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="target must be one of"):
        reference.attention(**reference_arguments(args), target="mps")


def test_softcap_changes_the_result_and_is_checked():
    """The capped cases above would pass vacuously if capping did nothing at their logits."""
    plain, capped = attention_case(0, 1), attention_case(0, 1, softcap=1.5)
    assert not torch.allclose(attend(plain), attend(capped), atol=1e-3)
    for tq in (1, 3):
        with pytest.raises(ValueError, match="softcap must be >= 0"):
            attend(attention_case(0, tq, softcap=-1.0))


def test_query_with_nothing_to_attend_returns_zeros():
    for tq in (1, 3):
        args = attention_case(0, tq)
        args["mask"] = torch.zeros_like(args["mask"])  # nothing visible
        args["side_pos"] = torch.full_like(args["side_pos"], -1)  # no side entries
        assert torch.equal(attend(args), torch.zeros(2, 6, tq, 32))


@pytest.mark.parametrize("tq", [1, 5])
@pytest.mark.parametrize("extra", [{}, dict(codebook=True, outliers=1, pre_rope=True), dict(softcap=3.0)],
                         ids=["int", "kvquant", "softcap"])  # fmt: skip
def test_opcheck_attention(tq, extra):
    op = torch.ops.kvq.decode_attention.default if tq == 1 else torch.ops.kvq.chunk_attention.default
    torch.library.opcheck(op, positional(attention_case(1, tq, **extra)))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("axis", [AXIS_TOKEN, AXIS_CHANNEL])
@pytest.mark.parametrize("kind", ["int", "nf+outliers"])
def test_opcheck_quantize_and_dequantize(bits, axis, kind):
    x = torch.randn(1, 2, 32, 64)
    cb = nf_codebook(bits) if kind != "int" and bits != 8 else torch.zeros(0)
    n_out = 2 if kind != "int" else 0
    lo, hi = (-torch.ones(2, 64), torch.ones(2, 64)) if n_out else (torch.zeros(0), torch.zeros(0))
    args = (x, format_ints(bits, axis, 16), torch.float16, cb, lo, hi, n_out)
    torch.library.opcheck(torch.ops.kvq.quantize.default, args)
    codes, scale, zero, out_val, out_idx, _ = torch.ops.kvq.quantize(*args)
    body = Operand(codes=codes, scale=scale, zero=zero, codebook=cb, out_val=out_val, out_idx=out_idx, side=None, bits=bits,
                   axis=axis, group=16)  # fmt: skip
    torch.library.opcheck(torch.ops.kvq.dequantize.default, (*body.lists(), torch.float32))


def test_ops_reject_bad_arguments_with_clear_errors():
    x = torch.randn(1, 1, 32, 64)
    e = torch.zeros(0)

    def quantize(bits, axis, group, cb=e, lo=e, hi=e, n=0):
        return torch.ops.kvq.quantize(x, format_ints(bits, axis, group), torch.float16, cb, lo, hi, n)

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
    with pytest.raises(ValueError, match="scale_dtype must be float16, bfloat16 or float32, got"):  # (native: "Double")
        torch.ops.kvq.quantize(x, format_ints(4, AXIS_TOKEN, 16), torch.float64, e, e, e, 0)
    with torch._subclasses.FakeTensorMode() as mode:  # the Python check (fake kernel; the reference runs it too)
        with pytest.raises(ValueError, match="scale_dtype must be float16, bfloat16 or float32, got torch.float64"):
            f = mode.from_tensor
            torch.ops.kvq.quantize(f(x), format_ints(4, AXIS_TOKEN, 16), torch.float64, f(e), f(e), f(e), 0)
    # Both ops, and for decode both the native kernel and the Python checks (the fake kernel
    # compile and export trace), name the problem.
    fake = torch._subclasses.FakeTensorMode()

    def both(change, match):
        for tq in (1, 3):
            args = attention_case(0, tq)
            args = change(args)
            with pytest.raises(ValueError, match=match):
                attend(args)
            if tq == 1:
                with fake, pytest.raises(ValueError, match=match):
                    attend(map_tensors(args, fake.from_tensor))

    both(lambda a: dict(a, q=torch.randn(2, 5, a["q"].shape[2], 32)), "5 query heads is not a multiple of 2")
    both(lambda a: dict(a, mask=a["mask"].float()), "mask must be")
    both(lambda a: dict(a, rope_inv_freq=torch.ones(5)), "rope_inv_freq must be None")
    both(lambda a: with_operand(a, "k", scale=None), "k codes need a scale and a zero")
    both(lambda a: with_operand(a, "v", out_idx=torch.zeros(2, 2, 64, 1, dtype=torch.uint8)), "v's out_val and out_idx come together")
    both(lambda a: with_operand(a, "k", bits=5), "bits must be")
    with pytest.raises(ValueError, match="takes one query token"):  # the native kernel
        attend(attention_case(0, 3), torch.ops.kvq.decode_attention)
    faked = map_tensors(attention_case(0, 3), fake.from_tensor)
    with fake, pytest.raises(ValueError, match="takes one query token"):  # the checks compile and export trace
        attend(faked, torch.ops.kvq.decode_attention)
