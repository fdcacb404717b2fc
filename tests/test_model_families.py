"""Model families beyond Llama (`kvq_ao.model_info`): Gemma-2 and Gemma-3 on tiny random models.

Gemma's attention differs from Llama's in ways the quantized cache must carry: sliding and global
layers, MQA, head_dim 256, query_pre_attn_scalar scaling, QK-norm (Gemma-3) and attention logit
soft-capping (Gemma-2), which the kvq attention ops apply themselves instead of falling back to float.
"""

import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_gemma
from kvq_ao import KVQuantConfig, QuantizedKVCache, make_cache, quantize_kv_
from kvq_ao.api import compile_config


def _generate(model, ids, max_new_tokens: int = 12, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, **kw)


def _prompt(n: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("preset", ["int8", "kivi-4"])
def test_greedy_generation_equals_the_fp_cache(version, preset):
    model = tiny_gemma(version)
    ids = _prompt()
    fp = _generate(model, ids, cache=DynamicCache(config=model.config))
    quantize_kv_(model, KVQuantConfig.preset(preset))
    out = _generate(model, ids, return_dict_in_generate=True)
    assert isinstance(out.cache, QuantizedKVCache) and isinstance(out.cache, DynamicCache)
    assert torch.equal(out.sequences, fp)
    if preset == "int8":  # no fp window: every cached token was read back from 8-bit codes
        assert all(int(layer.body_end) >= ids.shape[1] for layer in out.cache.layers)


@pytest.mark.parametrize("version", [2, 3])
def test_attention_through_the_kvq_op_equals_the_models_own_float_attention(version):
    """With the float ("fp") preset every layer's attention runs in the kvq attention ops (prefill chunks
    and one-token decode), so logits must equal the model's own eager/SDPA attention: soft-capping,
    QK-norm, query_pre_attn_scalar, MQA and sliding windows all included."""
    model = tiny_gemma(version)
    ids = _prompt(40)
    with torch.no_grad():
        want = model(ids).logits
        quantize_kv_(model, KVQuantConfig.preset("fp"))
        for step in (1, 8, 40):
            cache = make_cache(model)
            got = torch.cat([model(ids[:, i : i + step], cache=cache).logits for i in range(0, 40, step)], 1)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gemma2_soft_capping_is_applied_in_the_op():
    """The check above would pass vacuously if the cap never bit: without it, logits differ."""
    ids = _prompt(40)
    with torch.no_grad():
        capped, uncapped = tiny_gemma(2)(ids).logits, tiny_gemma(2, softcap=None)(ids).logits
        assert (capped - uncapped).abs().max() > 1e-3
        model = tiny_gemma(2)
        quantize_kv_(model, KVQuantConfig.preset("kivi-4"))
        calls = []
        reals = {name: getattr(torch.ops.kvq, name) for name in ("decode_attention", "chunk_attention")}

        def spy(name):
            def call(**args):
                calls.append(args["softcap"])
                return reals[name](**args)

            return call

        try:
            for name in reals:
                setattr(torch.ops.kvq, name, spy(name))
            model(ids, cache=make_cache(model))
        finally:
            for name, real in reals.items():
                setattr(torch.ops.kvq, name, real)
    assert calls and set(calls) == {2.0}


def test_gemma3_compiled_decode_equals_eager():
    model = tiny_gemma(3, seed=3)
    quantize_kv_(model, KVQuantConfig.preset("kivi-4"))
    ids = _prompt(20)
    kw = dict(cache_implementation="static", max_new_tokens=16)
    eager = _generate(model, ids, **kw)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = _generate(model, ids, compile_config=compile_config(), **kw)
    assert torch.equal(compiled, eager)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_gemma3_exports_to_executorch_and_onnx_and_matches_eager(tmp_path):
    pytest.importorskip("executorch", reason="export needs executorch (installed by the test extra)")
    pytest.importorskip("onnxruntime", reason="export needs onnxruntime (installed by the test extra)")
    from kvq_ao.export import export_executorch, export_onnx
    from kvq_ao.export.decoder import DecodeStep
    from kvq_ao.export.executorch import ExecuTorchRunner
    from kvq_ao.export.onnx import OnnxRunner

    cfg, max_len = KVQuantConfig.preset("int8"), 48  # int8: no fp window, so the exported cache's codes are read
    prompt = _prompt(12)[0].tolist()
    pte = export_executorch(tiny_gemma(3), cfg, tmp_path / "g.pte", max_seq_len=max_len)
    onnx_path = export_onnx(tiny_gemma(3), cfg, tmp_path / "g.onnx", max_seq_len=max_len)
    for runner in (ExecuTorchRunner(pte.path), OnnxRunner(onnx_path)):
        new, logits = runner.generate(prompt, 16)
        step = DecodeStep(tiny_gemma(3), cfg, max_len)
        with torch.no_grad():
            eager = [step(torch.tensor([[t]]), torch.tensor([i]))[0, -1] for i, t in enumerate(prompt + new[:-1])]
        diff = max((a - b).abs().max().item() for a, b in zip(logits, eager))
        scale = max(b.abs().max().item() for b in eager)
        print(f"{type(runner).__name__} Gemma-3 int8: max |logit diff| {diff:.2e} (relative {diff / scale:.2e})")
        assert diff / scale < 1e-3
        assert new == [int(x.argmax()) for x in eager[len(prompt) - 1 :]]


def test_gemma3_local_and_global_layers_each_get_their_own_rotary_embedding():
    from kvq_ao.model_info import rotary_of

    model = tiny_gemma(3)
    ropes = rotary_of(model)
    kinds = model.config.layer_types
    assert len(ropes) == len(kinds) == 4 and set(kinds) == {"sliding_attention", "full_attention"}
    emb = model.model.rotary_emb
    for (inv_freq, scale), kind in zip(ropes, kinds):
        assert torch.equal(inv_freq, getattr(emb, f"{kind}_inv_freq")) and scale == getattr(emb, f"{kind}_attention_scaling")
    local, glob = ropes[kinds.index("sliding_attention")][0], ropes[kinds.index("full_attention")][0]
    assert not torch.allclose(local, glob)  # (10k vs 1M bases: one rotation for both would be wrong)


def _pre_rope_8bit() -> KVQuantConfig:
    from kvq_ao import LayerKV, QuantSpec

    return KVQuantConfig(default=LayerKV(QuantSpec(8, "channel", 16), QuantSpec(8, "token", 32)), sink_tokens=1,
                         pre_rope_keys=True, name="int8-pre-rope")  # fmt: skip


def test_gemma3_with_8bit_pre_rope_keys_stores_each_layers_keys_before_its_own_rope():
    """Pre-RoPE keys on local and global layers: each layer's body holds its keys as they were
    before that layer's RoPE (the k_norm output), and greedy tokens equal the fp cache's. (The
    stored keys are what quantization sees; attention undoes whatever rotation the cache applied,
    so only this comparison catches one rotation used for both layer types.)"""
    model = tiny_gemma(3)
    ids = _prompt(40)
    fp = _generate(model, ids, max_new_tokens=16, cache=DynamicCache(config=model.config))
    pre_rope = {}
    def keep(n: int):
        def hook(_module, _inputs, out):  # the prompt's pre-RoPE keys [B, H, T, D] (the first call: the prefill)
            pre_rope.setdefault(n, out.detach())

        return hook

    hooks = [layer.self_attn.k_norm.register_forward_hook(keep(n)) for n, layer in enumerate(model.model.layers)]
    quantize_kv_(model, _pre_rope_8bit())
    out = _generate(model, ids, max_new_tokens=16, return_dict_in_generate=True)
    for h in hooks:
        h.remove()
    assert torch.equal(out.sequences, fp)
    for n, layer in enumerate(out.cache.layers):  # the prompt's keys, past the full-precision sink token
        stored, want = layer.keys_values()[0].body()[:, :, 1:32], pre_rope[n][:, :, 1:32]
        assert (stored - want).abs().max() < 0.02 * want.abs().max(), n


@pytest.mark.parametrize("preset", ["kvquant-3", "kvquant-3-1pct"])
def test_gemma3_takes_calibrated_pre_rope_keys_through_kvq_calibrate(tmp_path, preset):
    """KVQuant's datatypes on Gemma-3: `kvq calibrate` fits pre-RoPE codebooks for a saved Gemma-3
    (local and global layers unrotated with their own frequencies), and the preset generates; with
    outliers at head_dim 256 (uint8 slot indices reach channel 255) each stored key vector keeps
    ceil(1% of 256) = 3 exact entries."""
    from transformers import AutoTokenizer

    from kvq_ao.calibration import Calibration
    from kvq_ao.cli import main
    from kvq_ao.models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2"))
    folder, out = tmp_path / "gemma3", tmp_path / "calib.json"
    tiny_gemma(3, vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert main(["calibrate", "--model", str(folder), "--preset", preset, "--out", str(out), "--samples", "2",
                 "--seq-len", "64"]) == 0  # fmt: skip
    calib = Calibration.load(out)
    assert all(calib.layer(i)[0].codebook is not None and calib.layer(i)[0].lo is not None for i in range(4))  # keys: levels, ranges
    import dataclasses

    model = tiny_gemma(3, vocab_size=len(tokenizer))
    quantize_kv_(model, dataclasses.replace(KVQuantConfig.preset(preset), calibration=str(out)))
    ids = torch.randint(3, 1000, (1, 24), generator=torch.Generator().manual_seed(2))
    out = _generate(model, ids, max_new_tokens=6, return_dict_in_generate=True)
    assert out.sequences.shape == (1, 30)
    if preset.endswith("-1pct"):
        for layer in out.cache.layers:
            keys = layer.keys_values()[0]
            assert keys.out_idx.shape[-1] == 3 and keys.out_idx.dtype == torch.uint8


def test_gemma3_takes_every_preset_after_one_kvq_calibrate(tmp_path, monkeypatch):
    """Every preset family on a Gemma-3 (local and global RoPE, head_dim 256, MQA): one `kvq calibrate`
    of a saved model fits every calibrated preset (pre-RoPE keys, outliers, rotations) into the user
    cache, each preset then quantizes the model from it and generates, and the 8-bit preset's greedy
    tokens equal the fp cache's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvq_ao import calibration
    from kvq_ao.cli import main
    from kvq_ao.models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2"))  # before the user cache moves
    monkeypatch.setenv("KVQ_AO_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "gemma3"
    tiny_gemma(3, vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert main(["calibrate", "--model", str(folder), "--samples", "2", "--seq-len", "64"]) == 0

    def no_second_calibration(*_a, **_k):
        raise AssertionError("a preset was calibrated again instead of using `kvq calibrate`'s file")

    monkeypatch.setattr(calibration, "calibrate", no_second_calibration)
    ids = torch.randint(3, 1000, (1, 24), generator=torch.Generator().manual_seed(2))
    fp = _generate(AutoModelForCausalLM.from_pretrained(folder).eval(), ids, max_new_tokens=8)
    for preset in KVQuantConfig.preset_names():
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        quantize_kv_(model, KVQuantConfig.preset(preset))
        seq = _generate(model, ids, max_new_tokens=8)
        assert seq.shape == (1, 32), preset
        if preset in ("fp", "int8"):
            assert torch.equal(seq, fp), preset


LLAMA_LIKE = ["llama", "mistral", "qwen2", "qwen3", "smollm3", "phi3", "granite", "olmo2", "gemma"]


@pytest.mark.parametrize("model_type", LLAMA_LIKE)
def test_every_listed_family_runs_its_attention_through_the_kvq_op_exactly(model_type):
    """Each model type kvq_ao accepts, built tiny from its transformers config: with the float
    preset the kvq op reproduces the model's own attention, and kivi-4 generation equals fp."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvq_ao.model_info import SUPPORTED_MODEL_TYPES

    assert set(SUPPORTED_MODEL_TYPES) == set(LLAMA_LIKE) | {"gemma2", "gemma3_text"}
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = _prompt(30)
    with torch.no_grad():
        want = model(ids).logits
        fp = _generate(model, ids, cache=DynamicCache(config=model.config))
        quantize_kv_(model, KVQuantConfig.preset("fp"))
        cache = make_cache(model)
        got = torch.cat([model(ids[:, i : i + 10], cache=cache).logits for i in range(0, 30, 10)], 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    quantize_kv_(model, KVQuantConfig.preset("kivi-4"))
    assert torch.equal(_generate(model, ids), fp)
