"""quantize_kv_ and the torchao entry point: generate uses the quantized cache; bad models fail clearly."""

import math

import pytest
import torch
from torchao.quantization import quantize_

from conftest import tiny_llama
from kvq_ao import KVQuantConfig, LayerKV, QuantizedKVCache, QuantSpec, make_cache, quantize_kv_


def _generate(model, ids, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, **kw)


def test_generate_builds_and_reads_a_quantized_cache(tiny_model, monkeypatch):
    ids = torch.randint(3, 128, (1, 40))
    quantize_kv_(tiny_model, KVQuantConfig.preset("int4-token"))
    calls = []
    for name in ("decode_attention", "chunk_attention"):
        real = getattr(torch.ops.kvq, name)
        monkeypatch.setattr(torch.ops.kvq, name, lambda real=real, **a: calls.append(a["q"].shape) or real(**a))
    out = _generate(tiny_model, ids, return_dict_in_generate=True)
    assert isinstance(out.cache, QuantizedKVCache)
    assert len(calls) == 2 * 12  # 2 layers x (prefill + 11 decode steps)
    assert out.cache.layers[0].k_body.codes.dtype == torch.uint8


def test_explicit_static_and_dynamic_caches_give_the_same_tokens(tiny_model):
    ids = torch.randint(3, 128, (1, 40))
    quantize_kv_(tiny_model, KVQuantConfig.preset("kivi-2"))
    implicit = _generate(tiny_model, ids)
    dynamic = _generate(tiny_model, ids, cache=make_cache(tiny_model))
    static = _generate(tiny_model, ids, cache=make_cache(tiny_model, max_cache_len=64))
    via_config = _generate(tiny_model, ids, cache_implementation="static")
    assert torch.equal(implicit, dynamic) and torch.equal(dynamic, static) and torch.equal(static, via_config)


def test_torchao_quantize_accepts_the_config():
    model = tiny_llama()
    cfg = KVQuantConfig.preset("int8")
    quantize_(model, cfg, filter_fn=lambda module, fqn: fqn == "")
    assert model.kvq_config is cfg and model.config._attn_implementation == "kvq"
    with pytest.raises(ValueError, match="applies to a whole transformers model"):
        quantize_(tiny_llama(), cfg, filter_fn=lambda module, fqn: fqn == "lm_head")


def test_per_layer_config_must_match_the_model():
    model = tiny_llama(layers=2)
    three = KVQuantConfig(layers=(LayerKV(QuantSpec(4), QuantSpec(4)),) * 3, name="three")
    with pytest.raises(ValueError, match="has 3 layer specs but the model has 2 layers"):
        quantize_kv_(model, three)
    two = three.with_layers([LayerKV(QuantSpec(8), QuantSpec(2)), LayerKV(QuantSpec(2, "channel"), QuantSpec(None))])
    quantize_kv_(model, two)
    cache = make_cache(model)
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 70)), cache=cache)
    assert cache.layers[0].k_body.codes.shape[-1] == 64 and cache.layers[1].v_body.codes.dtype == torch.float32


def test_group_that_does_not_divide_head_dim_is_rejected_for_this_model():
    cfg = KVQuantConfig(default=LayerKV(QuantSpec(4, "token", 48), QuantSpec(4)), name="g48")
    with pytest.raises(ValueError, match="layer 0: group_size 48 does not divide head_dim 64"):
        quantize_kv_(tiny_llama(), cfg)


def test_unsupported_model_is_rejected():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="unsupported model type 'gpt2'"):
        quantize_kv_(model, KVQuantConfig.preset("int8"))


def test_config_type_is_checked():
    with pytest.raises(TypeError, match="must be a KVQuantConfig"):
        quantize_kv_(tiny_llama(), "kivi-4")


def test_ppl_ratio_interval_is_scipys_t_interval_of_the_window_differences():
    from scipy import stats

    from kvq_ao.eval import ratio_interval

    g = torch.Generator().manual_seed(0)
    deltas = (torch.randn(8, generator=g, dtype=torch.float64) * 0.01 + 0.005).tolist()
    low, high = ratio_interval(deltas)
    t = torch.tensor(deltas, dtype=torch.float64)
    ref = stats.t.interval(0.95, len(deltas) - 1, loc=float(t.mean()), scale=stats.sem(deltas))
    assert abs(low - math.exp(ref[0])) < 1e-12 and abs(high - math.exp(ref[1])) < 1e-12
    assert low < math.exp(float(t.mean())) < high
    assert ratio_interval([0.01]) is None  # one window: no spread to measure
