"""QuantizedKVCache: the cache really is read, both update paths agree, memory is what is held."""

import dataclasses

import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_llama
from kvq_ao.api import make_cache, quantize_kv_
from kvq_ao.config import KVQuantConfig, LayerKV, QuantSpec
from kvq_ao.memory import estimate


def _run(model, ids, cache, step):
    with torch.no_grad():
        return torch.cat([model(ids[:, i : i + step], cache=cache).logits for i in range(0, ids.shape[1], step)], 1)


def test_fp_config_reproduces_the_plain_model(tiny_model):
    ids = torch.randint(0, 128, (1, 90))
    with torch.no_grad():
        ref = tiny_model(ids).logits
    quantize_kv_(tiny_model, KVQuantConfig.preset("fp"))
    for step in (1, 16, 90):
        torch.testing.assert_close(_run(tiny_model, ids, make_cache(tiny_model), step), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", ["int8", "int4-token", "kivi-4", "kivi-3", "kivi-2"])
@pytest.mark.parametrize("sink, residual", [(0, None), (1, 16), (3, 0)])
def test_static_one_token_path_equals_dynamic_path(tiny_model, preset, sink, residual):
    cfg = KVQuantConfig.preset(preset)
    cfg = dataclasses.replace(cfg, sink_tokens=sink, residual_length=cfg.residual_length if residual is None else residual)
    quantize_kv_(tiny_model, cfg)
    ids = torch.randint(0, 128, (1, 200))
    dyn, static = make_cache(tiny_model), make_cache(tiny_model, max_cache_len=224)
    out_dyn = _run(tiny_model, ids, dyn, 1)
    out_static = _run(tiny_model, ids, static, 1)
    torch.testing.assert_close(out_static, out_dyn, rtol=1e-5, atol=1e-5)
    for a, b in zip(dyn.layers, static.layers):
        assert torch.equal(a.body_end, b.body_end)
        for x, y in zip(a.k_body.tensors() + a.v_body.tensors(), b.k_body.tensors() + b.v_body.tensors()):
            assert torch.equal(x[:, :, : y.shape[2]] if x.dim() == 4 else x, y)


def test_quantized_cache_changes_the_output_and_more_bits_change_it_less(tiny_model):
    ids = torch.randint(0, 128, (1, 160))
    with torch.no_grad():
        ref = tiny_model(ids).logits
    errors = {}
    for preset in ("int8", "int4-token"):
        quantize_kv_(tiny_model, KVQuantConfig.preset(preset))
        errors[preset] = (_run(tiny_model, ids, make_cache(tiny_model), 32) - ref).abs().max().item()
    assert 0 < errors["int8"] < errors["int4-token"]


def test_prefill_then_decode_keeps_the_body_identical_for_the_first_layer(tiny_model):
    quantize_kv_(tiny_model, dataclasses.replace(KVQuantConfig.preset("kivi-2"), residual_length=8, sink_tokens=1))
    ids = torch.randint(0, 128, (1, 150))
    a, b = make_cache(tiny_model), make_cache(tiny_model)
    _run(tiny_model, ids, a, 1)
    _run(tiny_model, ids, b, 37)
    la, lb = a.layers[0], b.layers[0]  # layer 0's K/V do not depend on attention outputs
    assert torch.equal(la.k_body.codes, lb.k_body.codes) and torch.equal(la.v_body.scale, lb.v_body.scale)


def test_static_cache_refuses_to_overflow(tiny_model):
    quantize_kv_(tiny_model, KVQuantConfig.preset("int8"))
    cache = make_cache(tiny_model, max_cache_len=64)
    _run(tiny_model, torch.randint(0, 128, (1, 60)), cache, 60)
    with pytest.raises(ValueError, match="static KV cache overflow: 70 tokens requested .* max_cache_len=64"):
        _run(tiny_model, torch.randint(0, 128, (1, 10)), cache, 10)
    with pytest.raises(ValueError, match="static KV cache overflow"):
        _run(tiny_model, torch.randint(0, 128, (1, 8)), cache, 1)


@pytest.mark.parametrize("kv_heads", [1, 4])  # MQA and MHA (the default fixture is GQA)
def test_mqa_and_mha_match_the_fp_model_in_fp_mode(kv_heads):
    model = tiny_llama(kv_heads=kv_heads)
    ids = torch.randint(0, 128, (1, 50))
    with torch.no_grad():
        ref = model(ids).logits
    quantize_kv_(model, KVQuantConfig.preset("fp"))
    torch.testing.assert_close(_run(model, ids, make_cache(model), 1), ref, rtol=1e-5, atol=1e-5)


def test_sliding_window_model_matches_transformers_cache():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=24)  # fmt: skip
    model = MistralForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (1, 80))
    ref = _run(model, ids, DynamicCache(config=model.config), 1)
    quantize_kv_(model, KVQuantConfig.preset("fp"))
    torch.testing.assert_close(_run(model, ids, make_cache(model), 1), ref, rtol=1e-5, atol=1e-5)
    quantize_kv_(model, KVQuantConfig.preset("int8"))
    assert (_run(model, ids, make_cache(model), 1) - ref).abs().max() < 0.05


def test_batched_left_padding_matches_unpadded_rows():
    model = tiny_llama(seed=1)
    g = torch.Generator().manual_seed(1)
    short, long = torch.randint(3, 128, (1, 20), generator=g), torch.randint(3, 128, (1, 28), generator=g)
    batch = torch.cat([torch.cat([torch.zeros(1, 8, dtype=torch.long), short], 1), long])
    mask = torch.cat([torch.cat([torch.zeros(1, 8), torch.ones(1, 20)], 1), torch.ones(1, 28)]).long()

    def both():
        with torch.no_grad():
            out = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False)
            alone = model.generate(short, attention_mask=torch.ones_like(short), max_new_tokens=6, do_sample=False)
        return out[0, -6:], alone[0, -6:]

    plain = both()
    assert torch.equal(*plain)  # the reference itself is padding-invariant on this input
    for preset in ("fp", "int4-token"):
        quantize_kv_(model, KVQuantConfig.preset(preset))
        padded, alone = both()
        assert torch.equal(padded, alone), preset


@pytest.mark.parametrize("preset", ["fp", "int8", "int4-token", "kivi-4", "kivi-3", "kivi-2"])
def test_memory_formula_matches_bytes_actually_held(preset):
    model = tiny_llama(layers=2)
    cfg = dataclasses.replace(KVQuantConfig.preset(preset), sink_tokens=0 if preset == "fp" else 1)
    quantize_kv_(model, cfg)
    cache = make_cache(model)
    _run(model, torch.randint(0, 128, (1, 4096)), cache, 1024)
    held = cache.tensor_bytes()
    report = cache.memory_report()
    assert abs(report.bytes - held) / held < 0.01
    print(f"{preset}: {report}")


@pytest.mark.parametrize("outlier_dtype", ["model", "float16"])
def test_memory_formula_counts_outlier_slots_in_their_dtype(outlier_dtype):
    """Outlier values stored in float16 in a float32 model: 3 bytes a slot with the index, not 5,
    in the report and in the bytes held; the cache still reads them back (within float16)."""
    model = tiny_llama(layers=2)
    value = QuantSpec(3, "token", 32, outliers=0.05, outlier_rule="vector", outlier_dtype=outlier_dtype)
    cfg = KVQuantConfig(default=LayerKV(QuantSpec(4, "channel", 32), value), sink_tokens=1, residual_length=16)
    quantize_kv_(model, cfg)
    cache = make_cache(model)
    _run(model, torch.randint(0, 128, (1, 1024)), cache, 256)
    held = cache.tensor_bytes()
    assert abs(cache.memory_report().bytes - held) / held < 0.01
    out_val = cache.layers[0].v_body.out_val
    assert out_val.dtype == (torch.float16 if outlier_dtype == "float16" else torch.float32)
    assert out_val.abs().sum() > 0  # slots were filled


def test_kivi2_memory_at_4096_tokens_on_smollm2_shape_by_hand():
    rep = estimate(KVQuantConfig.preset("kivi-2"), num_layers=30, kv_heads=3, head_dim=64, tokens=4096)
    heads, t, d = 3, 4096, 64
    codes = 2 * heads * t * d * 2 // 8
    key_meta = 2 * heads * (t // 32) * d * 2  # per-channel: scale + zero per 32 tokens, fp16
    value_meta = 2 * heads * t * (d // 32) * 2  # per-token: scale + zero per 32 channels, fp16
    side = 2 * heads * (128 + 32) * d * 4 + (128 + 32) * 8 + 8  # fp32 window + int64 positions + body_end
    assert rep.bytes == 30 * (codes + key_meta + value_meta + side)
    print(f"kivi-2 at 4096 tokens on SmolLM2: {rep}")


@pytest.mark.parametrize("static", [False, True])
def test_reorder_cache_moves_body_side_store_and_outliers_together(tiny_model, static):
    """Beam search's reorder: every row's logical keys/values (body codes, scales, outliers and
    the full-precision side store) must follow beam_idx, read back through dequantize()."""
    quantize_kv_(tiny_model, dataclasses.replace(KVQuantConfig.preset("kivi-2"), residual_length=8, sink_tokens=1))
    cache = make_cache(tiny_model, max_cache_len=96) if static else make_cache(tiny_model)
    ids = torch.randint(0, 128, (3, 80), generator=torch.Generator().manual_seed(0))
    _run(tiny_model, ids, cache, 16)
    before = [tuple(t.dequantize() for t in layer.keys_values()) for layer in cache.layers]
    assert all(int(layer.body_end) > 0 for layer in cache.layers)  # codes are really read
    beam_idx = torch.tensor([2, 0, 0])
    cache.reorder_cache(beam_idx)
    for layer, (k, v) in zip(cache.layers, before):
        k2, v2 = (t.dequantize() for t in layer.keys_values())
        assert torch.equal(k2, k[beam_idx]) and torch.equal(v2, v[beam_idx])
    # and the reordered cache keeps working: the next token's logits equal a cache built from reordered rows
    fresh = make_cache(tiny_model, max_cache_len=96) if static else make_cache(tiny_model)
    _run(tiny_model, ids[beam_idx], fresh, 16)
    nxt = torch.randint(0, 128, (3, 1), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_run(tiny_model, nxt, cache, 1), _run(tiny_model, nxt, fresh, 1), rtol=0, atol=0)


@pytest.mark.parametrize("num_beams", [2, 4])
def test_beam_search_with_the_window_holding_everything_equals_the_fp_cache(tiny_model, num_beams):
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(2))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, num_beams=num_beams,
              num_return_sequences=num_beams)  # fmt: skip
    with torch.no_grad():
        fp = tiny_model.generate(ids, **kw)
        quantize_kv_(tiny_model, KVQuantConfig.preset("kivi-4"))  # 30 tokens < its 128-token window: nothing quantized
        quantized = tiny_model.generate(ids, **kw)
    assert torch.equal(quantized, fp)


def test_batch_repeat_and_select_keep_every_tensor_with_a_batch_axis_in_step(tiny_model):
    """transformers expands a cache's batch (assisted/contrastive decoding) and drops rows; every
    batch-axis tensor, empty outlier slots included, must follow, and decoding must go on."""
    quantize_kv_(tiny_model, dataclasses.replace(KVQuantConfig.preset("kivi-2"), residual_length=8, sink_tokens=1))
    ids = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(3))
    cache = make_cache(tiny_model)
    _run(tiny_model, ids, cache, 16)
    before = [tuple(t.dequantize() for t in layer.keys_values()) for layer in cache.layers]
    cache.batch_repeat_interleave(3)
    for layer, (k, v) in zip(cache.layers, before):
        assert all(t.shape[0] == 3 for owner, name in layer._batch_tensors() for t in [getattr(owner, name)])
        assert layer.k_body.out_val.shape[0] == 3  # empty (no outliers) but still batched
        k3, v3 = (t.dequantize() for t in layer.keys_values())
        assert torch.equal(k3, k.expand(3, -1, -1, -1)) and torch.equal(v3, v.expand(3, -1, -1, -1))
    cache.batch_select_indices(torch.tensor([0, 2]))
    nxt = torch.randint(0, 128, (2, 1), generator=torch.Generator().manual_seed(4))
    fresh = make_cache(tiny_model)
    _run(tiny_model, ids.expand(2, -1), fresh, 16)
    # batch 2 prefill vs batch 1 expanded: GEMMs of another batch size differ in the last bits
    torch.testing.assert_close(_run(tiny_model, nxt, cache, 1), _run(tiny_model, nxt, fresh, 1), rtol=1e-5, atol=1e-5)
