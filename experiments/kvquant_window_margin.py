"""Re-check each kvquant-B-1pct full-precision window with a margin for noise, on development text.

`kvquant_recipe.py` chose each width's layout as the cheapest candidate whose *point estimate* on
8 development windows was within the issue's target. At 4 bits that pick sat on the edge (+0.49%
against 0.5%), and the evaluation text then read +0.59% / +0.61% on 8 windows and +0.51% / +0.48%
on all 48: a point estimate at the edge of 8 windows is a coin flip, since which text is drawn
moves the ratio by about +-0.5 point there. This script asks for the target to hold with
confidence instead, on as much development text as the evaluation half's judging run has.

Text: 48 windows x 1025 tokens of pydoc's calibration half after the calibration tokens (the
development text of `kvquant_recipe.py`, extended; never the evaluation half). Candidates: each
preset as it is (sink, outlier slots, value-outlier rule unchanged) with a full-precision window of
32, 64 or 128 tokens, in that order of cost. Window 0 is not a candidate: on 8 development windows
it was past the target at every width by more than the 8-window 95% interval's half-width.

Rule, fixed before running (2026-12-01 21:26 UTC): per width, the first (cheapest) window whose
95% interval of the PPL ratio (Student t over the 48 per-window paired differences, as `evaluate`
reports it) lies wholly within the issue's target (4 bits 0.5%, 3 bits 3%, 2 bits 15%); later
windows of that width are not run. If none does, the one with the lowest development PPL. Writes
results/kvquant_window_margin/kvquant_window_margin.json after every row and prints a table.

    python experiments/kvquant_window_margin.py [--bits 4,3,2]
"""

import argparse
import dataclasses
import json
from datetime import date
from pathlib import Path

from dev_text import within, DEV_TEXT, TARGETS, dev_row, dev_setup, kept_rows

from kvq_ao import KVQuantConfig
from kvq_ao.calibration import calibrate

FP_WINDOWS = (32, 64, 128)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bits", default="4,3,2")
    parser.add_argument("--windows", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="results/kvquant_window_margin/kvquant_window_margin.json")
    args = parser.parse_args()
    model, dev, acts = dev_setup(args.threads, args.windows)
    widths = [int(b) for b in args.bits.split(",")]
    rows, chosen = kept_rows(args.out, widths)

    def save() -> None:
        Path(args.out).write_text(json.dumps(dict(date=str(date.today()), text=DEV_TEXT, tokens=int(dev.shape[0] * (dev.shape[1] - 1)),
                                                  targets=TARGETS, chosen=chosen, rows=rows), indent=2) + "\n")  # fmt: skip

    for bits in widths:
        preset = KVQuantConfig.preset(f"kvquant-{bits}-1pct")
        path = calibrate(model, None, preset, activations=acts, progress=False).save(Path("/tmp/kvq-window-margin") / f"{bits}.json")
        mine = []
        for window in FP_WINDOWS:
            config = dataclasses.replace(preset, residual_length=window, calibration=str(path), name=f"{preset.name} window={window}")
            row = dev_row(model, dev, config, bits=bits, sink=preset.sink_tokens, fp_window=window)
            rows.append(row)
            mine.append(row)
            if within(row, TARGETS[bits]):
                break
        passing = [r for r in mine if within(r, TARGETS[bits])]
        best = passing[0] if passing else min(mine, key=lambda r: r["ppl"])
        chosen[bits] = dict(fp_window=best["fp_window"], interval_within_target=bool(passing))
        save()
    print(f"\nSmolLM2-135M, development text, {args.windows} windows ({args.out})")
    print("| bits | fp window | dev ΔPPL | 95% interval | KL to fp | bits/element at 4096 | chosen |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = (100 * (x - 1) for x in r["ppl_ratio_ci95"])
        mark = "**yes**" if chosen[r["bits"]]["fp_window"] == r["fp_window"] else ""
        print(f"| {r['bits']} | {r['fp_window']} | {100 * (r['ppl_ratio'] - 1):+.2f}% | {lo:+.2f}% .. {hi:+.2f}% | "
              f"{r['kl']:.4f} | {r['avg_bits_at_4096']:.2f} | {mark} |")


if __name__ == "__main__":
    main()
