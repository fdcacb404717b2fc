"""The Triton decode-attention kernels against the float64 reference, run on CPU tensors in Triton's
interpreter (the same kernel sources a GPU compiles), and traced by torch.compile.

Every format combination the native CPU kernel covers (tests/kernels/test_native_cpu.py): 2/3/4/8-bit
uniform and codebook levels, per-channel and per-token groups, outlier slots, pre-RoPE keys, a float
body, GQA ratios 1/3/8, head_dim 64/128/256, odd lengths, empty and full side stores, left padding,
sliding windows, per-head masks, soft-capping, fp32/fp16/bf16. Shapes are small: the interpreter
runs each program in Python.
"""

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton", reason="the GPU kernels' tests need triton (installed with the test extra)")

from kvq_ao import KVQuantConfig, make_cache, quantize_kv_  # noqa: E402
from kvq_ao import masks  # noqa: E402
from kvq_ao.kernels import gpu, reference  # noqa: E402
from kvq_ao.ops import ATTENTION_SCHEMA, reference_arguments  # noqa: E402
from kvq_ao.quant.uniform import AXIS_CHANNEL, AXIS_TOKEN  # noqa: E402

from attention_cases import FIXED, FORMATS, STREAM_FORMATS, TOLERANCE, expected_streaming, native_case, positional, reference_attention  # noqa: E402
from attention_cases import streaming_case  # noqa: E402
from conftest import kvquant_config, tiny_llama  # noqa: E402

gpu.load()


def triton_attention(named):
    return torch.ops.kvq.triton_decode_attention(**named)


def check(named):
    out = triton_attention(named)
    tol = TOLERANCE[named["q"].dtype]
    assert out.shape == named["q"].shape[:3] + named["side_v"].shape[-1:] and out.dtype == named["q"].dtype
    torch.testing.assert_close(out.double(), reference_attention(named), rtol=tol, atol=tol)
    ref = reference.attention(**reference_arguments(named), target="eager")
    torch.testing.assert_close(out.double(), ref.double(), rtol=tol, atol=tol)
    return out


@pytest.mark.parametrize("name", ["triton_decode_attention", "triton_chunk_attention"])
def test_the_triton_ops_take_exactly_the_attention_ops_arguments(name):
    """The schema torch infers from the Python signature is the one ATTENTION_SCHEMA defines, so each
    Triton op and its kvq op are interchangeable per device."""
    def arguments(schema):  # name, type (an inferred int is a SymInt), default
        return [(a.name, re.sub(r"\bSymInt\b", "int", str(a.type)), a.default_value) for a in schema.arguments]

    inferred = getattr(torch.ops.kvq, name).default._schema
    assert arguments(inferred) == arguments(torch._C.parse_schema("kvq::decode_attention" + ATTENTION_SCHEMA))
    assert [str(r.type) for r in inferred.returns] == ["Tensor"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), k_fmt=FORMATS, v_fmt=FORMATS, ratio=st.sampled_from([1, 3, 8]),
       hkv=st.sampled_from([1, 2]), d=st.sampled_from([64, 128, 256]), blocks=st.integers(1, 9),
       side=st.sampled_from(["empty", "some", "full"]), left_pad=st.sampled_from([0, 5, 21]),
       window=st.sampled_from([0, 7, 40]), head_mask=st.booleans(), pre_rope=st.booleans(),
       softcap=st.sampled_from([0.0, 0.0, 2.5]), dtype=st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16]))  # fmt: skip
def test_triton_decode_attention_matches_the_reference(seed, k_fmt, v_fmt, ratio, hkv, d, blocks, side, left_pad,
                                                       window, head_mask, pre_rope, softcap, dtype):  # fmt: skip
    body_end = max(1, 16 * blocks - 7 - seed % 9)  # ends mid-block, odd or even
    check(native_case(seed, k_fmt=k_fmt, v_fmt=v_fmt, hkv=hkv, ratio=ratio, d=d, blocks=blocks, body_end=body_end,
                      side=side, left_pad=left_pad, window=window, head_mask=head_mask, pre_rope=pre_rope,
                      softcap=softcap, dtype=dtype))  # fmt: skip


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("codebook", [False, True])
def test_every_width_with_outliers_and_pre_rope_keys(bits, codebook):
    """Each width once with every feature on, so no format depends on hypothesis drawing it."""
    fmt_k = (bits, AXIS_CHANNEL, 16, codebook, 2)
    fmt_v = (bits, AXIS_TOKEN, 8, codebook, 1)
    check(native_case(bits, k_fmt=fmt_k, v_fmt=fmt_v, pre_rope=True, blocks=3, head_mask=True))


@pytest.mark.parametrize("ratio,d", [(1, 64), (3, 64), (8, 64), (3, 128), (3, 256)])
def test_gqa_ratios_and_head_dims_over_many_blocks(ratio, d):
    """Long enough (13 blocks of 64 tokens over 3 splits) that the interleaved splits and their
    log-sum-exp merge are exercised."""
    named = native_case(0, hkv=1, batch=1, ratio=ratio, d=d, blocks=52, k_fmt=(2, AXIS_CHANNEL, 16, False, 0),
                        v_fmt=(2, AXIS_TOKEN, 16, False, 0))  # fmt: skip
    check(named)


@pytest.mark.parametrize("outlier_dtype", [torch.float16, torch.bfloat16])
def test_outlier_values_in_16_bits_in_a_float32_model(outlier_dtype):
    named = native_case(8, k_fmt=(3, AXIS_CHANNEL, 16, True, 2), v_fmt=(4, AXIS_TOKEN, 16, False, 1), pre_rope=True)
    named.update(k_out_val=named["k_out_val"].to(outlier_dtype), v_out_val=named["v_out_val"].to(outlier_dtype))
    check(named)


def test_masks_change_the_result():
    """The mask tests above would pass vacuously if the kernel ignored the masks."""
    plain = check(native_case(1))
    assert not torch.allclose(plain[1], check(native_case(1, left_pad=30))[1], atol=1e-4)
    assert not torch.allclose(plain, check(native_case(1, window=20)), atol=1e-4)


def test_a_query_with_nothing_visible_gets_zeros():
    named = native_case(2, side="empty")
    named["mask"] = torch.zeros_like(named["mask"])
    assert torch.equal(triton_attention(named), torch.zeros(2, 6, 1, 64))


def test_bad_input_gets_the_ops_own_error():
    named = native_case(3)
    named["q"] = named["q"].expand(-1, -1, 2, -1)
    with pytest.raises(ValueError, match="takes one query token"):
        triton_attention(named)


def test_opcheck_triton_decode_attention():
    """Registration and fake kernel (the schema, fake tensors, no mutation of inputs)."""
    named = native_case(3, k_fmt=(3, AXIS_CHANNEL, 16, True, 1), pre_rope=True, blocks=2)
    torch.library.opcheck(torch.ops.kvq.triton_decode_attention.default, positional(named),
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip


# --------------------------------------------------------------------------- chunk (multi-token) attention
def check_chunk(named, dense=False, tol=2e-5):
    """The Triton chunk op on a streaming case (bounds mask; dense: the same mask as bool) against
    the case's float64 reference."""
    want = expected_streaming(named)
    if dense:
        named = dict(named, mask=masks.dense(named["mask"], named["k_codes"].shape[2]))
    out = torch.ops.kvq.triton_chunk_attention(**named)
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), tq=st.sampled_from([2, 5, 16, 33]), k_fmt=st.sampled_from(STREAM_FORMATS),
       v_fmt=st.sampled_from([f for f in STREAM_FORMATS if f[0] == 0 or f[1] == AXIS_TOKEN or f[3] == 0]),
       window=st.sampled_from([None, 1, 9, 30]), pad=st.sampled_from([(0, 0), (0, 3), (20, 0)]),
       pre_rope=st.booleans(), softcap=st.sampled_from([0.0, 5.0]), gqa=st.sampled_from([(2, 2), (6, 2), (8, 1)]),
       per_query=st.booleans(), dense=st.booleans())  # fmt: skip
def test_triton_chunk_attention_matches_the_float64_reference(seed, tq, k_fmt, v_fmt, window, pad, pre_rope, softcap,
                                                              gqa, per_query, dense):  # fmt: skip
    """Causal, sliding-window and left-padded masks as bounds or dense, per-query body ends (a prefill
    chunk reading the cache as decoding would), every format, GQA."""
    named = streaming_case(seed, tq, k_fmt, v_fmt, hq=gqa[0], hkv=gqa[1], window=window, pad=pad, pre_rope=pre_rope,
                           softcap=softcap, per_query=per_query)  # fmt: skip
    check_chunk(named, dense)


def test_triton_kernels_read_calibrated_key_ranges():
    """Keys with calibrated per-channel ranges (one scale/zero row for every position, group = the
    body's length) in decode and chunk attention."""
    check(native_case(6, k_fmt=(3, AXIS_CHANNEL, FIXED, True, 1), v_fmt=(3, AXIS_TOKEN, 64, False, 1), pre_rope=True))
    check(native_case(7, k_fmt=(2, AXIS_CHANNEL, FIXED, False, 0), blocks=9))
    check_chunk(streaming_case(8, 21, STREAM_FORMATS[7], STREAM_FORMATS[3], length=200, pre_rope=True, per_query=True))


def test_a_chunk_over_many_blocks_with_a_per_head_mask_and_half_precision():
    """Several body blocks and query tiles; a dense mask that differs per query head; bf16 queries
    and side store (the model's dtype)."""
    named = streaming_case(3, 40, STREAM_FORMATS[2], STREAM_FORMATS[3], length=300, pre_rope=True, per_query=True)
    dense = masks.dense(named["mask"], named["k_codes"].shape[2]).expand(-1, 6, -1, -1).clone()
    dense[:, 1::2, :, 5:40] = False
    named = dict(named, mask=dense)
    full = torch.ops.kvq.triton_chunk_attention(**named)
    torch.testing.assert_close(full.double(), reference_attention(named), rtol=2e-5, atol=2e-5)
    half = {k: (v.to(torch.bfloat16) if k in ("q", "side_k", "side_v") else v) for k, v in named.items()}
    want = reference_attention({k: (v.float() if k in ("q", "side_k", "side_v") else v) for k, v in half.items()})
    got = torch.ops.kvq.triton_chunk_attention(**half)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
    assert not torch.allclose(full[:, 0], full[:, 1])


def test_opcheck_triton_chunk_attention():
    named = streaming_case(2, 8, STREAM_FORMATS[2], STREAM_FORMATS[3], window=10, pre_rope=True)
    torch.library.opcheck(torch.ops.kvq.triton_chunk_attention.default, (), named,
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip


# --------------------------------------------------------------------------- quantize (the append path)
QUANTIZE_FIELDS = ("codes", "scale", "zero", "out_val", "out_idx", "clamped")


def quantize_case(seed, bits, axis, group, codebook, outliers, dtype=torch.float32, t=48):
    from kvq_ao.quant.codebook import nf_codebook

    x = (torch.randn(2, 3, t, 64, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)
    lo = hi = torch.zeros(0)
    if outliers == "channel":
        lo, hi = -1.5 * torch.ones(3, 64), 1.5 * torch.ones(3, 64)
    k = {"none": 0, "channel": 2, "vector": 2}[outliers]
    return x, bits, axis, group, nf_codebook(bits) if codebook else torch.zeros(0), lo, hi, k


QUANTIZE_FORMATS = [  # every format the cache quantizes: codebooks have 2-4 bits, per-vector outliers per-token groups
    (bits, axis, group, codebook, outliers)
    for bits in (2, 3, 4, 8)
    for axis, group in ((AXIS_TOKEN, 32), (AXIS_TOKEN, 16), (AXIS_CHANNEL, 16))
    for codebook in ((False, True) if bits <= 4 else (False,))
    for outliers in (("none", "channel", "vector") if axis == AXIS_TOKEN else ("none", "channel"))
]


@pytest.mark.parametrize("bits,axis,group,codebook,outliers", QUANTIZE_FORMATS)
def test_triton_quantize_is_bit_identical_to_the_reference(bits, axis, group, codebook, outliers):
    """Codes, scales, zeros, outlier slots and the clamped count, byte for byte, with float16,
    bfloat16 and float32 scales (float32 input: no ties between entries, see the half-precision
    test for those)."""
    x, *rest = quantize_case(bits, bits, axis, group, codebook, outliers, t=48 if axis == AXIS_CHANNEL else 37)
    for scale_dtype in (torch.float16, torch.bfloat16, torch.float32):
        got = torch.ops.kvq.triton_quantize(x, *rest[:3], scale_dtype, *rest[3:])
        want = reference.quantize(x, *rest[:3], scale_dtype, *rest[3:])
        for name, a, b in zip(QUANTIZE_FIELDS, got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{name} differs ({scale_dtype})"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("outliers", ["channel", "vector"])
def test_triton_quantize_of_half_precision_input_differs_only_in_how_ties_are_broken(dtype, outliers):
    """Half-precision vectors often hold equal entries; when two tie for an outlier slot, torch.topk
    and the kernel may keep different ones (torch's order among ties is unspecified). Every vector
    without such a tie is byte-identical; vectors with one keep equally extreme entries."""
    x, *rest = quantize_case(7, 4, AXIS_TOKEN, 32, False, outliers, dtype=dtype, t=64)
    got = torch.ops.kvq.triton_quantize(x, *rest[:3], torch.float16, *rest[3:])
    want = reference.quantize(x, *rest[:3], torch.float16, *rest[3:])
    same = (got[4] == want[4]).all(-1)  # vectors whose outlier slots agree
    assert same.float().mean() > 0.9
    for a, b in zip(got[:5], want[:5]):
        assert torch.equal(a[same], b[same])
    xf = x.float()
    score = (xf - xf.mean(-1, keepdim=True)).abs() if outliers == "vector" else (xf.abs() - 1.5).clamp(min=0)
    picked = lambda idx: score.gather(-1, idx.long().clamp(max=63)).sort(-1).values  # noqa: E731
    torch.testing.assert_close(picked(got[4])[~same], picked(want[4])[~same], rtol=1e-3, atol=1e-3)


def test_opcheck_triton_quantize():
    x, *rest = quantize_case(1, 3, AXIS_CHANNEL, 16, True, "channel")
    torch.library.opcheck(torch.ops.kvq.triton_quantize.default, (x, *rest[:3], torch.float16, *rest[3:]),
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip


def test_triton_quantize_refuses_shapes_its_tiles_cannot_take():
    x = torch.randn(1, 1, 4, 48)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        torch.ops.kvq.triton_quantize(x, 4, AXIS_TOKEN, 16, torch.float16, torch.zeros(0), torch.zeros(0), torch.zeros(0), 0)
    with gpu.on_cpu():  # the cache then uses the reference op for that shape
        assert gpu.quantize_op(x, AXIS_TOKEN, 16, torch.float16) is torch.ops.kvq.quantize
        assert gpu.quantize_op(torch.randn(1, 1, 4, 64), AXIS_TOKEN, 16, torch.float16) is torch.ops.kvq.triton_quantize


@pytest.mark.parametrize("bits,codebook", [(2, False), (2, True), (3, False), (3, True), (4, True), (8, False)])
@pytest.mark.parametrize("slots", [0, 1, 3])
def test_triton_quantize_fixed_is_bit_identical_to_the_reference(bits, codebook, slots):
    """Keys coded against calibrated per-channel ranges (`kvq.quantize_fixed`): codes, outlier slots
    and the clamped count byte for byte, with ranges in float16 and bfloat16, odd token counts."""
    from kvq_ao.quant.codebook import nf_codebook
    from kvq_ao.quant.uniform import fixed_range

    g = torch.Generator().manual_seed(bits * 10 + slots)
    x = torch.randn(2, 3, 21, 64, generator=g) * 2
    lo, hi = -1.5 - torch.rand(3, 64, generator=g), 1.0 + torch.rand(3, 64, generator=g)
    cb = nf_codebook(bits) if codebook else torch.zeros(0)
    for scale_dtype in (torch.float16, torch.bfloat16):
        zero, scale = fixed_range(lo, hi, 1 if codebook else 2**bits - 1, scale_dtype)
        got = torch.ops.kvq.triton_quantize_fixed(x, bits, zero, scale, cb, lo, hi, slots)
        want = reference.quantize_fixed(x, bits, zero, scale, cb, lo, hi, slots)
        assert int(want[3]) > 0  # some entries were clamped: the count is checked, not only zeros
        for name, a, b in zip(("codes", "out_val", "out_idx", "clamped"), got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{name} differs ({scale_dtype})"


def test_triton_quantize_fixed_checks_its_arguments_and_fake_kernel():
    from kvq_ao.quant.uniform import fixed_range

    x, lo, hi = torch.randn(1, 2, 4, 64), -torch.ones(2, 64), torch.ones(2, 64)
    zero, scale = fixed_range(lo, hi, 7, torch.float16)
    with pytest.raises(ValueError, match=r"fixed ranges need zero as \[heads, head_dim\]"):
        torch.ops.kvq.triton_quantize_fixed(x, 3, zero[:1], scale, torch.zeros(0), lo, hi, 0)
    odd = torch.randn(1, 2, 4, 48)
    z48, s48 = fixed_range(-torch.ones(2, 48), torch.ones(2, 48), 7, torch.float16)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        torch.ops.kvq.triton_quantize_fixed(odd, 3, z48, s48, torch.zeros(0), -torch.ones(2, 48), torch.ones(2, 48), 0)
    with gpu.on_cpu():  # the cache then uses the reference op for that shape
        assert gpu.quantize_fixed_op(odd) is torch.ops.kvq.quantize_fixed
        assert gpu.quantize_fixed_op(x) is torch.ops.kvq.triton_quantize_fixed
    assert gpu.quantize_fixed_op(x) is torch.ops.kvq.quantize_fixed
    torch.library.opcheck(torch.ops.kvq.triton_quantize_fixed.default, (x, 3, zero, scale, torch.zeros(0), lo, hi, 1),
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip
    def arguments(op):  # name and type (an inferred int is a SymInt): the two ops are interchangeable
        return [(a.name, re.sub(r"\bSymInt\b", "int", str(a.type))) for a in op.default._schema.arguments]

    assert arguments(torch.ops.kvq.triton_quantize_fixed) == arguments(torch.ops.kvq.quantize_fixed)


@pytest.mark.parametrize("key_ranges", ["online", "calibrated"])
def test_generation_through_the_triton_kernels_equals_the_native_path(key_ranges):
    """quantize_kv_ and generate() unchanged, the Triton kernels serving every cache op (prefill
    chunks, appends, decode steps) in the interpreter: the same tokens as the CPU kernels, with
    key ranges per block or calibrated (keys coded on arrival by `kvq.triton_quantize_fixed`)."""
    model = tiny_llama(seed=5)
    cfg = kvquant_config(bits=3, outliers=0.02, model=model, key_ranges=key_ranges)
    quantize_kv_(model, cfg)
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded row

    def run():
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, prefill_chunk_size=8,
                                  output_scores=True, return_dict_in_generate=True)  # fmt: skip

    native = run()
    with gpu.on_cpu():
        triton = run()
    assert torch.equal(native.sequences, triton.sequences)
    for a, b in zip(native.scores, triton.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_cpu_is_served_by_the_triton_kernels_only_when_asked():
    cpu = torch.device("cpu")
    assert not gpu.serves(cpu)
    with gpu.on_cpu():
        assert gpu.serves(cpu)
    assert not gpu.serves(cpu)


@pytest.mark.parametrize("preset", ["kivi-2", "kvquant-nuq3-1pct", "kvquant-calibrated-ranges"])
def test_compiled_decode_step_traces_the_triton_op_without_graph_breaks(preset):
    """A decode step of a quantized model, compiled with fullgraph=True while the Triton kernels serve
    CPU tensors: one graph, the Triton op in it once per layer, the result of the eager step (native
    kernel). Dynamo traces; the graph runs the kernels in the interpreter (inductor's lowering of the
    Triton launches needs a GPU driver and is exercised by benchmarks/gpu.py on a GPU)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model = tiny_llama(seed=3)
    ranges = "calibrated" if preset == "kvquant-calibrated-ranges" else "online"
    cfg = KVQuantConfig.preset("kivi-2") if preset == "kivi-2" else kvquant_config(bits=3, outliers=0.02, model=model, key_ranges=ranges)
    quantize_kv_(model, cfg)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))

    def prefilled():
        cache = make_cache(model, cfg, max_cache_len=64)
        model(ids, cache=cache)
        return cache

    with torch.no_grad():
        eager = model(ids[:, -1:], cache=prefilled()).logits
        counter = CompileCounterWithBackend("eager")
        step = torch.compile(lambda token, cache: model(token, cache=cache).logits, backend=counter, fullgraph=True)
        torch._dynamo.reset()
        with gpu.on_cpu():
            compiled = step(ids[:, -1:], prefilled())
    assert counter.frame_count == 1
    calls = [n for n in counter.graphs[0].graph.nodes if "triton_decode_attention" in str(n.target)]
    assert len(calls) == model.config.num_hidden_layers
    coded = [n for n in counter.graphs[0].graph.nodes if "quantize_fixed" in str(n.target)]
    if ranges == "calibrated":  # the new key is coded on arrival, by the Triton op
        assert coded and all("triton_quantize_fixed" in str(n.target) for n in coded), [str(n.target) for n in coded]
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


def test_the_gpu_benchmark_dry_run_checks_and_times_every_section(tmp_path):
    """benchmarks/gpu.py --dry-run: the script a lent GPU machine runs, on CPU tensors in the
    interpreter at tiny shapes; its correctness section passed and every section produced rows."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "gpu.json"
    run = subprocess.run([sys.executable, "benchmarks/gpu.py", "--dry-run", "--out", str(out)], cwd=root,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    presets = {"kivi-4", "kivi-2", "kvquant-3-1pct", "kvquant-2-1pct"}
    assert {r["format"] for r in rows if r["section"] == "check" and r["ok"]} == presets
    assert {r["format"] for r in rows if r["section"] == "check-quantize" and r["ok"]} == presets
    assert {r["format"] for r in rows if r["section"] == "attention"} == presets | {"sdpa-bf16"}
    assert {r["format"] for r in rows if r["section"] == "step"} == {"fp", "kivi-4", "kivi-2"}
    assert all(r["ms"] > 0 for r in rows if "ms" in r)
