"""The scripts in examples/ run as a user would run them, on SmolLM2 (compiled_decode on a tiny model with
SmolLM2's tokenizer), and say what they claim."""

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_answers_and_reports_its_memory(smollm2, capsys):
    out = _example("quickstart").main(["--preset", "kivi-2", "--max-new-tokens", "8"])
    printed = capsys.readouterr().out
    assert len(out["fp"]) == len(out["quantized"]) == 8
    assert "kivi-2 cache:" in printed and "bits/element" in printed
    # the cache held the prompt and the answer (the last answer token is never fed back)
    assert out["report"]["tokens"] > 8 and out["report"]["bytes"] > 0
    assert out["at_4096"]["compression"] > 5  # 2-bit codes once the context outgrows the window


def test_compiled_decode_matches_eager_quantized(smollm2, capsys, tmp_path):
    """The example end to end, on a 2-layer random model with SmolLM2's tokenizer: Inductor compiles
    SmolLM2's 30 layers in about three minutes, and tests/test_compile.py already checks compiled
    generation on the real model token for token."""
    from transformers import AutoTokenizer

    from conftest import tiny_llama
    from kvq_ao.models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2"))
    tiny_llama(vocab_size=len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    out = _example("compiled_decode").main(["--model", str(tmp_path), "--preset", "kivi-4", "--max-new-tokens", "8"])
    assert len(out["compiled"]) == 8 and out["compiled"] == out["eager"]
    assert "8/8 tokens equal" in capsys.readouterr().out


def test_examples_refuse_an_unknown_preset(smollm2):
    with pytest.raises(ValueError, match="unknown preset"):
        _example("quickstart").main(["--preset", "kivi-9"])


def test_context_parallel_example_in_one_process_answers_as_the_ordinary_cache(smollm2, capsys):
    """World size 1 (no torchrun): the example's generate() through the context-parallel cache (two
    segments of 256 tokens) gives the ordinary cache's tokens; the multi-process runs are
    tests/test_context_parallel.py (tiny model) and benchmarks/context_parallel.py (SmolLM2)."""
    import torch

    from kvq_ao import KVQuantConfig, load_model, make_cache, quantize_kv_
    from kvq_ao.models import pydoc_text

    out = _example("context_parallel").main(["--prompt-tokens", "700", "--max-new-tokens", "6", "--segment", "256"])
    assert "1 rank(s), kivi-2, 700 prompt tokens" in capsys.readouterr().out and out["held"][0] > 0
    model, tokenizer = load_model("smollm2")
    quantize_kv_(model, KVQuantConfig.preset("kivi-2"))
    ids = tokenizer(pydoc_text("eval"), return_tensors="pt").input_ids[:, :700]
    want = model.generate(ids, attention_mask=torch.ones_like(ids), cache=make_cache(model), max_new_tokens=6, do_sample=False,
                          prefill_chunk_size=512, pad_token_id=tokenizer.pad_token_id)[0, 700:]  # fmt: skip
    assert out["tokens"] == want.tolist()
