"""What is particular to the native CPU kernels: registration, the build and its fallback, RoPE angles
far into a long cache, argument checks. What they compute, over every format, shape, mask and
dtype, is checked with every other backend by tests/kernels/test_conformance.py.
"""

import warnings

import pytest
import torch

from kvq_ao.format import AXIS_CHANNEL
from kvq_ao.kernels import cpu, reference
from kvq_ao.ops import reference_arguments

from attention_cases import attend, native_case, positional, with_operand


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
    t = named["k"].codes.shape[2]
    named["body_start"] = t - 70
    named["side_pos"] = torch.tensor([0, t - 3, t - 2, -1])
    named = with_operand(with_operand(named, "k", side=named["k"].side[:, :, :4]), "v", side=named["v"].side[:, :, :4])
    native = attend(named)
    ref = reference.attention(**reference_arguments(named), target="eager")
    torch.testing.assert_close(native, ref, rtol=1e-4, atol=1e-4)


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


def test_native_quantize_serves_cpu_and_checks_its_arguments():
    """kvq.quantize's CPU kernel refuses what the reference refuses, with the same words."""
    from kvq_ao.format import AXIS_CHANNEL, AXIS_TOKEN, format_ints

    assert torch._C._dispatch_has_kernel_for_dispatch_key("kvq::quantize", "CPU")
    x, none = torch.randn(1, 2, 4, 64), torch.zeros(0)
    tok = format_ints(4, AXIS_TOKEN, 32)
    with pytest.raises(ValueError, match="bits must be one of"):
        torch.ops.kvq.quantize(x, format_ints(5, AXIS_TOKEN, 32), torch.float16, none, none, none, 0)
    with pytest.raises(ValueError, match="per-token group size 48 does not divide head_dim 64"):
        torch.ops.kvq.quantize(x, format_ints(4, AXIS_TOKEN, 48), torch.float16, none, none, none, 0)
    with pytest.raises(ValueError, match="whole blocks of 16 tokens, got 4 tokens"):
        torch.ops.kvq.quantize(x, format_ints(4, AXIS_CHANNEL, 16), torch.float16, none, none, none, 0)
    with pytest.raises(ValueError, match="n_outliers must be in"):
        torch.ops.kvq.quantize(x, tok, torch.float16, none, none, none, 65)
    with pytest.raises(ValueError, match=r"codebook must hold 2\*\*bits levels for bits in \(2, 3, 4\); got \[4\] for 4 bits"):
        torch.ops.kvq.quantize(x, tok, torch.float16, torch.linspace(0, 1, 4), none, none, 0)
    with pytest.raises(ValueError, match=r"outlier thresholds must be \[heads, head_dim\] = \[2, 64\]"):
        torch.ops.kvq.quantize(x, tok, torch.float16, none, -torch.ones(1, 64), torch.ones(1, 64), 1)
    with pytest.raises(ValueError, match="per-vector outliers .* need the per-token axis"):
        torch.ops.kvq.quantize(torch.randn(1, 2, 16, 64), format_ints(4, AXIS_CHANNEL, 16), torch.float16, none, none, none, 1)
    with pytest.raises(ValueError, match="scale_dtype must be float16, bfloat16 or float32"):
        torch.ops.kvq.quantize(x, tok, torch.float64, none, none, none, 0)
