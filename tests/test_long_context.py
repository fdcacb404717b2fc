"""Long contexts: a cache that grows without quadratic copying, room reserved by generate(),
chunked prefill through the quantized cache, and bounds masks inside whole models."""

import dataclasses

import pytest
import torch

import kvq_ao.api as api
import kvq_ao.masks as masks
from conftest import tiny_gemma, tiny_llama
from kvq_ao import KVQuantConfig, make_cache, quantize_kv_
from kvq_ao.cache import QuantizedLayer, _BodyStore


def test_a_dynamic_cache_grows_geometrically_not_by_fixed_steps():
    spec = KVQuantConfig.preset("kivi-2").resolve(1)[0]
    layer = QuantizedLayer(spec, residual_length=8)
    g = torch.Generator().manual_seed(0)
    capacities, length = [], 0
    for n in [1] * 300 + [97] * 40:  # one token at a time, then chunks
        k, v = torch.randn(1, 2, n, 64, generator=g), torch.randn(1, 2, n, 64, generator=g)
        layer.update(k, v)
        length += n
        if not capacities or capacities[-1] != layer.capacity:
            capacities.append(layer.capacity)
        assert length <= layer.capacity <= max(1.5 * length + 256, 512)
    # 4180 tokens: growth by 1.5x from 256 takes ~7 growths (fixed 256-token steps would take 16)
    assert len(capacities) <= 8, capacities
    assert all(b >= 1.5 * a for a, b in zip(capacities, capacities[1:]) if b != capacities[-1])


def test_reserve_is_validated_and_preallocates():
    spec = KVQuantConfig.preset("kivi-2").resolve(1)[0]
    with pytest.raises(ValueError, match="reserve must be >= 0"):
        QuantizedLayer(spec, reserve=-1)
    layer = QuantizedLayer(spec, reserve=5000)
    layer.update(torch.randn(1, 2, 3, 64), torch.randn(1, 2, 3, 64))
    assert layer.capacity >= 5000 and layer.k_body.codes.shape[2] == layer.capacity


def test_generate_reserves_prompt_plus_new_tokens_so_the_cache_never_grows(tiny_model, monkeypatch):
    quantize_kv_(tiny_model, KVQuantConfig.preset("kivi-2"))
    grows = []
    real_grow = _BodyStore.grow
    monkeypatch.setattr(_BodyStore, "grow", lambda self, c: grows.append(c) or real_grow(self, c))
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tiny_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=120, do_sample=False)
    assert len(grows) == 2 * 2 and min(grows) >= 320  # k and v of 2 layers, each allocated once for 320 tokens
    grows.clear()
    with torch.no_grad():  # the same with a cache built without a reserve: it grows on the way
        tiny_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=120, do_sample=False,
                            cache=make_cache(tiny_model))  # fmt: skip
    assert len(grows) > 2 * 2


def _chunk_calls(monkeypatch) -> list:
    calls = []
    real = torch.ops.kvq.chunk_attention
    monkeypatch.setattr(torch.ops.kvq, "chunk_attention", lambda **a: calls.append((a["q"].shape[2], a["mask"].dtype)) or real(**a))
    return calls


def test_generate_prefills_a_long_prompt_in_chunks_with_bounds_masks(tiny_model, monkeypatch):
    # a window that holds the whole prompt: chunked and unchunked prefill see the same keys and values
    quantize_kv_(tiny_model, dataclasses.replace(KVQuantConfig.preset("kivi-4"), residual_length=256))
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(1))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, output_logits=True,
              return_dict_in_generate=True)  # fmt: skip
    calls = _chunk_calls(monkeypatch)
    with torch.no_grad():
        whole = tiny_model.generate(ids, **kw)  # 100 tokens < PREFILL_CHUNK: one chunk
        assert calls == [(100, torch.int64)] * 2
        calls.clear()
        chunked = tiny_model.generate(ids, prefill_chunk_size=32, **kw)
        assert calls == [(32, torch.int64)] * 6 + [(4, torch.int64)] * 2  # 32 + 32 + 32 + 4, 2 layers
        calls.clear()
        monkeypatch.setattr(api, "PREFILL_CHUNK", 48)  # the default applies when the caller sets none...
        model = tiny_llama()  # (the fixture's weights)
        quantize_kv_(model, dataclasses.replace(KVQuantConfig.preset("kivi-4"), residual_length=256))
        assert model.generation_config.prefill_chunk_size == 48
        by_default = model.generate(ids, **kw)
        assert [n for n, _ in calls] == [48] * 4 + [4] * 2
        calls.clear()
        switched_off = model.generate(ids, prefill_chunk_size=None, **kw)  # ...and None switches it off
        assert calls == [(100, torch.int64)] * 2
        calls.clear()
        from_embeds = model.generate(inputs_embeds=model.get_input_embeddings()(ids), **kw)  # transformers cannot chunk these
        assert [n for n, _ in calls] == [100] * 2
    assert torch.equal(chunked.sequences, whole.sequences) and torch.equal(by_default.sequences, whole.sequences)
    assert torch.equal(switched_off.sequences, whole.sequences) and torch.equal(from_embeds.sequences, whole.sequences[:, 100:])
    for a, b in zip(chunked.logits, whole.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("preset", ["kivi-2", "kvquant"])
def test_prefill_in_chunks_of_any_size_reads_the_cache_as_decoding_would(tiny_model, preset):
    """Each query of a chunk reads the body below its own boundary and later keys in full precision,
    so one pass, chunks and token-by-token (the decode path) give the same logits, though most of
    the prompt is read from quantized codes."""
    from conftest import kvquant_config

    cfg = kvquant_config(bits=2, model=tiny_model) if preset == "kvquant" else KVQuantConfig.preset("kivi-2")
    quantize_kv_(tiny_model, dataclasses.replace(cfg, residual_length=16, sink_tokens=1))
    ids = torch.randint(3, 128, (1, 150), generator=torch.Generator().manual_seed(2))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, output_logits=True,
              return_dict_in_generate=True)  # fmt: skip
    runs = {}
    with torch.no_grad():
        for chunk in (1000, 40, 7, 1):
            runs[chunk] = tiny_model.generate(ids, prefill_chunk_size=chunk, **kw)
        fp = tiny_model.generate(ids, cache=__import__("transformers").DynamicCache(), **kw)
    for chunk in (40, 7, 1):
        assert torch.equal(runs[chunk].sequences, runs[1000].sequences)
        for a, b in zip(runs[chunk].logits, runs[1000].logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # and the codes are really read: far from the fp cache's logits
    assert (runs[1000].logits[0] - fp.logits[0]).abs().max() > 100 * (runs[7].logits[0] - runs[1000].logits[0]).abs().max()


@pytest.mark.parametrize("left_pad", [0, 5])
def test_bounds_masks_equal_dense_masks_in_a_sliding_window_model(monkeypatch, left_pad):
    """Gemma-3 (sliding and global layers, window 16) on a left-padded batch: the model's logits with
    the kvq mask as bounds equal those with transformers' dense masks."""
    model = tiny_gemma(3)
    quantize_kv_(model, dataclasses.replace(KVQuantConfig.preset("kivi-4"), residual_length=8))
    ids = torch.randint(3, 128, (2, 60), generator=torch.Generator().manual_seed(3))
    attn = torch.ones_like(ids)
    attn[1, :left_pad] = 0
    calls = _chunk_calls(monkeypatch)

    def logits():
        with torch.no_grad():
            return model(ids, attention_mask=attn, cache=make_cache(model)).logits

    bounded = logits()
    assert {dtype for _, dtype in calls} == {torch.int64}
    calls.clear()
    monkeypatch.setattr(api, "interval_bounds", lambda *a, **k: None)
    dense = logits()
    assert {dtype for _, dtype in calls} == {torch.bool}
    torch.testing.assert_close(bounded[1, left_pad:], dense[1, left_pad:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bounded[0], dense[0], rtol=1e-5, atol=1e-5)
    assert masks.is_bounds(torch.zeros(1, 1, 2, 2, dtype=torch.int64))


# --------------------------------------------------------------------------- the long benchmarks, tiny
ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def _run_benchmark(*argv: str) -> str:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.slow
def test_the_long_context_benchmark_runs_tiny(tmp_path):
    """benchmarks/long_context.py --tiny: every section on SmolLM2 at 1k-4k tokens (the long runs are
    not in CI). Checks the rows say what they should; no timing is asserted."""
    import json

    path = tmp_path / "lc.json"
    table = _run_benchmark("benchmarks/long_context.py", "--tiny", "--out", str(path))
    rows = json.loads(path.read_text())["rows"]
    assert not [r for r in rows if r["section"] == "error"], rows
    decode = {(r["preset"], r["cached_tokens"]): r for r in rows if r["section"] == "decode"}
    assert {p for p, _ in decode} == {"fp", "kivi-2"} and len(decode) == 4
    for n in (1024, 4096):  # tiling reaches the length asked (at least; block-rounded for the quantized cache)
        fp, q = decode[("fp", n)], next(r for (p, m), r in decode.items() if p == "kivi-2" and n <= m < n + 64)
        assert q["cache_mib"] < fp["cache_mib"] / 2 and q["ms_per_token"] > 0 and q["append_us_per_token"] > 0
        assert set(q["cache_by_kind_mib"]) == {"codes", "scale_zero", "outliers", "side"}
    prefill = {r["preset"]: r for r in rows if r["section"] == "prefill"}
    assert prefill["fp"]["same_continuation"] and prefill["kivi-2"]["tokens_per_s"] > 0
    assert all(r["ratio"] > 0 for r in rows if r["section"] == "chunk-memory")
    assert "| kivi-2 | 4,0" in table


@pytest.mark.slow
def test_the_passkey_benchmark_runs_tiny_and_fp_finds_the_key(tmp_path):
    import json

    path = tmp_path / "pk.jsonl"
    table = _run_benchmark("benchmarks/passkey.py", "--lengths", "512", "--depths", "0,100", "--trials", "1",
                           "--configs", "fp,kivi-4", "--out", str(path))  # fmt: skip
    rows = [json.loads(line) for line in path.read_text().splitlines()][1:]
    assert [(r["config"], r["depth"]) for r in rows] == [("fp", 0), ("fp", 100), ("kivi-4", 0), ("kivi-4", 100)]
    assert all(r["correct"] for r in rows if r["config"] == "fp"), rows  # the prompt works at all
    assert "| fp | 1/1 | 1/1 |" in table
    # resuming skips the cells already there and keeps their rows
    _run_benchmark("benchmarks/passkey.py", "--lengths", "512", "--depths", "0,100", "--trials", "1", "--configs", "fp",
                   "--out", str(path), "--resume")  # fmt: skip
    assert len(path.read_text().splitlines()) == 1 + 4
