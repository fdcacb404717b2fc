"""Layer bits or a longer window? Tuned rotated configs at issue 47's 4.5- and 3.5-bit budgets.

The 8-bit metadata screening (experiments/lean_metadata.py) showed that its rounding costs nothing
and its gain is the window the freed 0.25 bits buy: at 3.45 bits, K3V2 with a 176-token float16
window has 0.59x the development KL of K3V2 with 112. The tuned rotated configs of docs/kvtuner.md
spend their budget on layer bits with `rot-k4v3`'s 112-token window. This experiment asks the same
question of them: at equal bits per element (4096 tokens, everything counted), does a KVTuner search
at a lower nominal budget with a 176- or 240-token window beat the search at the full budget with 112?

Candidates (fixed before any row was seen): per budget, the tuned config with the 112-token window
(`results/tune/tuned-rot-w2348-3.5bit.json`, `results/tune/tuned-rot-2.5bit.json`) and KVTuner's
search over widths {2, 3, 4, 8} (`kvq tune --dtype rot`, the same layer profile, calibration text)
at the largest nominal budget that a 176- or a 240-token window leaves within the budget; the tuned
config then takes that window (the search measured its assignments with 112: the window changes no
layer's bits). Rule (as experiments/rotation.py): per budget, the lowest development KL to the fp
model. The chosen configs are evaluated once on the 48 held-out windows with the command printed.

    kvq tune --dtype rot --widths 2,3,4,8 --max-avg-bits N --profile results/tune/profile-smollm2-rot.json \\
        --out results/tune/tuned-rot-w2348-Nbit.json     # N = 3.29, 3.04, 2.29, 2.04 (each search 2-4 min)
    python experiments/tuned_window.py                     # -> results/rotation/tuned_window_dev.json
"""

import argparse
import dataclasses
from pathlib import Path

from dev_text import dev_model, dev_row, load_dev_rows, print_dev_table, save_dev_rows

from kvq_ao import KVQuantConfig
from kvq_ao.memory import estimate

# budget -> (tuned config file, window): the 112-token configs as tuned, the others re-windowed
CANDIDATES = {
    4.5: [("results/tune/tuned-rot-w2348-3.5bit.json", 112), ("results/tune/tuned-rot-w2348-3.29bit.json", 176),
          ("results/tune/tuned-rot-w2348-3.04bit.json", 240)],
    3.5: [("results/tune/tuned-rot-2.5bit.json", 112), ("results/tune/tuned-rot-w2348-2.29bit.json", 176),
          ("results/tune/tuned-rot-w2348-2.04bit.json", 240)],
}  # fmt: skip


def bits_at_4096(config: KVQuantConfig) -> float:
    return estimate(config, 30, 3, 64, 4096).bits_per_element


def windowed(path: str, window: int) -> tuple[str, KVQuantConfig]:
    """The tuned config at `path` with a `window`-token float16 window, saved beside it (the same
    calibration) when the window is new; (its file, the config)."""
    tuned = KVQuantConfig.load(path)
    if tuned.residual_length == window:
        return path, tuned
    out = Path(path).with_name(f"{Path(path).stem}-w{window}.json")
    config = dataclasses.replace(tuned, residual_length=window, name=out.stem)
    config.save(out)
    return str(out), config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="results/rotation/tuned_window_dev.json")
    args = parser.parse_args()
    plan = []
    for budget, cands in CANDIDATES.items():
        for path, window in cands:
            if not Path(path).exists():
                raise SystemExit(f"{path} is missing: run the `kvq tune` command in this script's docstring first")
            file, config = windowed(path, window)
            bits = bits_at_4096(config)
            if bits > budget:
                raise SystemExit(f"{file}: {bits:.3f} bits per element at 4096 tokens, over the {budget} budget")
            plan.append((budget, file, config, bits))
    model, dev, _ = dev_model(args.threads, args.windows)
    rows = load_dev_rows(args.out)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for budget, file, config, bits in plan:
        if any(r["config_file"] == file for r in rows):
            continue
        rows.append(dev_row(model, dev, config, config_file=file, budget=budget, fp_window=config.residual_length, bits_at_4096=bits))
        save_dev_rows(args.out, rows)
    chosen = {b: min((r for r in rows if r["budget"] == b), key=lambda r: r["kl"]) for b in CANDIDATES}
    print_dev_table("development text: tuned rotated configs, layer bits against window", rows,
                    {"budget": lambda r: str(r["budget"]), "config": lambda r: r["config_file"], "window": lambda r: str(r["fp_window"])},
                    {"bits/elem @4096": lambda r: f"{r['bits_at_4096']:.3f}",
                     "chosen (KL)": lambda r: "yes" if chosen.get(r["budget"]) is r else ""})  # fmt: skip
    files = ",".join(r["config_file"] for r in chosen.values())
    print("\nheld out, once: python benchmarks/kvquant_quality.py --presets "
          f"{files} --skip-ablations --windows 48 --out results/rotation/tuned_window_48windows.json")


if __name__ == "__main__":
    main()
