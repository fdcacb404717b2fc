"""Keys scored against an integer query (`QuantSpec(scores="int8"/"int16")`, `kvq_ao.format.INT8_QUERY`
/ `INT16_QUERY`) through a model: the cache hands the format to the attention ops, and the native
kernel's result on the model's own queries and keys is the reference's."""

import pytest
import torch

from conftest import tiny_llama
from kvq_ao import KVQuantConfig, quantize_kv_
from kvq_ao.format import INT8_QUERY, INT16_QUERY, Operand
from kvq_ao.kernels import reference
from kvq_ao.ops import named_arguments, reference_arguments


@pytest.mark.parametrize("preset,query_bits", [("kivi-4-q8", INT8_QUERY), ("kivi-4", INT16_QUERY), ("kivi-2-q16", INT16_QUERY)])
def test_a_model_s_decode_steps_score_its_keys_against_an_integer_query(monkeypatch, preset, query_bits):
    model = tiny_llama(layers=2, heads=6, kv_heads=2, head_dim=64)
    quantize_kv_(model, KVQuantConfig.preset(preset))
    ids = torch.randint(3, 128, (1, 300), generator=torch.Generator().manual_seed(0))  # past the 128-token window
    calls = []
    real = torch.ops.kvq.decode_attention
    monkeypatch.setattr(torch.ops.kvq, "decode_attention", lambda **a: calls.append(a) or real(**a))
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert len(calls) == 2 * 3
    for a in calls:
        named = named_arguments((), a)
        assert named["k"].query_bits == query_bits and named["v"].query_bits == 0
        got = real(**a)
        want = reference.attention(**reference_arguments(named), target="eager")
        as_float = reference.attention(**reference_arguments(dict(named, k=named["k"].replace(query_bits=0))), target="eager")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if query_bits == INT8_QUERY:  # the int8 rounding shows, far above the kernels' own difference (an int16
            # query's is a few times that difference here: test_an_integer_query_changes_the_scores shows it)
            assert (got - as_float).abs().max() > 10 * (got - want).abs().max()


def test_operands_default_to_float_scores():
    o = Operand(codes=None, scale=None, zero=None, codebook=None, out_val=None, out_idx=None, side=None, bits=4, axis=1, group=32)
    assert o.query_bits == 0 and not o.int_query
