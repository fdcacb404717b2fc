"""Every generate() mode transformers ships for decoder-only models, through the quantized cache.

Two kinds of settings:
* lossless: int8 with a full-precision window longer than the sequence, so every mode must give
  the tokens an unquantized twin of the model gives in the same mode;
* lossy presets (kivi-4 on Llama and Gemma-3, kvquant-3-1pct on Llama; an 8-token window so that
  the 120-token prompt and the generated tokens cross block boundaries): a generation mode must
  not change what the cache computes, so each greedy mode gives plain greedy's tokens, and for
  sampling and beams the scores generate reports are those of feeding the same tokens one at a
  time through a fresh cache of the preset (what plain decoding computes).
Assisted decoding and prompt lookup must also have really cropped rejected tokens (counted).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from transformers import DynamicCache, StaticCache

from conftest import tiny_gemma, tiny_llama
from kvq_ao import KVQuantConfig, QuantizedKVCache, compile_config, make_cache, quantize_kv_
from kvq_ao.cache import QuantizedLayer

PROMPT, NEW = 120, 24
SETTINGS = ["llama-lossless", "gemma3-lossless", "llama-kivi-4", "gemma3-kivi-4", "llama-kvquant-3-1pct"]
MODES = ["greedy", "sample", "beam", "beam-sample", "assisted", "prompt-lookup", "static", "compiled-all-outputs",
         "inputs-embeds", "continue-cache", "continue-embeds", "left-padding", "no-cache", "return-dict"]  # fmt: skip
GREEDY_MODES = {"greedy", "assisted", "prompt-lookup", "static", "compiled-all-outputs", "inputs-embeds", "continue-cache",
                "continue-embeds", "return-dict"}  # fmt: skip


def _build(family: str, seed: int, draft: bool = False):
    if family == "llama":
        model = tiny_llama(layers=1 if draft else 2, seed=seed)
    else:
        model = tiny_gemma(3, layers=2 if draft else 4, seed=seed)
    model.generation_config.eos_token_id = None  # random weights: never stop early, every mode runs NEW steps
    model.generation_config.pad_token_id = 0
    return model


def _config(preset: str, model) -> KVQuantConfig:
    if preset == "lossless":
        return dataclasses.replace(KVQuantConfig.preset("int8"), residual_length=1024, name="int8-lossless")
    cfg = dataclasses.replace(KVQuantConfig.preset(preset), residual_length=8, name=f"{preset}-w8")
    if not cfg.needs_calibration:
        return cfg
    import tempfile
    from pathlib import Path

    from kvq_ao.calibration import calibrate

    ids = torch.randint(3, 128, (4, 160), generator=torch.Generator().manual_seed(1))
    path = calibrate(model, ids, cfg, progress=False).save(Path(tempfile.mkdtemp(prefix="kvq-modes-")) / f"{cfg.name}.json")
    return dataclasses.replace(cfg, calibration=str(path))


@functools.lru_cache(maxsize=None)
def setting(name: str):
    """(quantized model, its quantized draft, fp twin, fp draft or None) for a setting."""
    family, preset = name.split("-", 1)
    model, draft = _build(family, 4), _build(family, 5, draft=True)
    cfg = _config(preset, model)
    quantize_kv_(model, cfg)
    quantize_kv_(draft, _config(preset, draft) if cfg.needs_calibration else cfg)
    twins = (_build(family, 4), _build(family, 5, draft=True)) if preset == "lossless" else (None, None)
    return model, draft, *twins


def _prompt(seed: int = 7) -> torch.Tensor:
    return torch.randint(3, 128, (1, PROMPT), generator=torch.Generator().manual_seed(seed))


def _embed(model, ids: torch.Tensor) -> torch.Tensor:
    return model.get_input_embeddings()(ids)


def generate(model, mode: str, draft=None, ids: torch.Tensor | None = None, **extra):
    """Runs `mode`; returns the generate output (sequences: prompt + new tokens, whatever the mode)."""
    ids = _prompt() if ids is None else ids
    kw = dict(max_new_tokens=NEW, do_sample=False, attention_mask=torch.ones_like(ids), **extra)
    torch.manual_seed(0)
    with torch.no_grad():
        if mode == "greedy":
            return model.generate(ids, **kw)
        if mode == "sample":
            return model.generate(ids, **{**kw, "do_sample": True}, top_k=0, output_logits=True, return_dict_in_generate=True)
        if mode in ("beam", "beam-sample"):
            beams = 3 if mode == "beam" else 2
            return model.generate(ids, **{**kw, "do_sample": mode == "beam-sample"}, num_beams=beams, top_k=0,
                                  num_return_sequences=beams, length_penalty=0.0, output_scores=True,
                                  return_dict_in_generate=True)  # fmt: skip
        if mode == "assisted":  # long drafts, so rejections drop tokens whose blocks were already packed
            return model.generate(ids, assistant_model=draft, num_assistant_tokens=NEW, assistant_confidence_threshold=0.0,
                                  num_assistant_tokens_schedule="constant", **kw)  # fmt: skip
        if mode == "prompt-lookup":
            return model.generate(ids, prompt_lookup_num_tokens=12, max_matching_ngram_size=1, **kw)
        if mode == "static":
            return model.generate(ids, cache_implementation="static", return_dict_in_generate=True, **kw)
        if mode == "compiled-all-outputs":
            torch._dynamo.reset()  # a fresh compile for this model (no recompile limit reached across tests)
            return model.generate(ids, cache_implementation="static", compile_config=compile_config(), output_scores=True,
                                  output_logits=True, return_dict_in_generate=True, **kw)  # fmt: skip
        if mode == "inputs-embeds":
            new = model.generate(inputs_embeds=_embed(model, ids), **kw)  # new tokens only
            return torch.cat([ids, new], 1)
        if mode == "continue-cache":
            first = model.generate(ids, return_dict_in_generate=True, **{**kw, "max_new_tokens": NEW // 2})
            seq = first.sequences
            return model.generate(seq, cache=first.cache, **{**kw, "max_new_tokens": NEW - NEW // 2,
                                                             "attention_mask": torch.ones_like(seq)})  # fmt: skip
        if mode == "continue-embeds":
            first = model.generate(inputs_embeds=_embed(model, ids), return_dict_in_generate=True,
                                   **{**kw, "max_new_tokens": NEW // 2})  # fmt: skip
            seq = torch.cat([ids, first.sequences], 1)
            more = model.generate(inputs_embeds=_embed(model, seq), cache=first.cache,
                                  **{**kw, "max_new_tokens": NEW - NEW // 2, "attention_mask": torch.ones_like(seq)})  # fmt: skip
            return torch.cat([seq, more], 1)
        if mode == "no-cache":
            return model.generate(ids, use_cache=False, **kw)
        if mode == "return-dict":
            return model.generate(ids, return_dict_in_generate=True, output_scores=True, output_logits=True, **kw)
    raise ValueError(mode)


def left_padded(model, rows: list[torch.Tensor], width: int | None = None) -> torch.Tensor:
    """Greedy over `rows` (1-D prompts) left-padded to `width` (default: the longest) -> [batch, NEW] new tokens."""
    width = width or max(len(r) for r in rows)
    batch = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.long), r]) for r in rows])
    mask = torch.stack([torch.cat([torch.zeros(width - len(r)), torch.ones(len(r))]) for r in rows]).long()
    with torch.no_grad():
        return model.generate(batch, attention_mask=mask, max_new_tokens=NEW, do_sample=False)[:, width:]


def _padding_rows() -> list[torch.Tensor]:
    return [_prompt()[0], _prompt(seed=8)[0, : PROMPT - 11]]


def sequences(out) -> torch.Tensor:
    return out.sequences if hasattr(out, "sequences") else out


def stepwise_logits(model, seq: torch.Tensor) -> torch.Tensor:
    """What plain decoding computes for `seq`: the prompt in one pass, then one token at a time
    through a fresh quantized cache -> logits [rows, NEW, vocab] predicting each new token."""
    cache = make_cache(model)
    with torch.no_grad():
        logits = [model(seq[:, :PROMPT], cache=cache, logits_to_keep=1).logits[:, -1]]
        for t in range(PROMPT, seq.shape[1] - 1):
            logits.append(model(seq[:, t : t + 1], cache=cache).logits[:, -1])
    return torch.stack(logits, 1)


@pytest.fixture
def crops(monkeypatch) -> list[int]:
    """Counts of tokens every quantized layer's crop() dropped."""
    dropped: list[int] = []
    real = QuantizedLayer.crop

    def counting(self, tokens_to_remove: int) -> None:
        dropped.append(-tokens_to_remove)
        real(self, tokens_to_remove)

    monkeypatch.setattr(QuantizedLayer, "crop", counting)
    return dropped


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", SETTINGS)
def test_generation_mode(name, mode, crops, monkeypatch):
    model, draft, fp, fp_draft = setting(name)
    if mode == "no-cache":  # caching off: no quantized cache at all, the model runs as the fp model does
        monkeypatch.setattr(QuantizedLayer, "update", lambda *a, **k: pytest.fail("a quantized cache was used"))
    if mode == "left-padding":
        got = left_padded(model, _padding_rows())
        if fp is not None:
            assert torch.equal(got, left_padded(fp, _padding_rows()))
        else:  # each row as generated alone with the same padding: rows do not mix
            for i, row in enumerate(_padding_rows()):
                assert torch.equal(got[i : i + 1], left_padded(model, [row], width=PROMPT)), f"row {i}"
        return

    out = generate(model, mode, draft=draft)
    seq = sequences(out)
    assert seq.shape[1] == PROMPT + NEW
    if mode in ("assisted", "prompt-lookup"):
        assert any(crops), "no draft token was rejected: the crop path was not exercised"
    if fp is not None:  # lossless: the unquantized twin's tokens, mode for mode
        assert torch.equal(seq, sequences(generate(fp, mode, draft=fp_draft)))
    elif mode in GREEDY_MODES:
        assert torch.equal(seq, generate(model, "greedy"))
    elif mode == "no-cache":
        unquantized = _build(name.split("-")[0], 4)
        assert torch.equal(seq, generate(unquantized, "greedy"))
    elif mode == "sample":
        torch.testing.assert_close(torch.stack(out.logits, 1), stepwise_logits(model, seq), rtol=0, atol=1e-5)
    else:  # beams: each returned beam's score is the sum of the log-probabilities plain decoding gives its tokens
        logprobs = stepwise_logits(model, seq).log_softmax(-1)
        expected = logprobs.gather(-1, seq[:, PROMPT:, None]).sum((1, 2))
        torch.testing.assert_close(out.sequences_scores, expected, rtol=0, atol=1e-4)
    _check_returned_cache(out, mode, name)


def _check_returned_cache(out, mode: str, name: str) -> None:
    cache = getattr(out, "cache", None)
    if cache is None:
        return
    assert isinstance(cache, QuantizedKVCache)
    static = mode in ("static", "compiled-all-outputs")
    assert isinstance(cache, StaticCache if static else DynamicCache)
    assert not getattr(cache, "_is_user_defined", False)  # generate built it: not marked as the caller's
    held = PROMPT + NEW - 1  # the last token is generated, never fed
    keys = cache.layers[0].keys  # transformers' float view of the layer, computed from the packed storage
    assert keys.shape[2] == held
    assert cache.get_seq_length() == held
    if static:
        assert cache.get_max_length() == held  # what transformers' own StaticCache would hold for this call
    if name.endswith("lossless"):  # every token in full precision: the float view is the keys as computed
        assert torch.isfinite(keys).all() and keys.abs().sum() > 0


def test_static_cache_reports_the_length_transformers_own_static_cache_has():
    model, _, fp, _ = setting("llama-lossless")
    ours = generate(model, "static").cache
    theirs = generate(fp, "static").cache
    assert type(theirs) is StaticCache and isinstance(ours, StaticCache)
    assert ours.get_max_length() == theirs.get_max_length() == PROMPT + NEW - 1
    assert ours.layers[0].max_cache_len == theirs.layers[0].max_cache_len
    for a, b in zip(ours.layers, theirs.layers):  # the float views equal the fp cache's own tensors
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(a.values, b.values, rtol=1e-6, atol=1e-6)


def test_compile_config_alone_keeps_the_dynamic_cache():
    """transformers compiles only with a static cache; a compile config does not switch kinds."""
    model, *_ = setting("llama-kivi-4")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        out = model.generate(_prompt(), attention_mask=torch.ones(1, PROMPT, dtype=torch.long), max_new_tokens=NEW,
                             do_sample=False, compile_config=compile_config(), return_dict_in_generate=True)  # fmt: skip
    assert isinstance(out.cache, DynamicCache) and not isinstance(out.cache, StaticCache)
    assert torch.equal(out.sequences, generate(model, "greedy"))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0


def test_the_model_itself_as_its_draft_on_a_lossy_preset(crops):
    model, *_ = setting("gemma3-kivi-4")
    assert torch.equal(generate(model, "assisted", draft=model), generate(model, "greedy"))


def test_compiled_assisted_decoding_is_refused_clearly():
    """A compiled step appends one token; verifying a draft appends several (not compiled here)."""
    model, *_ = setting("llama-kivi-4")
    ids = _prompt()
    with pytest.raises(ValueError, match="compiled assisted decoding .* is not supported"), torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, prompt_lookup_num_tokens=4,
                       cache_implementation="static", compile_config=compile_config())  # fmt: skip
