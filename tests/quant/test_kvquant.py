"""KVQuant's parts: pre-RoPE keys, codebooks, dense-and-sparse outliers, calibration artifacts."""

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import kvquant_config, tiny_llama
from kvq_ao import KVQuantConfig, QuantSpec, make_cache, quantize_kv_
from kvq_ao.calibration import Calibration, calibrate, for_model, qnorm, weighted_kmeans_1d
from kvq_ao.quant.codebook import dequantize_codebook, nf_codebook, quantize_codebook
from kvq_ao.quant.outliers import apply_outliers, split_outliers, split_vector_outliers
from kvq_ao.quant.rope import rotate, unrotate
from kvq_ao.quant.uniform import AXIS_CHANNEL, AXIS_TOKEN, ONE_ROW, fixed_range

from attention_cases import attend, attention_case, dequantize, with_operand
from kvq_ao.format import FLOAT_BITS, format_ints
from kvq_ao.kernels.reference import dequantize_operand
from kvq_ao.ops import reference_arguments


# ----------------------------------------------------------------------------- pre-RoPE
def _hf_rotary(rope_parameters: dict):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, head_dim=64, max_position_embeddings=4096,
                      rope_parameters=rope_parameters)  # fmt: skip
    return LlamaRotaryEmbedding(cfg)


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 1024},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024},
], ids=lambda r: r["rope_type"])  # fmt: skip
def test_rotate_matches_transformers_rope_and_unrotate_inverts_it(rope):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rotary = _hf_rotary(rope)
    x = torch.randn(1, 2, 300, 64)
    positions = torch.randint(0, 4000, (300,))
    cos, sin = rotary(x, positions[None])
    _, want = apply_rotary_pos_emb(x, x, cos, sin)
    got = rotate(x, positions, rotary.inv_freq, rotary.attention_scaling)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(unrotate(want, positions, rotary.inv_freq, rotary.attention_scaling), x, rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), tq=st.sampled_from([1, 3]), bits=st.sampled_from([2, 3, 4]),
       body_end=st.integers(0, 64), codebook=st.booleans())  # fmt: skip
def test_dequantize_then_rotate_inside_the_op_equals_attending_rotated_keys(seed, tq, bits, body_end, codebook):
    """Pre-RoPE codes + rotation in the op == the op on explicitly rotated dequantized keys."""
    a = attention_case(seed, tq, bits, bits, body_end=body_end, codebook=codebook, pre_rope=True)
    g = torch.Generator().manual_seed(seed)
    a["side_pos"] = torch.tensor([0, *torch.randperm(63, generator=g)[:3].add(1).tolist(), -1])  # arbitrary positions
    out = attend(a)
    keys = dequantize_operand(reference_arguments(a)["k"], torch.float32)
    t = keys.shape[2]
    b = with_operand(a, "k", codes=rotate(keys, torch.arange(t), a["rope_inv_freq"], a["rope_scale"]),
                     side=rotate(a["k"].side, a["side_pos"].clamp(min=0), a["rope_inv_freq"], a["rope_scale"]),
                     bits=FLOAT_BITS, scale=None, zero=None, codebook=None, out_val=None, out_idx=None)  # fmt: skip
    b["rope_inv_freq"] = None
    want = attend(b)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_pre_rope_cache_in_full_precision_reproduces_the_model():
    """Keys un-rotated on the way in and rotated back in attention: the fp model's logits."""
    model = tiny_llama(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    ids = torch.randint(0, 128, (1, 70))
    with torch.no_grad():
        ref = model(ids).logits
    quantize_kv_(model, dataclasses.replace(KVQuantConfig.preset("fp"), pre_rope_keys=True, sink_tokens=1))
    for step in (1, 16, 70):
        cache = make_cache(model)
        with torch.no_grad():
            out = torch.cat([model(ids[:, i : i + step], cache=cache).logits for i in range(0, 70, step)], 1)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        keys, _ = cache.layers[0].keys_values()
        assert keys.pre_rope


# ----------------------------------------------------------------------------- codebooks
def test_nf_codebook_is_sorted_symmetric_and_spans_the_range():
    for bits in (2, 3, 4):
        cb = nf_codebook(bits)
        assert cb.numel() == 2**bits and cb[0] == 0 and cb[-1] == 1
        assert torch.all(cb[1:] > cb[:-1])
        torch.testing.assert_close(cb + cb.flip(0), torch.ones_like(cb))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), bits=st.sampled_from([2, 3, 4]), axis=st.sampled_from([AXIS_TOKEN, AXIS_CHANNEL]),
       group=st.sampled_from([8, 16]))  # fmt: skip
def test_codebook_quantization_picks_the_nearest_level(seed, bits, axis, group):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 32, 16, generator=g) * torch.rand(1, 3, 1, 16, generator=g).mul(5)
    cb = torch.sort(torch.rand(2**bits, generator=g))[0]
    cb[0], cb[-1] = 0.0, 1.0
    packed, scale, zero = quantize_codebook(x, cb, bits, axis, group)
    deq = dequantize_codebook(packed, scale, zero, cb, bits, axis, group, torch.float64)
    # float64 reference: each element's best level under the stored scale/zero
    rep = (lambda m: m.repeat_interleave(group, -1)) if axis == AXIS_TOKEN else (lambda m: m.repeat_interleave(group, -2))
    s, z = rep(scale.double()), rep(zero.double())
    candidates = z.unsqueeze(-1) + s.unsqueeze(-1) * cb.double()  # [..., levels]
    best = (candidates - x.double().unsqueeze(-1)).abs().amin(-1)
    err = (deq - x.double()).abs()
    assert torch.all(err <= best + 1e-5 * (x.abs().max() + 1))
    # the inductor form (levels by selects) gives the same values bit for bit
    by_select = dequantize_codebook(packed, scale, zero, cb, bits, axis, group, torch.float32, select_levels=True)
    assert torch.equal(by_select, dequantize_codebook(packed, scale, zero, cb, bits, axis, group, torch.float32))


def test_weighted_kmeans_finds_known_clusters_and_follows_the_weights():
    g = torch.Generator().manual_seed(0)
    centres = torch.tensor([0.1, 0.5, 0.9])
    u = (centres.repeat_interleave(1000) + torch.randn(3000, generator=g) * 0.01).clamp(0, 1)
    levels = weighted_kmeans_1d(u, torch.ones_like(u), 3)
    torch.testing.assert_close(levels, centres, atol=2e-3, rtol=0)
    # one uniform spread with all the weight on its upper part pulls the levels up
    v = torch.rand(5000, generator=g)
    plain = weighted_kmeans_1d(v, torch.ones_like(v), 4)
    heavy = weighted_kmeans_1d(v, torch.where(v > 0.5, 100.0, 1.0), 4)
    assert heavy.mean() > plain.mean() + 0.1


def test_qnorm_matches_mean_and_std():
    v = torch.rand(10000, generator=torch.Generator().manual_seed(0)) ** 2
    w = torch.ones_like(v)
    levels = qnorm(weighted_kmeans_1d(v, w, 4), v, w)
    q = levels[torch.bucketize(v, (levels[1:] + levels[:-1]) / 2)]
    assert abs(q.mean() - v.mean()) < 0.01 and abs(q.std() - v.std()) < 0.02


# ----------------------------------------------------------------------------- outliers
def _expected_slots(x: torch.Tensor, k: int) -> list[int]:
    """One vector's slot channels by the format's rule, in plain Python: its entries outside [-1, 1]
    by decreasing excess (the lower channel on a tie), then its lowest-numbered other channels."""
    row = x.tolist()
    excess = [max(v - 1, 0) + max(-1 - v, 0) for v in row]
    outliers = sorted((c for c in range(len(row)) if excess[c] > 0), key=lambda c: (-excess[c], c))
    others = [c for c in range(len(row)) if excess[c] == 0]
    return (outliers + others)[:k]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 4), heads=st.integers(1, 3), tokens=st.integers(1, 9),
       d=st.sampled_from([8, 64, 256]), spread=st.floats(0.5, 4.0))  # fmt: skip
def test_outlier_split_keeps_selected_entries_exactly_and_clamps_the_rest(seed, k, heads, tokens, d, spread):
    """Every slot holds an exact entry (no index is reserved for "empty", so head_dim 256 is
    addressable): a vector's outliers first, most extreme first, then its lowest other channels;
    outliers that did not fit are clamped and counted."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, heads, tokens, d, generator=g) * spread
    lo, hi = -torch.ones(heads, d), torch.ones(heads, d)
    dense, values, indices, clamped = split_outliers(x, lo, hi, k)
    outside = (x < -1) | (x > 1)
    assert indices.dtype == torch.uint8 and indices.shape == (*x.shape[:-1], k)
    flat_x, flat_idx = x.reshape(-1, d), indices.reshape(-1, k).long()
    for row, idx in zip(flat_x, flat_idx):
        assert idx.tolist() == _expected_slots(row, k)
    assert torch.equal(values, x.gather(-1, indices.long()))  # every slot exact
    assert int(clamped) == int((outside.sum(-1) - k).clamp(min=0).sum())
    assert dense.min() >= -1 and dense.max() <= 1
    restored = apply_outliers(dense, values, indices)
    kept_entry = torch.zeros_like(outside)
    for j in range(k):
        kept_entry |= torch.arange(d) == indices[..., j : j + 1].long()
    assert torch.equal(restored, torch.where(kept_entry, x, x.clamp(-1, 1)))  # kept exact, others clamped


def test_outlier_slots_reach_channel_255_and_refuse_wider_heads():
    """uint8 indices address channels 0-255: a head_dim-256 vector's outlier in its last channel
    comes back exact; head_dim 257 is refused by name."""
    from kvq_ao.quant.outliers import outlier_slots

    x = torch.zeros(1, 1, 1, 256)
    x[..., 255] = 9.0
    dense, values, indices, clamped = split_outliers(x, -torch.ones(1, 256), torch.ones(1, 256), 3)
    assert indices[0, 0, 0].tolist() == [255, 0, 1] and int(clamped) == 0
    assert apply_outliers(dense, values, indices)[..., 255].item() == 9.0
    assert outlier_slots(0.01, 256) == 3
    with pytest.raises(ValueError, match="head_dim <= 256"):
        outlier_slots(0.01, 257)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_quantize_op_with_outliers_reproduces_outliers_and_counts_overflow(bits):
    x = torch.randn(1, 2, 32, 64)
    x[0, 0, 3, :5] = 50.0  # five outliers in one vector, two slots
    x[0, 1, 7, 10] = -80.0
    lo, hi = -3 * torch.ones(2, 64), 3 * torch.ones(2, 64)
    codes, scale, zero, out_val, out_idx, clamped = torch.ops.kvq.quantize(
        x, format_ints(bits, AXIS_TOKEN, 32), torch.float16, nf_codebook(bits), lo, hi, 2
    )
    y = dequantize(torch.float32, codes=codes, scale=scale, zero=zero, codebook=nf_codebook(bits), out_val=out_val,
                   out_idx=out_idx, bits=bits, axis=AXIS_TOKEN, group=32)  # fmt: skip
    assert y[0, 1, 7, 10] == -80.0
    assert (y[0, 0, 3, :5] == 50.0).sum() == 2 and y[0, 0, 3, :5].max() == 50.0
    assert int(clamped) >= 3  # the other three 50s (plus any random entry beyond 3 sigma)


# ----------------------------------------------------------------------------- calibrated key ranges
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), bits=st.sampled_from([2, 3, 4, 8]), codebook=st.booleans(), slots=st.sampled_from([0, 1, 3]))
def test_fixed_range_quantization_against_float64(seed, bits, codebook, slots):
    """Each entry clamped into its channel's [lo, hi] lands on the level nearest to it in float64
    (uniform steps: within half a step; codebook: the nearest level), the up to `slots` entries per
    vector furthest outside their range come back exact, and the count of the others is reported."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 9, 64, generator=g) * 2
    lo, hi = -1.5 - torch.rand(3, 64, generator=g), 1.0 + torch.rand(3, 64, generator=g)
    cb = nf_codebook(bits) if codebook and bits <= 4 else torch.zeros(0)
    zero, scale = fixed_range(lo, hi, 1 if cb.numel() else 2**bits - 1, torch.float16)
    assert (zero.float() <= lo).all() and (zero.double() + scale.double() * (1 if cb.numel() else 2**bits - 1) >= hi.double()).all()
    codes, out_val, out_idx, clamped = torch.ops.kvq.quantize_fixed(x, bits, zero, scale, cb, lo, hi, slots)
    row = lambda m: m[None, :, None, :].expand(2, 3, 1, 64)  # noqa: E731  (the cache's one row per head)
    y = dequantize(torch.float64, codes=codes, scale=row(scale), zero=row(zero), codebook=cb, out_val=out_val, out_idx=out_idx,
                   bits=bits, axis=AXIS_CHANNEL, group=9)  # fmt: skip
    dense = torch.minimum(torch.maximum(x.double(), lo.double()[None, :, None]), hi.double()[None, :, None])
    z, s = zero.double()[None, :, None], scale.double()[None, :, None]
    levels = (cb.double() if cb.numel() else torch.arange(2**bits, dtype=torch.float64) / (2**bits - 1) * (2**bits - 1))
    grid = z.unsqueeze(-1) + s.unsqueeze(-1) * levels  # [1, H, 1, D, L]: every value a code can stand for
    nearest = (grid - dense.unsqueeze(-1)).abs().min(-1).values
    outside = (x < lo[None, :, None]) | (x > hi[None, :, None])
    exact = torch.zeros_like(outside)
    for j in range(slots):
        exact |= torch.arange(64) == out_idx[..., j : j + 1].long()
    # every slot holds an entry (distinct channels): the vector's outliers first, as many as fit
    assert torch.equal(exact.sum(-1), torch.full_like(exact.sum(-1), slots))
    assert torch.equal((exact & outside).sum(-1), outside.sum(-1).clamp(max=slots))
    assert torch.equal(y[exact], x.double()[exact])
    err = (y - dense).abs()[~exact]
    rounding = 2.0**-22 * (z.abs() + dense.abs())  # float32 (dense - zero) / scale: a few ulps of the operands
    assert (err <= (nearest + rounding)[~exact]).all()  # the nearest level, up to float32 rounding at a midpoint
    assert int(clamped) == int((outside & ~exact).sum())


def test_fixed_range_op_checks_its_arguments_and_fake_kernel():
    x, lo, hi = torch.randn(1, 2, 4, 64), -torch.ones(2, 64), torch.ones(2, 64)
    zero, scale = fixed_range(lo, hi, 7, torch.float16)
    with pytest.raises(ValueError, match=r"fixed ranges need zero as \[heads, head_dim\]"):
        torch.ops.kvq.quantize_fixed(x, 3, zero[:1], scale, torch.zeros(0), lo, hi, 0)
    with pytest.raises(ValueError, match="bits must be one of"):
        torch.ops.kvq.quantize_fixed(x, 5, zero, scale, torch.zeros(0), lo, hi, 0)
    torch.library.opcheck(torch.ops.kvq.quantize_fixed.default, (x, 3, zero, scale, nf_codebook(3), lo, hi, 1))


def test_calibrated_ranges_are_each_channels_thresholds_or_min_max_without_the_sink():
    """Ranges come from the calibration activations past the sink tokens: the outlier quantiles with
    outliers, each channel's min/max without (a sink token's extreme keys would set them otherwise)."""
    from kvq_ao.calibration import channel_thresholds, collect

    model = tiny_llama()
    ids = torch.randint(3, 128, (4, 64), generator=torch.Generator().manual_seed(1))
    acts = collect(model, ids, pre_rope=True, progress=False)
    for outliers in (0.0, 0.02):
        cfg = kvquant_config(bits=3, outliers=outliers, key_ranges="calibrated", sink=1)
        calib = Calibration.load(cfg.calibration)
        for i in range(2):
            lo, hi = channel_thresholds(acts.keys[i][:, :, 1:], outliers)
            torch.testing.assert_close(calib.layer(i)[0].lo, lo)
            torch.testing.assert_close(calib.layer(i)[0].hi, hi)
        if not outliers:  # each channel's extremes, moved outward by the thresholds' tiny margin
            x, (lo, hi) = acts.keys[1][:, :, 1:], (calib.layer(1)[0].lo, calib.layer(1)[0].hi)
            assert torch.allclose(lo, x.amin((0, 2)), atol=1e-3) and torch.allclose(hi, x.amax((0, 2)), atol=1e-3)
            assert (lo < x.amin((0, 2))).all() and (hi > x.amax((0, 2))).all()


@pytest.mark.parametrize("side_dtype", ["float16", "bfloat16"])
def test_a_16_bit_side_store_is_what_every_path_reads_and_is_counted(side_dtype):
    """side_dtype: the sink and window of a float32 model held in 16 bits. Token by token (static,
    compile/export's path) and dynamic caches store identical bytes, the memory report counts the
    halved side store, and attention reads exactly the rounded values."""
    model = tiny_llama()
    cfg = dataclasses.replace(kvquant_config(bits=3, outliers=0.02, key_ranges="calibrated"), side_dtype=side_dtype,
                              residual_length=8)  # fmt: skip
    assert KVQuantConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    quantize_kv_(model, cfg)
    ids = torch.randint(3, 128, (1, 50), generator=torch.Generator().manual_seed(4))
    dyn, static = step_dynamic_and_static(model, ids, max_cache_len=64)
    for x, y in zip(dyn.layers, static.layers):
        assert x.side_k.dtype == getattr(torch, side_dtype) and torch.equal(x.side_k, y.side_k) and torch.equal(x.side_v, y.side_v)
        assert torch.equal(x.k_body.codes[:, :, :64], y.k_body.codes) and torch.equal(x.v_body.codes[:, :, :64], y.v_body.codes)
    assert dyn.memory_report().bytes == dyn.tensor_bytes()
    full = dataclasses.replace(cfg, side_dtype="model")
    quantize_kv_(model, full)
    float32_side = make_cache(model)
    with torch.no_grad():
        model(ids, cache=float32_side)
    halved = sum(t.numel() * 2 for layer in dyn.layers for t in (layer.side_k, layer.side_v))
    assert float32_side.tensor_bytes() - dyn.tensor_bytes() == halved
    with pytest.raises(ValueError, match="side_dtype must be one of"):
        dataclasses.replace(cfg, side_dtype="float8")


def test_calibrated_key_ranges_hold_no_block_in_float_keep_their_ranges_on_reset_and_count_their_bytes():
    model = tiny_llama()
    cfg = kvquant_config(bits=3, outliers=0.02, key_ranges="calibrated")
    quantize_kv_(model, cfg)
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(2))
    cache = make_cache(model)
    with torch.no_grad():
        first = model(ids, cache=cache).logits
    layer = cache.layers[0]
    assert layer.ring == cfg.residual_length + 1 and int(layer.body_end) == 100  # every token already coded
    assert layer.k_body.scale.shape[2] == 1 and layer.k_body.op_format()[2] == ONE_ROW  # the same format at any capacity
    assert cache.memory_report().bytes == cache.tensor_bytes()
    ranges = layer.k_body.scale.clone(), layer.k_body.zero.clone()
    cache.reset()
    assert torch.equal(layer.k_body.scale, ranges[0]) and torch.equal(layer.k_body.zero, ranges[1])
    assert not layer.k_body.codes.any()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, cache=cache).logits, first, rtol=0, atol=0)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 5), heads=st.integers(1, 3), tokens=st.integers(1, 9),
       shape=st.sampled_from([(8, 4), (8, 8), (64, 32), (64, 16)]), spread=st.floats(0.5, 30.0))  # fmt: skip
def test_vector_outliers_are_the_entries_furthest_from_the_mean_kept_exactly(seed, k, heads, tokens, shape, spread):
    d, group = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, heads, tokens, d, generator=g)
    x = torch.where(torch.rand(x.shape, generator=g) < 0.05, x * spread, x)  # a few heavy entries
    dense, values, indices, is_outlier = split_vector_outliers(x, k, group)
    assert values.shape == indices.shape == (2, heads, tokens, k) and is_outlier.sum(-1).eq(k).all()
    far = (x - x.mean(-1, keepdim=True)).abs()
    kth = far.topk(k, -1).values[..., -1:]
    assert (far[is_outlier] >= kth.expand_as(far)[is_outlier]).all()  # no kept entry is nearer than one left
    assert torch.equal(values, x.gather(-1, indices.long()))
    assert torch.equal(apply_outliers(dense, values, indices), x)  # restored exactly
    # the dense part never widens a group, and the non-outliers are untouched
    gx, gd, gm = (t.reshape(2, heads, tokens, d // group, group) for t in (x, dense, is_outlier))
    assert torch.equal(gd[~gm], gx[~gm])
    assert (gd.amax(-1) <= gx.amax(-1)).all() and (gd.amin(-1) >= gx.amin(-1)).all()
    rest_hi = torch.where(gm, -torch.inf, gx).amax(-1)
    rest_lo = torch.where(gm, torch.inf, gx).amin(-1)
    partly = ~gm.all(-1)  # a group made only of outliers keeps its own range
    assert torch.equal(gd.amax(-1)[partly], rest_hi[partly]) and torch.equal(gd.amin(-1)[partly], rest_lo[partly])


def test_quantize_op_with_vector_outliers_needs_no_thresholds_and_only_the_token_axis():
    x = torch.randn(1, 2, 32, 64)
    x[0, 0, 3, 5], x[0, 1, 7, 10] = 50.0, -80.0
    empty = torch.zeros(0)
    codes, scale, zero, out_val, out_idx, clamped = torch.ops.kvq.quantize(x, format_ints(3, AXIS_TOKEN, 32), torch.float16, nf_codebook(3), empty, empty, 1)
    y = dequantize(torch.float32, codes=codes, scale=scale, zero=zero, codebook=nf_codebook(3), out_val=out_val,
                   out_idx=out_idx, bits=3, axis=AXIS_TOKEN, group=32)  # fmt: skip
    assert y[0, 0, 3, 5] == 50.0 and y[0, 1, 7, 10] == -80.0 and int(clamped) == 0
    # the outlier no longer sets its group's range: the rest of that vector is quantized finely
    plain = torch.ops.kvq.quantize(x, format_ints(3, AXIS_TOKEN, 32), torch.float16, nf_codebook(3), empty, empty, 0)
    y0 = dequantize(torch.float32, codes=plain[0], scale=plain[1], zero=plain[2], codebook=nf_codebook(3), out_val=plain[3],
                    out_idx=plain[4], bits=3, axis=AXIS_TOKEN, group=32)  # fmt: skip
    assert (y - x)[0, 0, 3].abs().max() < (y0 - x)[0, 0, 3].abs().max() / 4
    with pytest.raises(ValueError, match="per-vector outliers .* per-token axis"):
        torch.ops.kvq.quantize(x, format_ints(3, AXIS_CHANNEL, 32), torch.float16, nf_codebook(3), empty, empty, 1)
    with pytest.raises(ValueError, match="outlier_rule 'vector' needs axis 'token'"):
        QuantSpec(3, "channel", 32, "nuq", 0.01, "vector")
    with pytest.raises(ValueError, match="outlier_rule must be one of"):
        QuantSpec(3, "token", 32, "nuq", 0.01, "sometimes")
    assert not QuantSpec(3, "token", 32, "int", 0.01, "vector").needs_calibration  # judged online
    assert QuantSpec(3, "token", 32, "int", 0.01, "channel").needs_calibration
    spec = QuantSpec(2, "token", 32, "nuq", 0.01, "vector")
    assert QuantSpec.from_dict(spec.to_dict()) == spec and "outlier_rule" not in QuantSpec(2, "token", 32, "nuq", 0.01).to_dict()


# ----------------------------------------------------------------------------- calibration artifacts
@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    cfg = kvquant_config(bits=3, outliers=0.02, folder=tmp_path_factory.mktemp("calib"))
    return cfg, Calibration.load(cfg.calibration)


def test_calibration_round_trip_is_bit_identical(artifact, tmp_path):
    cfg, calib = artifact
    again = Calibration.load(calib.save(tmp_path / "copy.json"))
    assert calib.tensors.keys() == again.tensors.keys() and len(calib.tensors) == 2 * 2 * 3  # 2 layers x K/V x (codebook, lo, hi)
    for name, t in calib.tensors.items():
        assert torch.equal(t, again.tensors[name]) and t.dtype == again.tensors[name].dtype, name
    assert again.meta["config"] == cfg.to_dict() | {"calibration": None}


def test_calibration_for_another_model_is_rejected(artifact):
    cfg, _ = artifact
    for other, what in ((tiny_llama(layers=3), "3 layers"), (tiny_llama(head_dim=32), "head_dim 32")):
        with pytest.raises(ValueError, match=f"not for this model.*{what}"):
            for_model(other, cfg)


def test_calibration_for_another_config_is_rejected(artifact):
    cfg, _ = artifact
    other = dataclasses.replace(cfg, sink_tokens=0)
    with pytest.raises(ValueError, match="was made for config"):
        for_model(tiny_llama(), other)


def test_calibration_serves_a_config_that_only_stores_outliers_in_another_dtype(artifact):
    """The fit (codebooks, thresholds) does not depend on what outlier values are stored in."""
    cfg, calib = artifact
    half = dataclasses.replace(cfg.default, key=dataclasses.replace(cfg.default.key, outlier_dtype="bfloat16"))
    assert calib.made_for(dataclasses.replace(cfg, default=half), 2)
    assert not calib.made_for(dataclasses.replace(cfg, default=dataclasses.replace(half, key=dataclasses.replace(half.key, bits=4))), 2)


def test_corrupt_or_truncated_calibration_is_rejected(artifact, tmp_path):
    cfg, calib = artifact
    path = calib.save(tmp_path / "c.json")
    tensors = path.parent / json.loads(path.read_text())["tensors_file"]
    data = tensors.read_bytes()
    tensors.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        Calibration.load(path)
    tensors.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        Calibration.load(path)
    path.write_text(path.read_text()[:40])
    with pytest.raises(ValueError, match="corrupt calibration metadata"):
        Calibration.load(path)
    path.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="not a kvq_ao calibration"):
        Calibration.load(path)


def test_a_config_that_needs_calibration_says_so():
    cfg = dataclasses.replace(kvquant_config(bits=3, outliers=0.02, dtype="int"), calibration=None)
    from kvq_ao.cache import QuantizedKVCache

    with pytest.raises(ValueError, match="pass calibration="):
        QuantizedKVCache(cfg, 2)
    with pytest.raises(ValueError, match="needs a tokenizer|pass token ids"):
        calibrate(tiny_llama(), "some text", cfg)


# ----------------------------------------------------------------------------- through the cache
def step_dynamic_and_static(model, ids: torch.Tensor, max_cache_len: int):
    """Feed ids one token at a time through a dynamic and a static cache (compile/export's path);
    check the logits agree and return both caches for byte-level checks."""
    dyn, static = make_cache(model), make_cache(model, max_cache_len=max_cache_len)
    with torch.no_grad():
        a = torch.cat([model(ids[:, i : i + 1], cache=dyn).logits for i in range(ids.shape[1])], 1)
        b = torch.cat([model(ids[:, i : i + 1], cache=static).logits for i in range(ids.shape[1])], 1)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    return dyn, static


@pytest.mark.parametrize("dtype, outliers, rule, ranges", [("nuq", 0.02, "channel", "online"), ("nuq", 0.02, "vector", "online"),
                                                          ("nf", 0.0, "channel", "online"), ("int", 0.02, "channel", "online"),
                                                          ("nuq", 0.02, "vector", "calibrated"), ("int", 0.0, "channel", "calibrated")])  # fmt: skip
def test_static_one_token_path_equals_dynamic_path_with_kvquant_datatypes(dtype, outliers, rule, ranges):
    model = tiny_llama()
    cfg = kvquant_config(bits=3, outliers=outliers, dtype=dtype, value_outlier_rule=rule, key_ranges=ranges)
    quantize_kv_(model, cfg)
    ids = torch.randint(0, 128, (1, 120))
    dyn, static = step_dynamic_and_static(model, ids, max_cache_len=128)
    for x, y in zip(dyn.layers, static.layers):
        assert int(x.body_end) == int(y.body_end) > 0
        for p, q in zip(x.k_body.tensors() + x.k_body.sparse() + x.v_body.sparse(), y.k_body.tensors() + y.k_body.sparse() + y.v_body.sparse()):
            assert torch.equal(p[:, :, : q.shape[2]], q)
    assert dyn.clamped_outliers == static.clamped_outliers


def test_evaluate_reports_the_clamped_outlier_fractions_the_cache_counted():
    """`kvq eval` reports how many outliers did not fit their vector's slots, per kind, as a
    fraction of all cached entries: the counts of caches fed the same windows, divided out here."""
    from kvq_ao.eval import evaluate
    from kvq_ao.model_info import model_dims

    model = tiny_llama()
    cfg = kvquant_config(bits=3, outliers=0.02)  # one slot per vector, 2% of entries past the thresholds
    windows = torch.randint(3, 128, (2, 65), generator=torch.Generator().manual_seed(3))
    result = evaluate(model, windows, cfg, chunk=16, progress=False)
    keys = values = 0
    for row in windows:
        cache = make_cache(model, cfg)
        with torch.no_grad():
            for start in range(0, 65, 16):
                model(row[None, start : start + 16], cache=cache)
        keys, values = keys + cache.clamped_by_kind[0], values + cache.clamped_by_kind[1]
    layers, heads, head_dim = model_dims(model)
    entries = 2 * 65 * layers * heads * head_dim
    assert keys > 0 and values > 0  # some vectors really overflowed
    assert (result.clamped_key_outliers, result.clamped_value_outliers) == (keys / entries, values / entries)
    assert cache.clamped_outliers == sum(cache.clamped_by_kind)


def test_more_key_outlier_slots_clamp_fewer_outliers_and_are_counted_in_memory():
    """`max_outliers` gives each key vector more room: the cache holds that many slots, fewer
    outliers are clamped for want of one, and the memory estimate counts the extra slots."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 128), generator=torch.Generator().manual_seed(5))
    clamped, held = {}, {}
    for slots in (None, 3):
        cfg = kvquant_config(bits=3, outliers=0.01, key_slots=slots)  # ceil(1% of 64) = 1 slot by default
        quantize_kv_(model, cfg)
        cache = make_cache(model)
        with torch.no_grad():
            model(ids, cache=cache)
        assert {layer.k_body.out_val.shape[-1] for layer in cache.layers} == {slots or 1}
        assert {layer.v_body.out_val.shape[-1] for layer in cache.layers} == {1}
        clamped[slots], held[slots] = cache.clamped_by_kind[0], cache.tensor_bytes()
        assert abs(cache.memory_report().bytes - held[slots]) / held[slots] < 0.01
    assert 0 <= clamped[3] < clamped[None] and held[3] > held[None]


def test_kvquant_cache_is_closer_to_fp_with_more_bits_and_memory_formula_holds():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 256))
    with torch.no_grad():
        ref = model(ids).logits
    errors = {}
    for bits in (2, 4):
        cfg = kvquant_config(bits=bits, outliers=0.02)
        quantize_kv_(model, cfg)
        cache = make_cache(model)
        with torch.no_grad():
            out = torch.cat([model(ids[:, i : i + 64], cache=cache).logits for i in range(0, 256, 64)], 1)
        errors[bits] = (out - ref).abs().max().item()
        held, report = cache.tensor_bytes(), cache.memory_report()
        assert abs(report.bytes - held) / held < 0.01
    assert 0 < errors[4] < errors[2]


def test_auto_calibration_is_made_on_first_use_under_no_grad_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("KVQ_AO_CACHE", str(tmp_path))
    model = tiny_llama()
    model.kvq_tokenizer = _WordTokenizer()
    cfg = dataclasses.replace(kvquant_config(bits=3, outliers=0.02, model=model), calibration="auto", name="tiny-auto")
    quantize_kv_(model, cfg)
    messages = []
    monkeypatch.setattr("kvq_ao.calibration.sys.stderr", type("W", (), {"write": lambda self, m: messages.append(m), "flush": lambda self: None})())
    with torch.no_grad():  # as in evaluate() and generate()
        make_cache(model)
    written = list(tmp_path.rglob("tiny-auto.json"))
    assert len(written) == 1 and any("calibrating" in m for m in messages)
    messages.clear()
    other = tiny_llama()  # a fresh model object: found on disk, not recalibrated
    quantize_kv_(other, cfg)
    make_cache(other)
    assert not any("calibrating" in m for m in messages)
    # The same name with another layout (a preset changed between versions): remade, not refused.
    moved = dataclasses.replace(cfg, sink_tokens=cfg.sink_tokens + 2)
    other.kvq_tokenizer = model.kvq_tokenizer
    quantize_kv_(other, moved)
    make_cache(other)
    assert any("another layout" in m for m in messages)
    assert Calibration.load(written[0]).made_for(moved, other.config.num_hidden_layers)
    with pytest.raises(ValueError, match="sink_tokens differ"):  # an explicit path stays strict
        make_cache(other, dataclasses.replace(cfg, calibration=str(written[0])))


class _WordTokenizer:
    """Enough of a tokenizer for calibration text: hashes words into the tiny vocabulary."""

    def __call__(self, text, return_tensors=None):
        ids = torch.tensor([[hash(w) % 125 + 3 for w in text.split()]])
        return type("Enc", (), {"input_ids": ids})()


def test_per_vector_outliers_take_the_lower_channel_first_on_a_tie():
    """Equally distant entries are picked lowest channel first (the kernels' rule; torch.topk leaves
    the order of ties unspecified, and the reference once disagreed with every kernel on it)."""
    x = torch.zeros(2, 3, 64)
    x[..., 5:64:7] = 4.0  # channels 5, 12, 19, ...: all equally far from the vector's mean
    x[1, 2, 40] = -9.0  # one farther: first, then the ties in channel order
    _, values, indices, _ = split_vector_outliers(x, 3, 64)
    assert indices[0, 0].tolist() == [5, 12, 19] and indices[1, 2].tolist() == [40, 5, 12]
    assert values[1, 2].tolist() == [-9.0, 4.0, 4.0]
