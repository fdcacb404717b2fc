"""One conformance suite for every implementation of the kvq ops on this machine.

The same cases run against each backend that exists here and are compared with the float64
oracle of `attention_cases.reference_attention` (quantize ops: byte for byte with the reference op):

* `reference`: the ATen reference kernels (kernels/reference.py), eager form (decode) and the
  streaming form (chunk): what every device without a native kernel runs;
* `native-cpu`: the C++ decode kernel registered for PyTorch's CPU dispatch key (decode only: CPU
  chunks run the streaming reference) and its `quantize_fixed`;
* `executorch`: the same C++ kernel inside the kvq ExecuTorch kernel library, called from a one-op
  `.pte` (decode only; ExecuTorch programs take float32 queries);
* `triton-interpreter`: the Triton kernels run in Triton's interpreter on CPU tensors (decode, chunk,
  quantize, quantize_fixed).

The Triton kernels compiled ahead of time for sm_80/sm_90 (no GPU needed) are checked by
tests/kernels/test_triton_aot.py over the presets and the same format matrix; they cannot run here.
A backend that is missing on this machine is skipped with the reason (no compiler, no executorch,
no triton); the cases a backend does not implement (chunk for the decode-only kernels) are not
generated.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from kvq_ao.format import AXIS_CHANNEL, AXIS_TOKEN, FLOAT_META, ONE_ROW, default_meta_exponent, format_ints, meta_ints
from kvq_ao.quant.codebook import nf_codebook
from kvq_ao.kernels import cpu, gpu, reference
from kvq_ao.ops import attention_arguments, reference_arguments

from attention_cases import (CHUNK_CASES, DECODE_CASES, FORMATS, TOLERANCE, attend, chunk_case, decode_case, expected_streaming,
                             map_tensors, native_case, quantize_case, reference_attention, with_operand)  # fmt: skip


# ----------------------------------------------------------------------------- backends
def _native_available() -> str | None:
    return None if cpu.load() else f"the native CPU kernels did not build: {cpu._state['failed']}"


def _triton_available() -> str | None:
    return None if gpu.load() else "triton is not installed"


def _executorch_available() -> str | None:
    try:
        from kvq_ao.kernels.cpu import executorch_library
    except ImportError as error:
        return f"executorch is not installed ({error})"
    return None if executorch_library.load() else f"the kvq ExecuTorch kernel library did not build: {executorch_library.failure()}"


def _native_decode(named: dict) -> torch.Tensor:
    assert torch._C._dispatch_has_kernel_for_dispatch_key("kvq::decode_attention", "CPU")
    return attend(named, torch.ops.kvq.decode_attention)


class _OneOp(torch.nn.Module):
    """kvq::decode_attention on a case's tensors (its non-tensor fields fixed at export)."""

    def __init__(self, named: dict):
        super().__init__()
        self.named = named

    def forward(self, *tensors):
        it = iter(tensors)
        case = map_tensors(self.named, lambda _: next(it))
        return attend(case, torch.ops.kvq.decode_attention)


def _tensors(named: dict) -> list[torch.Tensor]:
    seen = []
    map_tensors(named, seen.append)
    return seen


def _executorch_decode(named: dict) -> torch.Tensor:
    """The case through a one-op `.pte` whose attention is `kvq::decode_attention.out` of the kvq
    ExecuTorch kernel library (the program `export_executorch(kvq_kernels="native")` writes)."""
    from executorch.exir import to_edge
    from executorch.runtime import Runtime

    inputs = tuple(_tensors(named))
    program = torch.export.export(_OneOp(named), inputs, strict=False)
    pte = to_edge(program).to_executorch()
    ops = {str(n.target) for n in pte.exported_program().graph.nodes if n.op == "call_function"}
    assert any("kvq.decode_attention.out" in op for op in ops), ops  # the kernel library's op, not a decomposition
    method = Runtime.get().load_program(pte.buffer).load_method("forward")
    return method.execute(list(inputs))[0]


BACKENDS = {  # name -> (why it is unavailable here or None, decode, chunk)
    "reference": (lambda: None, lambda n: reference.attention(**reference_arguments(n), target="eager"),
                  lambda n: reference.streaming_attention(**reference_arguments(n))),
    "native-cpu": (_native_available, _native_decode, None),
    "executorch": (_executorch_available, _executorch_decode, None),
    "triton-interpreter": (_triton_available, lambda n: attend(n, torch.ops.kvq.triton_decode_attention),
                           lambda n: attend(n, torch.ops.kvq.triton_chunk_attention)),
}
DECODE_BACKENDS = [name for name, (_, decode, _) in BACKENDS.items() if decode]
CHUNK_BACKENDS = [name for name, (_, _, chunk) in BACKENDS.items() if chunk]


@functools.cache
def _unavailable(name: str) -> str | None:
    return BACKENDS[name][0]()


def _runner(name: str, kind: str):
    why = _unavailable(name)
    if why:
        pytest.skip(f"{name}: {why}")
    return BACKENDS[name][1 if kind == "decode" else 2]


def _runs_on(name: str, named: dict) -> bool:
    """ExecuTorch programs take float32 queries (the exported model's dtype); the others take any."""
    return name != "executorch" or named["q"].dtype == torch.float32


def triton_supported(named: dict) -> bool:
    """Whether the Triton kernels take these keys (their docstrings' rule, restated): integer-query
    keys need groups of >= 16 tokens (or calibrated rows) and no exact outliers."""
    k = named["k"]
    return not k.int_query or ((k.group >= 16 or k.group == ONE_ROW) and k.n_outliers == 0)


# ----------------------------------------------------------------------------- decode cases
def check_decode(name: str, named: dict) -> torch.Tensor:
    out = _runner(name, "decode")(named)
    want = reference_attention(named)
    tol = TOLERANCE[named["q"].dtype]
    assert out.shape == want.shape and out.dtype == named["q"].dtype, (out.shape, out.dtype)
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    return out


@pytest.mark.parametrize("case_id", list(DECODE_CASES))
@pytest.mark.parametrize("backend", DECODE_BACKENDS)
def test_decode_attention(backend, case_id):
    named = decode_case(case_id)
    if not _runs_on(backend, named):
        named = map_tensors(named, lambda t: t.float() if t.is_floating_point() and t.dtype != torch.float32 else t)
    if backend == "triton-interpreter" and not triton_supported(named):  # integer-query keys Triton does not take: refused by name
        with pytest.raises(ValueError, match="groups of >= 16 tokens, no outliers"):
            _runner(backend, "decode")(named)
        return
    check_decode(backend, named)


@pytest.mark.parametrize("backend", ["reference", "native-cpu", "executorch"])
def test_an_integer_query_changes_the_scores(backend):
    """The integer-query cases above would pass vacuously if a backend scored those keys in float: the
    query's rounding moves the output by far more than the tolerance, so the float reference fails them.
    An int16 query's steps are 256 times finer, so its cases get a query 30 times as large (the scores'
    rounding grows with them, the kernels' float error stays within the tolerance)."""
    for case_id in ("int8-query-k4", "int8-query-k2-g32-outliers", "int16-query-k4", "int16-query-k2-g32-outliers"):
        named = decode_case(case_id)
        if named["k"].query_bits == 16:
            named["q"] = named["q"] * 30.0
        out = check_decode(backend, named)
        as_float = reference_attention(with_operand(named, "k", query_bits=0))
        assert (out.double() - as_float).abs().max() > 20 * TOLERANCE[torch.float32]


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
def test_masks_softcap_and_outlier_dtypes_change_what_decode_reads(backend):
    """The cases above would pass vacuously if a backend ignored masks, soft-capping or the exact
    outliers: each changes the result, and a query that sees nothing gets zeros."""
    plain = check_decode(backend, native_case(1))
    assert not torch.allclose(plain[1], check_decode(backend, native_case(1, left_pad=30))[1], atol=1e-4)
    assert not torch.allclose(plain, check_decode(backend, native_case(1, window=20)), atol=1e-4)
    assert not torch.allclose(plain, check_decode(backend, native_case(1, softcap=0.5)), atol=1e-4)
    nothing = native_case(2, side="empty")
    nothing["mask"] = torch.zeros_like(nothing["mask"])
    assert torch.equal(_runner(backend, "decode")(nothing), torch.zeros(2, 6, 1, 64))
    for dtype in (torch.float16, torch.bfloat16):  # outliers stored in 16 bits in a float32 model
        named = native_case(8, k_fmt=(3, AXIS_CHANNEL, 16, True, 2), v_fmt=(4, AXIS_TOKEN, 16, False, 1), pre_rope=True)
        named = with_operand(named, "k", out_val=named["k"].out_val.to(dtype))
        check_decode(backend, with_operand(named, "v", out_val=named["v"].out_val.to(dtype)))


@pytest.mark.parametrize("backend", ["reference", "native-cpu", "triton-interpreter"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), k_fmt=FORMATS, v_fmt=FORMATS, ratio=st.sampled_from([1, 3, 8]),
       hkv=st.sampled_from([1, 2]), d=st.sampled_from([64, 128, 256]), blocks=st.integers(1, 9),
       side=st.sampled_from(["empty", "some", "full"]), left_pad=st.sampled_from([0, 5, 21]),
       window=st.sampled_from([0, 7, 40]), head_mask=st.booleans(), pre_rope=st.booleans(),
       softcap=st.sampled_from([0.0, 0.0, 2.5]), dtype=st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16]),
       query_bits=st.sampled_from([0, 8, 16]))  # fmt: skip
def test_random_decode_cases(backend, seed, k_fmt, v_fmt, ratio, hkv, d, blocks, side, left_pad, window, head_mask,
                             pre_rope, softcap, dtype, query_bits):  # fmt: skip
    """Random formats and shapes (hypothesis): body ends mid-tile, any side store, masks, dtypes;
    keys in uniform per-channel groups post-RoPE also scored against an int8 or int16 query (not in Triton)."""
    body_end = max(1, 16 * blocks - 7 - seed % 9)
    named = native_case(seed, k_fmt=k_fmt, v_fmt=v_fmt, hkv=hkv, ratio=ratio, d=d, blocks=blocks, body_end=body_end, side=side,
                        left_pad=left_pad, window=window, head_mask=head_mask, pre_rope=pre_rope, softcap=softcap, dtype=dtype)  # fmt: skip
    k = named["k"]
    if query_bits and backend != "triton-interpreter" and k.bits and k.axis == AXIS_CHANNEL and k.codebook is None and not pre_rope:
        named = with_operand(named, "k", query_bits=query_bits)
    check_decode(backend, named)


# ----------------------------------------------------------------------------- chunk cases
@pytest.mark.parametrize("mask", ["bounds", "dense"])
@pytest.mark.parametrize("case_id", list(CHUNK_CASES))
@pytest.mark.parametrize("backend", CHUNK_BACKENDS)
def test_chunk_attention(backend, case_id, mask):
    from kvq_ao import masks

    named = chunk_case(case_id)
    want = expected_streaming(named)
    if mask == "dense":
        named = dict(named, mask=masks.dense(named["mask"], named["k"].codes.shape[2]))
    if backend == "triton-interpreter" and not triton_supported(named):  # integer-query keys Triton does not take: refused by name
        with pytest.raises(ValueError, match="groups of >= 16 tokens, no outliers"):
            _runner(backend, "chunk")(named)
        return
    out = _runner(backend, "chunk")(named)
    assert out.shape == want.shape
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", CHUNK_BACKENDS)
def test_chunk_with_a_per_head_mask_in_half_precision(backend):
    """A dense mask that differs per query head; bf16 queries and side store (the model's dtype)."""
    from kvq_ao import masks

    named = chunk_case("many-blocks")
    dense = masks.dense(named["mask"], named["k"].codes.shape[2]).expand(-1, 6, -1, -1).clone()
    dense[:, 1::2, :, 5:40] = False
    named = dict(named, mask=dense)
    run = _runner(backend, "chunk")
    full = run(named)
    torch.testing.assert_close(full.double(), reference_attention(named), rtol=2e-5, atol=2e-5)
    assert not torch.allclose(full[:, 0], full[:, 1])
    sides = lambda c, dtype: with_operand(with_operand(c, "k", side=c["k"].side.to(dtype)), "v", side=c["v"].side.to(dtype))  # noqa: E731
    half = sides(dict(named, q=named["q"].to(torch.bfloat16)), torch.bfloat16)
    got = run(half)
    assert got.dtype == torch.bfloat16
    want = reference_attention(sides(dict(half, q=half["q"].float()), torch.float32))
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------- quantize and quantize_fixed
class _OneQuantize(torch.nn.Module):
    """kvq::quantize on (x, codebook, lo, hi), its format, scale dtype and slot count fixed at export."""

    def __init__(self, format, scale_dtype, n_outliers):
        super().__init__()
        self.format, self.scale_dtype, self.n_outliers = format, scale_dtype, n_outliers

    def forward(self, x, codebook, lo, hi):
        return torch.ops.kvq.quantize(x, self.format, self.scale_dtype, codebook, lo, hi, self.n_outliers)


def _executorch_quantize(x, format, scale_dtype, codebook, lo, hi, n_outliers):
    """The append through a one-op `.pte` whose quantizer is `kvq::quantize.out` of the kvq
    ExecuTorch kernel library (what `export_executorch(kvq_kernels="native")` programs call)."""
    from executorch.exir import to_edge
    from executorch.runtime import Runtime

    inputs = (x, codebook, lo, hi)
    program = torch.export.export(_OneQuantize(list(format), scale_dtype, n_outliers), inputs, strict=False)
    pte = to_edge(program).to_executorch()
    ops = {str(n.target) for n in pte.exported_program().graph.nodes if n.op == "call_function"}
    assert any("kvq.quantize.out" in op for op in ops), ops  # the kernel library's op, not a decomposition
    method = Runtime.get().load_program(pte.buffer).load_method("forward")
    return method.execute(list(inputs))


class _OneQuantizeFixed(torch.nn.Module):
    """kvq::quantize_fixed on (x, zero, scale, codebook, lo, hi), its width and slot count fixed at export."""

    def __init__(self, bits, n_outliers):
        super().__init__()
        self.bits, self.n_outliers = bits, n_outliers

    def forward(self, x, zero, scale, codebook, lo, hi):
        return torch.ops.kvq.quantize_fixed(x, self.bits, zero, scale, codebook, lo, hi, self.n_outliers)


def _executorch_quantize_fixed(x, bits, zero, scale, codebook, lo, hi, n_outliers):
    """The calibrated-range append through a one-op `.pte` calling `kvq::quantize_fixed.out`."""
    from executorch.exir import to_edge
    from executorch.runtime import Runtime

    inputs = (x, zero, scale, codebook, lo, hi)
    program = torch.export.export(_OneQuantizeFixed(bits, n_outliers), inputs, strict=False)
    pte = to_edge(program).to_executorch()
    ops = {str(n.target) for n in pte.exported_program().graph.nodes if n.op == "call_function"}
    assert any("kvq.quantize_fixed.out" in op for op in ops), ops
    method = Runtime.get().load_program(pte.buffer).load_method("forward")
    return method.execute(list(inputs))


QUANTIZERS = {  # name -> (availability, kvq.quantize implementation or None, kvq.quantize_fixed implementation or None)
    "native-cpu": (_native_available, torch.ops.kvq.quantize, torch.ops.kvq.quantize_fixed),
    "executorch": (_executorch_available, _executorch_quantize, _executorch_quantize_fixed),
    "triton-interpreter": (_triton_available, lambda *a: torch.ops.kvq.triton_quantize(*a),
                           lambda *a: torch.ops.kvq.triton_quantize_fixed(*a)),
}
QUANTIZE_FIELDS = ("codes", "scale", "zero", "out_val", "out_idx", "clamped")
QUANTIZE_FORMATS = [  # every format the cache quantizes: codebooks have 2-4 bits, per-vector outliers per-token groups
    (bits, axis, group, codebook, outliers)
    for bits in (2, 3, 4, 8)
    for axis, group in ((AXIS_TOKEN, 32), (AXIS_TOKEN, 16), (AXIS_CHANNEL, 16))
    for codebook in ((False, True) if bits <= 4 else (False,))
    for outliers in (("none", "channel", "vector") if axis == AXIS_TOKEN else ("none", "channel"))
]


def _quantizer(name: str, which: int):
    availability, *ops = QUANTIZERS[name]
    why = availability()
    if why:
        pytest.skip(f"{name}: {why}")
    return ops[which]


@pytest.mark.parametrize("bits,axis,group,codebook,outliers", QUANTIZE_FORMATS)
@pytest.mark.parametrize("backend", [n for n, (_, q, _) in QUANTIZERS.items() if q])
def test_quantize_is_bit_identical_to_the_reference(backend, bits, axis, group, codebook, outliers):
    """Codes, scales, zeros, outlier slots and the clamped count, byte for byte, with float16,
    bfloat16 and float32 scales (float32 input: no ties between entries)."""
    op = _quantizer(backend, 0)
    x, *rest = quantize_case(bits, bits, axis, group, codebook, outliers, t=48 if axis == AXIS_CHANNEL else 37)
    stored = [(scale_dtype, FLOAT_META) for scale_dtype in (torch.float16, torch.bfloat16, torch.float32)]
    if axis == AXIS_TOKEN:  # 8-bit scale and zero: at the default exponent, and one whose smallest scale is above most ranges
        stored += [(torch.float16, meta_ints(default_meta_exponent(bits, codebook))), (torch.float16, meta_ints(-1))]
    for scale_dtype, meta in stored:
        fmt = [*rest[0][:-1], meta]
        got = op(x, fmt, scale_dtype, *rest[1:])
        want = reference.quantize(x, fmt, scale_dtype, *rest[1:])
        for name, a, b in zip(QUANTIZE_FIELDS, got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{name} differs ({scale_dtype}, meta {meta})"


@pytest.mark.parametrize("backend", [n for n, (_, q, _) in QUANTIZERS.items() if q])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), bits=st.sampled_from([2, 3, 4, 8]), codebook=st.booleans(),
       layout=st.sampled_from([(AXIS_TOKEN, 64), (AXIS_TOKEN, 16), (AXIS_CHANNEL, 16)]),
       outliers=st.sampled_from(["none", "channel", "vector"]), d=st.sampled_from([64, 128, 256]),
       magnitude=st.sampled_from([1e-9, 1e-6, 1e-3, 1.0, 3e3, 6e4, 1e6]), constant_groups=st.booleans(),
       scale_dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, "8-bit"]))  # fmt: skip
# found by CI: a constant group ties per-vector outlier candidates; the reference's topk took channel
# 12 before 0, every kernel 0 (the lower channel first, the rule)
@example(seed=310, bits=2, codebook=False, layout=(AXIS_TOKEN, 64), outliers="vector", d=64, magnitude=1e-9, constant_groups=True,
         scale_dtype=torch.float16)  # fmt: skip
def test_quantize_is_byte_identical_at_any_magnitude(backend, seed, bits, codebook, layout, outliers, d, magnitude, constant_groups,
                                                    scale_dtype):  # fmt: skip
    """Scales and zeros at the edges of their dtype: subnormal float16 ranges (1e-9, 1e-6), ranges
    past float16's largest value (6e4, 1e6, where the stored range saturates), constant groups
    (scale 0), head_dim up to 256 with outlier slots, 8-bit metadata below and above its scale
    codes' span: every field byte for byte."""
    axis, group = layout
    meta = FLOAT_META
    if scale_dtype == "8-bit":
        if axis == AXIS_CHANNEL:
            layout = axis, group = AXIS_TOKEN, 16  # 8-bit metadata codes per-token groups only
        scale_dtype, meta = torch.float16, meta_ints(default_meta_exponent(bits, codebook and bits <= 4))
    if outliers == "vector" and axis == AXIS_CHANNEL:
        outliers = "channel"  # per-vector outliers need per-token groups (the op refuses the pair)
    op = _quantizer(backend, 0)
    g = torch.Generator().manual_seed(seed)
    t = 32 if axis == AXIS_CHANNEL else 5
    x = torch.randn(2, 3, t, d, generator=g) * magnitude
    if constant_groups:
        x[:, 1, :, :16] = x[:, 1, :1, :1]  # a token group of 16 equal entries, and constant channels
    lo = hi = torch.zeros(0)
    if outliers == "channel":
        lo, hi = -magnitude * (1 + torch.rand(3, d, generator=g)), magnitude * (1 + torch.rand(3, d, generator=g))
    k = {"none": 0, "channel": 3, "vector": 2}[outliers]
    args = (x, format_ints(bits, axis, group, meta=meta), scale_dtype, nf_codebook(bits) if codebook and bits <= 4 else torch.zeros(0), lo, hi, k)
    got, want = op(*args), reference.quantize(*args)
    for name, a, b in zip(QUANTIZE_FIELDS, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{name} differs"


def test_executorch_quantize_refuses_nan_and_inf():
    """The .pte's native append fails the step on a NaN or Inf, as the eager append raises: a
    quantized cache does not store them (the runtime logs which index)."""
    quantize = _quantizer("executorch", 0)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(1, 2, 4, 64, generator=torch.Generator().manual_seed(0))
        x[0, 1, 2, 5] = bad
        with pytest.raises(RuntimeError, match="execute"):
            quantize(x, format_ints(4, AXIS_TOKEN, 32), torch.float16, torch.zeros(0), torch.zeros(0), torch.zeros(0), 0)
    x[0, 1, 2, 5] = 0.0  # the same program shape with finite input runs
    assert len(quantize(x, format_ints(4, AXIS_TOKEN, 32), torch.float16, torch.zeros(0), torch.zeros(0), torch.zeros(0), 0)) == 6
    fixed = _quantizer("executorch", 1)  # the calibrated-range append likewise
    ranges = (torch.zeros(2, 64), torch.full((2, 64), 0.1), torch.zeros(0), -torch.ones(2, 64), torch.ones(2, 64))
    x[0, 1, 2, 5] = float("nan")
    with pytest.raises(RuntimeError, match="execute"):
        fixed(x, 4, *ranges, 1)
    x[0, 1, 2, 5] = 0.0
    assert len(fixed(x, 4, *ranges, 1)) == 4


def test_native_quantize_takes_any_leading_dims_and_one_row_for_every_position():
    """Without outliers kvq.quantize takes [..., T, D] (a 3-d and a 5-d x here) and per-channel
    ranges over every position (`ONE_ROW`), as the reference does."""
    op = _quantizer("native-cpu", 0)
    g = torch.Generator().manual_seed(3)
    for shape, fmt in (((3, 8, 64), format_ints(4, AXIS_TOKEN, 32)), ((2, 1, 2, 32, 64), format_ints(3, AXIS_CHANNEL, 16)),
                       ((1, 3, 20, 64), format_ints(2, AXIS_CHANNEL, ONE_ROW))):  # fmt: skip
        x = torch.randn(*shape, generator=g).to(torch.bfloat16)
        args = (x, fmt, torch.float16, torch.zeros(0), torch.zeros(0), torch.zeros(0), 0)
        for name, a, b in zip(QUANTIZE_FIELDS, op(*args), reference.quantize(*args)):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{name} differs for {shape}"


@pytest.mark.parametrize("backend", [n for n, (_, _, f) in QUANTIZERS.items() if f])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), bits=st.sampled_from([2, 3, 4, 8]), codebook=st.booleans(), slots=st.sampled_from([0, 1, 2, 3]),
       d=st.sampled_from([64, 128]), t=st.integers(1, 40), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       scale_dtype=st.sampled_from([torch.float16, torch.bfloat16]))  # fmt: skip
def test_quantize_fixed_is_byte_identical_to_the_reference(backend, seed, bits, codebook, slots, d, t, dtype, scale_dtype):
    """Keys coded against calibrated ranges: codes, outlier slots and the clamped count byte for byte,
    every width, codebook or uniform levels, 0-3 slots, model dtypes. Half-precision inputs can tie
    for an outlier slot; the reference's top-k order among ties is unspecified, so those vectors are
    compared by the excess of what they kept. The ExecuTorch op takes float32 x only (the exported
    models' dtype; it refuses others by name)."""
    from kvq_ao.quant.codebook import nf_codebook
    from kvq_ao.quant.uniform import fixed_range

    assume(backend != "executorch" or dtype == torch.float32)
    op = _quantizer(backend, 1)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 3, t, d, generator=g) * 2).to(dtype)
    lo, hi = -1.5 - torch.rand(3, d, generator=g), 1.0 + torch.rand(3, d, generator=g)
    cb = nf_codebook(bits) if codebook and bits <= 4 else torch.zeros(0)
    zero, scale = fixed_range(lo, hi, 1 if cb.numel() else 2**bits - 1, scale_dtype)
    got = op(x, bits, zero, scale, cb, lo, hi, slots)
    want = reference.quantize_fixed(x, bits, zero, scale, cb, lo, hi, slots)
    assert [a.dtype for a in got] == [b.dtype for b in want] and [a.shape for a in got] == [b.shape for b in want]
    assert int(got[3]) == int(want[3])
    same = (got[2] == want[2]).all(-1)  # vectors whose slots agree (all of them unless entries tie)
    if dtype == torch.float32:
        assert same.all()
    assert torch.equal(got[0], want[0])  # codes do not depend on which of two tied entries a slot keeps
    assert torch.equal(got[1][same], want[1][same]) and torch.equal(got[2][same], want[2][same])
    xf = x.float()
    excess = (xf - hi[None, :, None]).clamp(min=0) + (lo[None, :, None] - xf).clamp(min=0)
    kept = lambda idx: excess.gather(-1, idx.long().clamp(max=d - 1)).sort(-1).values  # noqa: E731
    torch.testing.assert_close(kept(got[2])[~same], kept(want[2])[~same])


def test_every_backend_the_machine_should_have_is_here():
    """CI installs a compiler, executorch and triton: a silently missing backend would make this
    suite pass on less than it claims."""
    missing = {name: why for name in BACKENDS if (why := _unavailable(name))}
    assert not missing, missing


def test_the_op_arguments_built_here_are_the_schema_s():
    """Cases reach every backend through `kvq_ao.ops.attention_arguments`: one operand list each."""
    named = decode_case("outlier-slots")
    args = attention_arguments(named["q"], named["k"], named["v"], **{n: v for n, v in named.items() if n not in "qkv"})
    assert set(args) == {"q", "k", "k_format", "v", "v_format", "side_pos", "body_end", "mask", "rope_inv_freq",
                         "body_start", "scaling", "rope_scale", "softcap"}  # fmt: skip
