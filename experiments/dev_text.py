"""Development text and the helpers the kvquant layout experiments share.

Development text: pydoc's calibration half *after* the 16 x 512 calibration tokens, so disjoint
from both the calibration samples and the evaluation half. Every layout choice in
docs/kvquant.md was made on it; none on the evaluation text.
"""

import dataclasses
import json
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path

import torch

from kvq_ao import KVQuantConfig
from kvq_ao.calibration import calibrate, collect
from kvq_ao.eval import evaluate
from kvq_ao.models import calibration_windows, development_ids, load_model

TARGETS = {4: 0.005, 3: 0.03, 2: 0.15}  # the PPL-loss targets for kvquant-B-1pct
DEV_TEXT = "pydoc calib half after the calibration tokens"


def dev_windows(tok, n: int, length: int) -> torch.Tensor:
    ids = development_ids(tok)
    if ids.numel() < n * length:
        raise ValueError(f"development text has {ids.numel()} tokens, fewer than {n} x {length}")
    return ids[: n * length].reshape(n, length)


def dev_model(threads: int, windows: int = 8):
    """(model, development windows `windows` x 1025, activations_of): SmolLM2, the text of
    `dev_windows`, and `activations_of(pre_rope)`, the activations of the calibration samples
    `kvq calibrate` uses, collected once per RoPE placement on first ask."""
    torch.set_num_threads(threads)
    model, tok = load_model("smollm2")
    ids = calibration_windows(tok)
    collected = {}

    def activations_of(pre_rope: bool):
        if pre_rope not in collected:
            collected[pre_rope] = collect(model, ids, pre_rope=pre_rope)
        return collected[pre_rope]

    return model, dev_windows(tok, windows, 1025), activations_of


def dev_setup(threads: int, windows: int = 8):
    """(model, development windows `windows` x 1025, calibration activations) that the
    development-text benchmarks share: `dev_model`'s, with the pre-RoPE activations."""
    model, dev, activations_of = dev_model(threads, windows)
    acts = activations_of(True)
    return model, dev, acts


def post_rope_study(args):
    """(model, development windows, post-RoPE calibration activations, rows saved at args.out, their
    config names): what an emulation study over the rotated store starts from (`args.threads`,
    `args.windows`, `args.out`), so a rerun skips the configs already measured."""
    model, dev, activations_of = dev_model(args.threads, args.windows)
    rows = load_dev_rows(args.out)
    return model, dev, activations_of(False), rows, {r["config"] for r in rows}


def calibrated_dev_row(model, dev: torch.Tensor, acts, config: KVQuantConfig, path: Path, **labels) -> dict:
    """Calibrate `config` on the shared calibration activations (saved to `path`), then `dev_row`."""
    saved = calibrate(model, None, config, activations=acts, progress=False).save(path)
    return dev_row(model, dev, dataclasses.replace(config, calibration=str(saved)), **labels)


def dev_row(model, dev: torch.Tensor, config: KVQuantConfig, **labels) -> dict:
    """Evaluate `config` on the development windows; print and return its row: `labels`, the result, seconds."""
    t0 = time.perf_counter()
    r = evaluate(model, dev, config)
    row = dict(**labels, **r.as_dict(), seconds=round(time.perf_counter() - t0, 1))
    print(json.dumps({k: v for k, v in row.items() if not isinstance(v, (list, dict))}), flush=True)
    return row


def kept_rows(out: str, widths: list[int]) -> tuple[list[dict], dict[int, dict]]:
    """(rows, chosen) of the bit widths *not* in `widths` from an earlier results file at `out`, so
    widths can be re-measured one at a time without losing the others."""
    if not Path(out).exists():
        return [], {}
    old = json.loads(Path(out).read_text())
    rows = [r for r in old["rows"] if r["bits"] not in widths]
    return rows, {int(b): c for b, c in old["chosen"].items() if int(b) not in widths}


def print_dev_table(title: str, rows: list[dict], before: dict, after: dict) -> None:
    """Print rows as a markdown table: the `before` columns, dev PPL, ΔPPL vs fp, KL to fp, then the
    `after` columns (each a column name -> function of the row giving its cell)."""
    names = [*before, "dev PPL", "ΔPPL vs fp", "KL to fp", *after]
    print(f"\nSmolLM2-135M, {title}")
    print("| " + " | ".join(names) + " |")
    print("|" + "---|" * len(names))
    for r in rows:
        quality = [f"{r['ppl']:.3f}", f"{100 * (r['ppl_ratio'] - 1):+.2f}%", f"{r['kl']:.4f}"]
        cells = [f(r) for f in before.values()] + quality + [f(r) for f in after.values()]
        print("| " + " | ".join(cells) + " |")


PPL_MARGIN = 0.001  # 0.1 point of PPL loss: float rounding alone moves a preset's development PPL that much


def cheapest_near_best(rows: list[dict], cost: Callable[[dict], float], margin: float = PPL_MARGIN) -> dict:
    """The lowest-cost row among those within `margin` of the lowest PPL ratio."""
    best = min(r["ppl_ratio"] for r in rows)
    return min((r for r in rows if r["ppl_ratio"] <= best + margin), key=cost)


def load_dev_rows(out: str) -> list[dict]:
    """The rows an earlier run saved at `out` (none if it has not run), so a run resumes."""
    return json.loads(Path(out).read_text())["rows"] if Path(out).exists() else []


def save_dev_rows(out: str, rows: list[dict]) -> None:
    Path(out).write_text(json.dumps(dict(date=str(date.today()), text=DEV_TEXT, rows=rows), indent=2) + "\n")


def within(row: dict, target: float) -> bool:
    """The whole 95% interval of the PPL ratio lies within the target."""
    if row["ppl_ratio_ci95"] is None:
        raise SystemExit("the rule needs a 95% interval, which needs at least 2 windows (--windows)")
    return row["ppl_ratio_ci95"][1] - 1 <= target
