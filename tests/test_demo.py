"""`kvq demo` end to end on a tiny random model (the SmolLM2 run is in the README): every stage
runs and is timed, KIVI, calibrated KVQuant and tuned rows come out, and a second run reuses the
calibration and the tuned config from the user cache."""

import json
import os
import subprocess
import sys

from conftest import tiny_llama


def test_demo_runs_every_stage_then_reuses_its_artifacts(tmp_path):
    from transformers import AutoTokenizer

    from kvq_ao.models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2"))
    folder = tmp_path / "tiny"
    tiny_llama(vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    env = {**os.environ, "KVQ_AO_CACHE": str(tmp_path / "cache")}
    args = [sys.executable, "-m", "kvq_ao.cli", "demo", "--model", str(folder), "--presets", "fp,kivi-4,kvquant-2-1pct",
            "--budget", "3", "--windows", "1", "--window-len", "128", "--max-new-tokens", "4"]  # fmt: skip

    def run(json_out):
        done = subprocess.run([*args, "--json-out", str(json_out)], capture_output=True, text=True, env=env, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        return done, json.loads(json_out.read_text())

    first, rows = run(tmp_path / "first.json")
    assert [r["config"] for r in rows["results"]] == ["fp", "kivi-4", "kvquant-2-1pct", "tuned-3bit"]
    for i, stage in enumerate(["load", "calibrate KVQuant presets", "tune a KVTuner config", "evaluate", "answer"], 1):
        assert f"[{i}/5] {stage}" in first.stderr
    assert "calibrating kvquant-2-1pct" in first.stderr
    for name in ("fp", "kivi-4", "kvquant-2-1pct", "tuned-3bit"):
        assert f"[{name}] " in first.stdout  # one answer per config
    assert "demo wall time" in first.stdout

    second, again = run(tmp_path / "second.json")
    assert "calibrating" not in second.stderr and "using the tuned config" in second.stderr
    assert [r["ppl"] for r in again["results"]] == [r["ppl"] for r in rows["results"]]
