"""Rotated formats within the memory-per-bit budgets of issue 47, chosen on development text.

Families (every one calibrated for itself on the calibration samples `kvq calibrate` uses, and
evaluated on the development text of `dev_text.py`, never the evaluation text):

* "kvq keys + rot values": KVQuant's keys as the kvquant-B-1pct presets store them (pre-RoPE,
  calibrated per-channel ranges and levels, 1% outliers in float16) with values rotated by the
  randomized Hadamard matrix (`QuantSpec.rotation`) at the same or a lower width, nuq levels, one
  scale/zero per vector. KVTuner's finding that keys matter more than values is what lets values
  drop a bit; the rotation is what should make that cheap.
* the same without the value rotation (the control that says what the rotation buys);
* "rot tokens": keys and values both rotated, post-RoPE, per-vector groups, nuq levels;
* (round 2) values rotated and coded against calibrated per-channel ranges, no per-vector metadata,
  with KVQuant's keys ("rot cal values") or (round 3) with rotated per-vector keys;
* (round 4, 3.5 bits) 4-bit keys of either kind with 2-bit calibrated rotated values.

Every layout keeps one float16 sink token and a float16 full-precision window: the largest (a
multiple of 16 tokens, at most 128) that keeps the layout within its budget at 4096 tokens (bits
per element from the memory report, everything counted). Rule (fixed before any row was seen): per budget, the lowest development KL to
the fp model. Writes results/rotation/rotation_dev.json and prints a table.

    python experiments/rotation.py [--budgets 4.5,3.5,2.5] [--windows 8]
"""

import argparse
from pathlib import Path

from dev_text import calibrated_dev_row, dev_model, load_dev_rows, print_dev_table, save_dev_rows

from kvq_ao import KVQuantConfig, LayerKV, QuantSpec
from kvq_ao.config import KVQUANT_LAYOUT
from kvq_ao.memory import estimate

# budget -> (family, key bits, value bits): each takes the largest full-precision window (a multiple
# of 16 tokens, at most 128) its budget leaves; one that fits no window is refused
CANDIDATES = {
    4.5: [("kvq keys + rot values", 4, 3), ("kvq keys + values", 4, 3), ("rot tokens", 4, 3), ("rot tokens", 4, 4)],
    3.5: [("kvq keys + rot values", 3, 2), ("kvq keys + values", 3, 2), ("kvq keys + rot values", 3, 3),
          ("rot tokens", 3, 2)],
    2.5: [("kvq keys + rot values", 2, 2), ("kvq keys + values", 2, 2), ("kvq keys, no outliers + rot values", 2, 2)],
}
# Round 2 (added after round 1's rows were in, same rule): values rotated and coded against calibrated
# per-channel ranges (no per-vector scale and zero: the 0.25 bits per element they cost buy a longer window)
CANDIDATES[3.5] += [("kvq keys + rot cal values", 3, 2), ("kvq keys + rot cal values", 3, 3)]
CANDIDATES[2.5] += [("kvq keys + rot cal values", 2, 2), ("kvq keys, no outliers + rot cal values", 2, 2)]
# Round 3 (after round 2, same rule): keys rotated per vector (round 1's best family at 4.5 and 3.5)
# with round 2's calibrated rotated values
CANDIDATES[4.5] += [("rot keys + rot cal values", 4, 4), ("rot keys + rot cal values", 4, 3)]
CANDIDATES[3.5] += [("rot keys + rot cal values", 3, 3), ("rot keys + rot cal values", 3, 2)]
CANDIDATES[2.5] += [("rot keys + rot cal values", 2, 2)]
# Round 4 (after issue 47's passkey diagnosis, docs/rotation.md: 3-bit keys lose the needles, 2-bit
# rotated values keep them): 4-bit keys with 2-bit calibrated rotated values, whose free metadata pays
# for the fourth key bit within 3.5 bits (same rule)
CANDIDATES[3.5] += [("rot keys + rot cal values", 4, 2), ("kvq keys + rot cal values", 4, 2),
                    ("kvq keys, no outliers + rot cal values", 4, 2)]
WINDOWS = range(128, -1, -16)


def candidate(family: str, key_bits: int, value_bits: int, window: int) -> KVQuantConfig:
    rotated = family != "kvq keys + values"
    value = QuantSpec(value_bits, "token", 64, "nuq", rotation="hadamard" if rotated else "none")
    if "cal values" in family:
        value = QuantSpec(value_bits, "channel", 128, "nuq", ranges="calibrated", rotation="hadamard")
    if family.startswith("rot"):
        key = QuantSpec(key_bits, "token", 64, "nuq", rotation="hadamard")
    else:
        layout = KVQUANT_LAYOUT[key_bits]
        outliers = 0.0 if "no outliers" in family else 0.01
        key = QuantSpec(key_bits, "channel", 128, layout.key_levels, outliers, max_outliers=layout.key_slots if outliers else None,
                        outlier_dtype="float16", ranges="calibrated")  # fmt: skip
    name = f"{family} K{key_bits}V{value_bits} w{window}"
    return KVQuantConfig(default=LayerKV(key, value), sink_tokens=1, residual_length=window, side_dtype="float16",
                         pre_rope_keys=not family.startswith("rot"), name=name)  # fmt: skip


def fitted(budget: float, family: str, key_bits: int, value_bits: int) -> KVQuantConfig | None:
    """The candidate with the largest window within `budget` bits per element at 4096 tokens."""
    for window in WINDOWS:
        cfg = candidate(family, key_bits, value_bits, window)
        if estimate(cfg, 30, 3, 64, 4096).bits_per_element <= budget:
            return cfg
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budgets", default="4.5,3.5,2.5")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="results/rotation/rotation_dev.json")
    args = parser.parse_args()
    budgets = [float(b) for b in args.budgets.split(",")]
    plan = [(b, c, fitted(b, *c)) for b in budgets for c in CANDIDATES[b]]
    for budget, c, cfg in plan:
        print(f"budget {budget}: {cfg.name if cfg else f'{c} fits no window: skipped'}")
    plan = [(b, c, cfg) for b, c, cfg in plan if cfg is not None]
    model, dev, activations_of = dev_model(args.threads, args.windows)
    rows = load_dev_rows(args.out)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    folder = Path("/tmp/kvq-rotation")
    for budget, (family, kb, vb), cfg in plan:
        if any(r["config"] == cfg.name for r in rows):
            continue
        rows.append(calibrated_dev_row(model, dev, activations_of(cfg.pre_rope_keys), cfg, folder / f"{cfg.name.replace(' ', '-')}.json",
                                       budget=budget, family=family, key_bits=kb, value_bits=vb, fp_window=cfg.residual_length))  # fmt: skip
        save_dev_rows(args.out, rows)
    chosen = {b: min((r for r in rows if r["budget"] == b), key=lambda r: r["kl"]) for b in budgets}
    print_dev_table("development text: rotated formats", rows,
                    {"budget": lambda r: str(r["budget"]), "family": lambda r: r["family"],
                     "K/V bits": lambda r: f"{r['key_bits']}/{r['value_bits']}", "window": lambda r: str(r["fp_window"])},
                    {"bits/elem @4096": lambda r: f"{r['avg_bits_at_4096']:.2f}",
                     "chosen (KL)": lambda r: "yes" if chosen.get(r["budget"]) is r else ""})  # fmt: skip


if __name__ == "__main__":
    main()
