"""`kvq demo`: both papers' methods side by side on one real model, from a fresh install.

Stages, each timed as it runs:
1. load the model (SmolLM2 is converted from its GGUF once, ~40 s, then cached);
2. calibrate the KVQuant presets (per-layer non-uniform levels and outlier thresholds on pydoc
   calibration text; one activation pass shared by all of them; cached in the user cache);
3. tune a KVTuner config under an average-bit budget (layer profile, then a search; the chosen
   config is cached too);
   for SmolLM2 kvq_ao ships the calibrations, the profile and the 3-bit config it would compute
   (`kvq_ao.artifacts`), so on the packaged model these two stages only check and load them;
4. evaluate every config through the quantized cache on held-out text (PPL, KL, agreement, bits;
   the fp reference of each window runs once for all configs);
5. one greedy answer per config to a question whose context lies past KIVI's fp window.
A second run reuses every cached artifact and only evaluates and answers.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

DEFAULT_CONFIGS = ("fp", "int8", "kivi-4", "kivi-2", "kvquant-4-1pct", "kvquant-3-1pct", "kvquant-2-1pct", "rot-k4v3",
                   "rot-k3v2", "kvquant-2-rotv", "kvtuner-rot-4.5", "kvtuner-rot-3.5")
DEFAULT_BUDGET = 3.0  # KVTuner's average (key + value) bits per layer


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Stages:
    """Prints '[i/n] what ...' when a stage starts and its wall time when it ends."""

    total: int
    log: object = _log
    seconds: dict[str, float] = field(default_factory=dict)
    _n: int = 0

    def run(self, name: str, fn, *args, **kwargs):
        self._n += 1
        self.log(f"[{self._n}/{self.total}] {name} ...")
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.seconds[name] = time.perf_counter() - t0
        self.log(f"[{self._n}/{self.total}] {name}: {self.seconds[name]:.0f} s")
        return out


def tuned_config_name(model, budget: float) -> str:
    from kvq_ao.calibration import model_key

    return f"{model_key(model)}-tuned-{budget:g}bit.json"


def tuned_config(model, tokenizer, budget: float, log=_log):
    """KVTuner's config for `model` under `budget` average bits (cached in the user cache)."""
    from kvq_ao.artifacts import seed
    from kvq_ao.config import KVQuantConfig
    from kvq_ao.models import cache_dir, pydoc_text, text_windows
    from kvq_ao.tuning.profile import base_config
    from kvq_ao.tuning.tuner import default_profile_path, tune

    path = seed(cache_dir() / "tune" / tuned_config_name(model, budget))
    if path.exists():
        log(f"kvq_ao: using the tuned config {path}")
        return KVQuantConfig.load(path)
    ids = text_windows(tokenizer, pydoc_text("calib"), 2, 512)  # kvq tune's defaults
    base = base_config()
    result = tune(model, ids, budget, base=base, profile_path=default_profile_path(model, base, ids, log), log=log)
    result.config.save(path)
    return result.config


def pair_summary(config, n_layers: int) -> str:
    """'K4V4 x6, K4V2 x17, ...' for a per-layer config."""
    from collections import Counter

    pairs = Counter(f"K{s.key.bits or 'fp'}V{s.value.bits or 'fp'}" for s in config.resolve(n_layers))
    return ", ".join(f"{p} x{n}" for p, n in pairs.most_common())


def answer_prompt() -> str:
    """A passage longer than KIVI's 128-token fp window, then a question: the answer has to come
    through the quantized part of the cache."""
    from pydoc_data.topics import topics

    return topics["assert"].strip() + "\n\nIn two sentences, what does the text above say assert statements are for?"


def run(model_name: str = "smollm2", configs: tuple[str, ...] = DEFAULT_CONFIGS, budget: float | None = DEFAULT_BUDGET,
        windows: int = 4, window_len: int = 1024, chunk: int = 64, text: str | None = None, prompt: str | None = None,
        max_new_tokens: int = 48, json_out: str | None = None) -> list:  # fmt: skip
    import json

    import torch

    from kvq_ao.api import quantize_kv_
    from kvq_ao.calibration import calibrate_missing
    from kvq_ao.config import KVQuantConfig
    from kvq_ao.eval import evaluate_many, greedy, print_results
    from kvq_ao.files import atomic_write
    from kvq_ao.models import load_model, pydoc_text, text_windows

    stages = Stages(total=5)
    t_start = time.perf_counter()
    model, tokenizer = stages.run(f"load {model_name}", load_model, model_name, log=_log)
    named = [KVQuantConfig.preset(name) for name in configs]
    stages.run("calibrate KVQuant presets", calibrate_missing, model, named)
    if budget is not None:
        tuned = stages.run(f"tune a KVTuner config under {budget:g} bits", tuned_config, model, tokenizer, budget)
        _log(f"kvq_ao: {tuned.name}: {pair_summary(tuned, model.config.num_hidden_layers)}")
        named.append(tuned)
    ids = text_windows(tokenizer, text or pydoc_text("eval"), windows, window_len)
    _log(f"evaluating {len(named)} configs on {ids.numel()} tokens of {'your' if text else 'held-out pydoc_data'} text")
    results = stages.run("evaluate", evaluate_many, model, ids, named, chunk)
    print_results(results)
    prompt = prompt or answer_prompt()

    def answers() -> None:
        print(f"\nGreedy answers to: {prompt[-300:]!r} (last 300 characters of {len(prompt)})")
        for config in named:
            quantize_kv_(model, config)
            with torch.no_grad():
                out = greedy(model, tokenizer, prompt, max_new_tokens)
            print(f"[{config.name}] {tokenizer.decode(out, skip_special_tokens=True).strip()}", flush=True)

    stages.run("answer", answers)
    total = time.perf_counter() - t_start
    timing = ", ".join(f"{name} {s:.0f} s" for name, s in stages.seconds.items())
    print(f"\ndemo wall time {total:.0f} s ({timing})")
    if json_out:
        rows = dict(results=[r.as_dict() for r in results], stage_seconds=stages.seconds, total_seconds=total)
        atomic_write(json_out, json.dumps(rows, indent=2) + "\n")
        _log(f"wrote {json_out}")
    return results


__all__ = ["DEFAULT_BUDGET", "DEFAULT_CONFIGS", "Stages", "answer_prompt", "pair_summary", "run", "tuned_config", "tuned_config_name"]
