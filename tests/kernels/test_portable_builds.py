"""The decode kernel's C++ built for CPUs other than this one (`kvq_ao.kernels.cpu.portable`), run on
the conformance suite's decode cases and compared with the float64 oracle, as the PyTorch and
ExecuTorch builds are in test_conformance.py:

* `generic`: built for baseline x86-64 (no AVX), run natively: the fallback every other CPU gets;
* `aarch64`: cross-compiled (ARMv8.2-A + dot product, NEON) and run under qemu-user;

and the one-token key append (`quantize_fixed`) on both, byte for byte against the reference.

A machine without Debian's cross compiler and qemu-user skips the aarch64 build with that reason;
CI installs them (.ci/run sets KVQ_AO_REQUIRE_PORTABLE=1, and then a missing tool fails here).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from kvq_ao.format import AXIS_CHANNEL, AXIS_TOKEN
from kvq_ao.kernels.cpu import portable

from attention_cases import DECODE_CASES, TOLERANCE, decode_case, native_case, op_args, reference_attention


def _random_cases(n: int) -> dict:
    """Formats, shapes, masks and dtypes drawn from a fixed seed (the hypothesis test's space)."""
    rng = random.Random(47)
    fmt = lambda: (rng.choice([0, 2, 3, 4, 8]), rng.choice([AXIS_CHANNEL, AXIS_TOKEN]), 16, rng.random() < 0.4,  # noqa: E731
                   rng.choice([0, 0, 1, 2]))  # fmt: skip
    cases = {}
    for i in range(n):
        k_fmt, v_fmt = fmt(), fmt()
        k_fmt = k_fmt if k_fmt[0] in (2, 3, 4) else (*k_fmt[:3], False, k_fmt[4])  # codebooks at 2-4 bits
        v_fmt = v_fmt if v_fmt[0] in (2, 3, 4) else (*v_fmt[:3], False, v_fmt[4])
        blocks = rng.randint(1, 9)
        cases[f"random-{i}"] = native_case(
            1000 + i, k_fmt=k_fmt, v_fmt=v_fmt, hkv=rng.choice([1, 2]), ratio=rng.choice([1, 3, 8]),
            d=rng.choice([64, 128, 256]), blocks=blocks, body_end=max(1, 16 * blocks - rng.randint(0, 9)),
            side=rng.choice(["empty", "some", "full"]), left_pad=rng.choice([0, 5]), window=rng.choice([0, 7, 40]),
            head_mask=rng.random() < 0.5, pre_rope=rng.random() < 0.5, softcap=rng.choice([0.0, 2.5]),
            dtype=rng.choice([torch.float32, torch.float16, torch.bfloat16]))  # fmt: skip
    return cases


CASES = {**{case_id: decode_case(case_id) for case_id in DECODE_CASES}, **_random_cases(24)}


def _target(name: str) -> portable.Target:
    target = portable.TARGETS[name]
    why = target.unavailable()
    if why and os.environ.get("KVQ_AO_REQUIRE_PORTABLE") == "1":
        pytest.fail(f"{name}: {why}, and KVQ_AO_REQUIRE_PORTABLE=1 says this machine must build it")
    if why:
        pytest.skip(f"{name}: {why}")
    return target


def _mismatches(target: portable.Target, binary, directory) -> dict:
    """Case id -> largest error beyond tolerance, for every case whose output is off."""
    pairs = []
    for case_id, named in CASES.items():
        portable.write_case(op_args(named), directory / f"{case_id}.case")
        pairs.append((directory / f"{case_id}.case", directory / f"{case_id}.{target.name}.out"))
    portable.run(target, binary, pairs)
    bad = {}
    for case_id, named in CASES.items():
        want = reference_attention(named)
        got = portable.read_output(directory / f"{case_id}.{target.name}.out", want.shape).to(named["q"].dtype).double()
        tol = TOLERANCE[named["q"].dtype]
        if not torch.allclose(got, want, rtol=tol, atol=tol):
            bad[case_id] = float((got - want).abs().max())
    return bad


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = {}

    def get(name: str):
        if name not in cache:
            target = _target(name)
            directory = tmp_path_factory.mktemp(name)
            cache[name] = (target, portable.build_runner(target, directory), directory)
        return cache[name]

    return get


@pytest.mark.parametrize("name", ["generic", "avx2", "aarch64"])
def test_every_decode_case_matches_the_oracle(built, name):
    target, binary, directory = built(name)
    assert _mismatches(target, binary, directory) == {}


def test_the_aarch64_runner_is_an_aarch64_program(built):
    """So the passing aarch64 cases ran Arm code under qemu, not this machine's."""
    _, binary, _ = built("aarch64")
    header = binary.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # e_machine EM_AARCH64


@pytest.mark.parametrize("name", ["generic", "aarch64"])
def test_a_planted_error_in_the_vector_code_fails_the_cases(built, name, tmp_path):
    """A copy of attention_core.h whose 8-lane horizontal sum drops two lanes (the helper every
    vector path of both builds reduces with) must fail cases: the suite can see a broken build."""
    target, _, _ = built(name)
    source = (portable.HERE / "attention_core.h").read_text()
    right = "((v[4] + v[5]) + (v[6] + v[7]))"
    assert source.count(right) == 1
    (tmp_path / "attention_core.h").write_text(source.replace(right, "(v[4] + v[5])"))
    binary = portable.build_runner(target, tmp_path, header_dir=tmp_path)
    bad = _mismatches(target, binary, tmp_path)
    float_scores = [c for c in CASES if not c.startswith(("int8-query", "int16-query"))]  # integer-query keys: integer sums
    assert len([c for c in bad if c in float_scores]) >= len(float_scores) // 2, bad


@pytest.mark.parametrize("name", ["generic", "avx2", "aarch64"])
def test_a_planted_error_in_the_int8_dot_product_fails_the_integer_query_cases(built, name, tmp_path):
    """The portable int8 dot products (what these builds score integer-query keys with; sdot on Arm at
    -O3) pairing each code with its neighbour's query digit, and in the AVX2 build also its 8-row
    blocks (2- and 4-bit rows of 16, 32 or 64 bytes) summing each pair twice, must fail every int8-
    and int16-query case."""
    target, _, _ = built(name)
    source = (portable.HERE / "attention_core.h").read_text()
    plants = {"acc += static_cast<int32_t>(codes[d]) * static_cast<int32_t>(q8[d]);": ("q8[d]", "q8[d ^ 1]"),
              "acc_lo += static_cast<int32_t>(codes[d]) * static_cast<int32_t>(lo[d]);": ("lo[d]", "lo[d ^ 1]")}
    if name == "avx2":
        plants["sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, ones));"] = ("ones", "_mm256_set1_epi16(2)")
    for right, (a, b) in plants.items():
        assert source.count(right) == 1
        source = source.replace(right, right.replace(a, b))
    (tmp_path / "attention_core.h").write_text(source)
    bad = _mismatches(target, portable.build_runner(target, tmp_path, header_dir=tmp_path), tmp_path)
    int_cases = [c for c in DECODE_CASES if c.startswith(("int8-query", "int16-query"))]
    assert len(int_cases) == 10 and [c for c in int_cases if c not in bad] == [], sorted(bad)


def test_a_planted_error_in_the_neon_code_fails_the_aarch64_cases(built, tmp_path):
    """The NEON bodies (byte widening, codebook lookups by TBL, horizontal sums) are what the aarch64
    build runs: a copy whose lookup reads each level's bytes one byte off fails the codebook cases."""
    target, _, _ = built("aarch64")
    source = (portable.HERE / "attention_core.h").read_text()
    right = "vdupq_n_u32(0x03020100u)"
    assert source.count(right) == 1
    (tmp_path / "attention_core.h").write_text(source.replace(right, "vdupq_n_u32(0x04030201u)"))
    bad = _mismatches(target, portable.build_runner(target, tmp_path, header_dir=tmp_path), tmp_path)
    fused = ["k2v2-codebook", "k3v3-codebook", "k4v4-codebook"]  # keys and values read from codebook codes in registers
    assert all(c in bad for c in fused), sorted(bad)
    with_levels = [c for c in DECODE_CASES if "codebook" in c and "k8" not in c]  # 8-bit codes take no codebook
    assert [c for c in with_levels if c not in bad] == [], sorted(bad)


def test_the_extension_and_executorch_sources_compile_for_aarch64(tmp_path):
    """The PyTorch extension's and the ExecuTorch kernel library's sources, cross-compiled to
    objects (linking needs aarch64 builds of torch and executorch, which are not here)."""
    objects = portable.compile_only(_target("aarch64"), tmp_path)
    assert [o.name for o in objects] == ["decode_attention-aarch64.o", "quantize_fixed-aarch64.o", "quantize-aarch64.o",
                                         "executorch_ops-aarch64.o"]  # fmt: skip
    for obj in objects:
        header = obj.read_bytes()[:20]
        assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183


def _run_cases(built, name: str, prefix: str, cases: list[tuple], write) -> list:
    """Write each case with `write(*case, path)`, run the `name` build's runner on them all, return the output paths."""
    target, binary, directory = built(name)
    pairs = [(directory / f"{prefix}-{i}.case", directory / f"{prefix}-{i}.{name}.out") for i in range(len(cases))]
    for case, (path, _) in zip(cases, pairs):
        write(*case, path)
    portable.run(target, binary, pairs)
    return [out for _, out in pairs]


def _quantize_cases(n: int) -> list[tuple]:
    """quantize_fixed's arguments (float32 keys: no ties between entries), every width, codebook or
    uniform levels, 0-3 outlier slots, head_dim 64/128/256, random ranges (as test_conformance)."""
    from kvq_ao.quant.codebook import nf_codebook
    from kvq_ao.quant.uniform import fixed_range

    cases = []
    for seed in range(n):
        g = torch.Generator().manual_seed(seed)
        bits, slots, d = [2, 3, 4, 8][seed % 4], seed % 4, [64, 128, 256][seed % 3]
        t = 1 + seed * 7 % 40
        x = torch.randn(2, 3, t, d, generator=g) * 2
        lo, hi = -1.5 - torch.rand(3, d, generator=g), 1.0 + torch.rand(3, d, generator=g)
        cb = nf_codebook(bits) if seed % 3 == 1 and bits <= 4 else torch.zeros(0)
        zero, scale = fixed_range(lo, hi, 1 if cb.numel() else 2**bits - 1, [torch.float16, torch.bfloat16][seed % 2])
        cases.append((x, bits, zero, scale, cb, lo, hi, slots))
    return cases


@pytest.mark.parametrize("name", ["generic", "avx2", "aarch64"])
def test_quantize_fixed_is_byte_identical_to_the_reference(built, name):
    """The one-token key append (quantize_core.h): codes, outlier slots and the clamped count, byte for byte."""
    from kvq_ao.kernels import reference

    cases = _quantize_cases(24)
    for i, (case, out) in enumerate(zip(cases, _run_cases(built, name, "quantize", cases, portable.write_quantize_case))):
        got = portable.read_quantize_output(out, case[0].shape, case[-1])
        want = reference.quantize_fixed(*case)
        assert int(got[3]) == int(want[3]), f"case {i}: clamped {int(got[3])} != {int(want[3])}"
        for field, a, b in zip(("codes", "out_val", "out_idx"), got[:3], want[:3]):
            assert torch.equal(a, b.to(a.dtype)), f"case {i}: {field} differs"


def _groups_cases(n: int) -> list[tuple]:
    """kvq.quantize's arguments (float32 x: no ties between entries): every width, codebook or
    uniform levels, per-token groups of 16/32/64 or per-channel blocks of 16 or one row for all
    positions, outliers none / by channel ranges / per vector, every scale dtype, magnitudes from
    float16-subnormal ranges to past float16's largest value."""
    from kvq_ao.format import AXIS_CHANNEL, AXIS_TOKEN, FLOAT_META, ONE_ROW, default_meta_exponent, format_ints, meta_ints
    from kvq_ao.quant.codebook import nf_codebook

    layouts = [(AXIS_TOKEN, 64), (AXIS_TOKEN, 16), (AXIS_CHANNEL, 16), (AXIS_TOKEN, 32), (AXIS_CHANNEL, ONE_ROW)]
    cases = []
    for seed in range(n):
        g = torch.Generator().manual_seed(seed)
        bits, (axis, group), d = [2, 3, 4, 8][seed % 4], layouts[seed % 5], [64, 128, 256][seed % 3]
        outliers = ["none", "channel", "vector"][seed % 3] if axis == AXIS_TOKEN else ["none", "channel"][seed % 2]
        magnitude = [1e-6, 1.0, 7e4, 3.0][seed % 4]
        t = 32 if group == 16 and axis == AXIS_CHANNEL else 1 + seed * 7 % 20
        x = torch.randn(2, 3, t, d, generator=g) * magnitude
        lo = hi = torch.zeros(0)
        if outliers == "channel":
            lo, hi = -magnitude * (1 + torch.rand(3, d, generator=g)), magnitude * (1 + torch.rand(3, d, generator=g))
        k = {"none": 0, "channel": 2, "vector": 1 + seed % 3}[outliers]
        cb = nf_codebook(bits) if seed % 2 and bits <= 4 else torch.zeros(0)
        scale_dtype = [torch.float16, torch.bfloat16, torch.float32][seed % 3]
        # every third case of per-token groups with 8-bit scale and zero (magnitudes 1e-6 and 7e4 fall outside its codes' span)
        meta = meta_ints(default_meta_exponent(bits, cb.numel() > 0)) if axis == AXIS_TOKEN and seed % 3 == 1 else FLOAT_META
        cases.append((x, format_ints(bits, axis, group, meta=meta), scale_dtype, cb, lo, hi, k))
    return cases


@pytest.mark.parametrize("name", ["generic", "avx2", "aarch64"])
def test_quantize_is_byte_identical_to_the_reference(built, name):
    """The append of every other format (quantize_core.h's quantize_groups, kvq.quantize): codes,
    scales, zeros, outlier slots and the clamped count, byte for byte."""
    from kvq_ao.kernels import reference

    cases = _groups_cases(30)
    for i, (case, out) in enumerate(zip(cases, _run_cases(built, name, "groups", cases, portable.write_groups_case))):
        want = reference.quantize(*case)
        got = portable.read_groups_output(out, case[0].shape, list(want[1].shape), want[1].dtype, case[-1])
        for field, a, b in zip(("codes", "scale", "zero", "out_val", "out_idx", "clamped"), got, want):
            assert a.shape == b.shape and torch.equal(a, b.to(a.dtype)), f"case {i}: {field} differs"
