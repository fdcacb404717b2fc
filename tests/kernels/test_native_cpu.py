"""The native CPU decode-attention kernel against the reference, on fresh random data.

Every format the cache holds (2/3/4/8-bit uniform and codebook levels, per-channel and per-token
groups, outlier slots, pre-RoPE keys, a float body), GQA ratios 1/3/8, head_dim 64/128/256, odd
lengths that end mid-tile, empty and full side stores, left-padded batches, sliding windows,
per-head masks, soft-capping, and fp32/fp16/bf16 models. The float64 reference of
tests/attention_cases.py judges both the native kernel and the reference kernel.
"""

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvq_ao.kernels import cpu, reference
from kvq_ao.ops import reference_arguments
from kvq_ao.quant.uniform import AXIS_CHANNEL, AXIS_TOKEN, ONE_ROW

from attention_cases import FIXED, FORMATS, TOLERANCE, native_case, positional, reference_attention

def check(named):
    native = torch.ops.kvq.decode_attention(**named)
    ref = reference.attention(**reference_arguments(named), target="eager")
    want = reference_attention(named)
    tol = TOLERANCE[named["q"].dtype]
    assert native.shape == want.shape and native.dtype == named["q"].dtype
    torch.testing.assert_close(native.double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(native.double(), ref.double(), rtol=tol, atol=tol)
    return native


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), k_fmt=FORMATS, v_fmt=FORMATS, ratio=st.sampled_from([1, 3, 8]),
       hkv=st.sampled_from([1, 2]), d=st.sampled_from([64, 128, 256]), blocks=st.integers(1, 9),
       side=st.sampled_from(["empty", "some", "full"]), left_pad=st.sampled_from([0, 5, 21]),
       window=st.sampled_from([0, 7, 40]), head_mask=st.booleans(), pre_rope=st.booleans(),
       softcap=st.sampled_from([0.0, 0.0, 2.5]), dtype=st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16]))  # fmt: skip
def test_native_decode_attention_matches_the_reference(seed, k_fmt, v_fmt, ratio, hkv, d, blocks, side, left_pad,
                                                       window, head_mask, pre_rope, softcap, dtype):  # fmt: skip
    body_end = max(1, 16 * blocks - 7 - seed % 9)  # ends mid-tile, odd or even
    named = native_case(seed, k_fmt=k_fmt, v_fmt=v_fmt, hkv=hkv, ratio=ratio, d=d, blocks=blocks, body_end=body_end,
                        side=side, left_pad=left_pad, window=window, head_mask=head_mask, pre_rope=pre_rope,
                        softcap=softcap, dtype=dtype)  # fmt: skip
    check(named)


@pytest.mark.parametrize("ratio", [1, 3, 8])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gqa_ratios_and_head_dims_at_several_tiles(ratio, d):
    """Long enough (1184 tokens: 19 tiles, more chunks than threads) that the split-softmax merge is exercised."""
    named = native_case(0, hkv=2, ratio=ratio, d=d, blocks=74, k_fmt=(2, AXIS_CHANNEL, 16, False, 0),
                        v_fmt=(2, AXIS_TOKEN, 16, False, 0))  # fmt: skip
    check(named)


def test_left_padded_rows_and_sliding_windows_change_the_result():
    """The masks above would pass vacuously if the kernel ignored them."""
    plain = check(native_case(1))
    assert not torch.allclose(plain[1], check(native_case(1, left_pad=30))[1], atol=1e-4)
    assert not torch.allclose(plain, check(native_case(1, window=20)), atol=1e-4)


def test_a_query_with_nothing_visible_gets_zeros():
    named = native_case(2, side="empty")
    named["mask"] = torch.zeros_like(named["mask"])
    assert torch.equal(torch.ops.kvq.decode_attention(**named), torch.zeros(2, 6, 1, 64))


@pytest.mark.parametrize("codebook, outliers, pre_rope", [(True, 1, True), (False, 0, False), (False, 2, True)])
def test_native_decode_attention_reads_calibrated_key_ranges(codebook, outliers, pre_rope):
    """Keys with calibrated per-channel ranges: one scale/zero row read for every position (the
    cache's layout for them), with and without outliers, codebook levels and pre-RoPE rotation."""
    named = native_case(6, k_fmt=(3, AXIS_CHANNEL, FIXED, codebook, outliers), v_fmt=(3, AXIS_TOKEN, 64, False, 1),
                        pre_rope=pre_rope)  # fmt: skip
    assert named["k_scale"].shape[2] == 1 and named["k_group"] == ONE_ROW
    check(named)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("codebook, outliers", [(False, 0), (True, 1), (True, 2), (False, 3)])
@pytest.mark.parametrize("d", [64, 128])
def test_pre_rope_keys_of_every_width_with_outliers_and_scale_rows_changing_mid_tile(bits, codebook, outliers, d):
    """Pre-RoPE per-channel keys at 2/3/4/8 bits: outliers replacing rotated channels (up to 2 slots a
    vector patched in registers, 3 through the float tile; 8-bit levels are the integer grid even where
    a codebook is asked for), scale rows changing mid-tile (groups of 16 tokens, tiles of 64), a tile
    cut short by the body's end, and the kernel's own sin/cos."""
    named = native_case(7 + bits, hkv=2, ratio=3, d=d, blocks=9, body_end=16 * 9 - 5, pre_rope=True,
                        k_fmt=(bits, AXIS_CHANNEL, 16, codebook, outliers), v_fmt=(bits, AXIS_TOKEN, 16, codebook, 0))  # fmt: skip
    check(named)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_opcheck_native_decode_attention(dtype):
    named = native_case(3, k_fmt=(3, AXIS_CHANNEL, 16, True, 1), pre_rope=True, dtype=dtype)
    torch.library.opcheck(torch.ops.kvq.decode_attention.default, positional(named))


def test_native_kernel_is_what_cpu_runs():
    """The op's CPU dispatch goes to the C++ kernel, not the Python reference."""
    assert cpu.is_loaded()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("kvq::decode_attention", "CPU")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("kvq::chunk_attention", "CPU")


@pytest.fixture
def fresh_loader(monkeypatch):
    """The loader as in a new process (the library stays registered in this one)."""
    monkeypatch.setattr(cpu, "_state", {"loaded": False, "failed": None})


def test_without_a_compiler_one_clear_warning_and_the_reference(fresh_loader, monkeypatch, tmp_path):
    monkeypatch.setenv("KVQ_AO_CACHE", str(tmp_path))  # nothing built here yet

    def no_compiler(directory, verbose):
        raise RuntimeError("g++: command not found")

    monkeypatch.setattr(cpu, "_compile", no_compiler)
    with pytest.warns(RuntimeWarning, match="could not build the native CPU kernels.*g\\+\\+: command not found.*reference"):
        assert cpu.load() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: a second load neither retries nor warns again
        assert cpu.load() is False
    assert not cpu.is_loaded()


def test_a_built_library_is_reused_without_compiling(fresh_loader, monkeypatch):
    monkeypatch.setattr(cpu, "_compile", lambda directory, verbose: pytest.fail("compiled again"))
    assert any(cpu.build_directory().glob("kvq_cpu*.so"))
    assert cpu.load() is True


def test_native_kernels_can_be_turned_off(fresh_loader, monkeypatch):
    monkeypatch.setenv("KVQ_AO_NATIVE", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu.load() is False


def test_pre_rope_keys_far_into_a_long_cache_match_the_reference_kernel():
    """RoPE angles of positions near 2^18 (the kernel's own sin/cos, reduced in float32) against the
    reference kernel, which rotates with torch's float32 angles as the model does. (The float64
    reference of the other tests takes exact angles, which differ from float32 ones out here.)"""
    named = native_case(4, hkv=1, ratio=3, batch=1, blocks=2**14, k_fmt=(4, AXIS_CHANNEL, 16, False, 0), pre_rope=True)
    t = named["k_codes"].shape[2]
    named["body_start"] = t - 70
    named["side_pos"] = torch.tensor([0, t - 3, t - 2, -1])
    named["side_k"], named["side_v"] = named["side_k"][:, :, :4], named["side_v"][:, :, :4]
    native = torch.ops.kvq.decode_attention(**named)
    ref = reference.attention(**reference_arguments(named), target="eager")
    torch.testing.assert_close(native, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("outlier_dtype", [torch.float16, torch.bfloat16])
def test_outlier_values_in_16_bits_in_a_float32_model(outlier_dtype):
    """A QuantSpec with outlier_dtype stores the kept values in 16 bits whatever the model's dtype;
    the kernel reads them as stored (the float64 reference reads the same rounded values)."""
    named = native_case(8, k_fmt=(3, AXIS_CHANNEL, 16, True, 2), v_fmt=(4, AXIS_TOKEN, 16, False, 1), pre_rope=True)
    named.update(k_out_val=named["k_out_val"].to(outlier_dtype), v_out_val=named["v_out_val"].to(outlier_dtype))
    check(named)


# ----------------------------------------------------------------------------- the key append of calibrated ranges
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), bits=st.sampled_from([2, 3, 4, 8]), codebook=st.booleans(), slots=st.sampled_from([0, 1, 2, 3]),
       d=st.sampled_from([64, 128]), t=st.integers(1, 40), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       scale_dtype=st.sampled_from([torch.float16, torch.bfloat16]))  # fmt: skip
def test_native_quantize_fixed_is_byte_identical_to_the_reference(seed, bits, codebook, slots, d, t, dtype, scale_dtype):
    """`kvq.quantize_fixed` on CPU (the C++ kernel) against the reference op: codes, outlier slots and
    the clamped count byte for byte, every width, codebook or uniform levels, 0-3 slots, model dtypes.
    Half-precision inputs can tie for an outlier slot; the reference's top-k order among ties is
    unspecified, so those vectors are compared by the excess of what they kept."""
    from kvq_ao.quant.codebook import nf_codebook
    from kvq_ao.quant.uniform import fixed_range

    assert cpu.is_loaded()  # so the op below runs the C++ kernel
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 3, t, d, generator=g) * 2).to(dtype)
    lo, hi = -1.5 - torch.rand(3, d, generator=g), 1.0 + torch.rand(3, d, generator=g)
    cb = nf_codebook(bits) if codebook and bits <= 4 else torch.zeros(0)
    zero, scale = fixed_range(lo, hi, 1 if cb.numel() else 2**bits - 1, scale_dtype)
    got = torch.ops.kvq.quantize_fixed(x, bits, zero, scale, cb, lo, hi, slots)
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


def test_native_quantize_fixed_serves_cpu_and_checks_its_arguments():
    from kvq_ao.quant.uniform import fixed_range

    assert torch._C._dispatch_has_kernel_for_dispatch_key("kvq::quantize_fixed", "CPU")
    x, lo, hi = torch.randn(1, 2, 4, 64), -torch.ones(2, 64), torch.ones(2, 64)
    zero, scale = fixed_range(lo, hi, 7, torch.float16)
    with pytest.raises(ValueError, match=r"fixed ranges need hi as \[heads, head_dim\] = \[2, 64\]"):
        torch.ops.kvq.quantize_fixed(x, 3, zero, scale, torch.zeros(0), lo, hi[:1], 0)
    with pytest.raises(ValueError, match="bits must be one of"):
        torch.ops.kvq.quantize_fixed(x, 6, zero, scale, torch.zeros(0), lo, hi, 0)
    with pytest.raises(ValueError, match="n_outliers must be in"):
        torch.ops.kvq.quantize_fixed(x, 3, zero, scale, torch.zeros(0), lo, hi, 65)
    with pytest.raises(ValueError, match="codebook must hold 8 levels"):
        torch.ops.kvq.quantize_fixed(x, 3, zero, scale, torch.linspace(0, 1, 4), lo, hi, 0)
