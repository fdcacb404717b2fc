"""The scripts in examples/ run as a user would run them, on SmolLM2, and say what they claim."""

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


def test_compiled_decode_matches_eager_quantized(smollm2, capsys):
    out = _example("compiled_decode").main(["--preset", "kivi-4", "--max-new-tokens", "8"])
    assert len(out["compiled"]) == 8 and out["compiled"] == out["eager"]
    assert "8/8 tokens equal" in capsys.readouterr().out


def test_examples_refuse_an_unknown_preset(smollm2):
    with pytest.raises(ValueError, match="unknown preset"):
        _example("quickstart").main(["--preset", "kivi-9"])
