"""How value outliers are judged, on development text: calibrated per-channel thresholds vs per vector.

KVQuant judges key outliers by per-channel thresholds calibrated offline and value outliers per
token, online. For each width this evaluates kvquant-B-1pct in its chosen layout with the value
outliers judged both ways (`QuantSpec.outlier_rule` "channel" / "vector"), on the development text
of `kvquant_recipe.py` (never the evaluation text), each calibrated for itself. Rule, fixed before
the first run: a preset uses "vector" where it lowers development PPL. Writes
results/kvquant_value_outliers/kvquant_value_outliers.json and prints a table.

    python experiments/kvquant_value_outliers.py [--bits 4,3,2]
"""

import argparse
import dataclasses
from pathlib import Path

from dev_text import calibrated_dev_row, dev_setup, print_dev_table, save_dev_rows

from kvq_ao import KVQuantConfig
from kvq_ao.config import LayerKV


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bits", default="4,3,2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="results/kvquant_value_outliers/kvquant_value_outliers.json")
    args = parser.parse_args()
    model, dev, acts = dev_setup(args.threads)
    rows = []
    for bits in [int(b) for b in args.bits.split(",")]:
        preset = KVQuantConfig.preset(f"kvquant-{bits}-1pct")
        for rule in ("channel", "vector"):
            value = dataclasses.replace(preset.default.value, outlier_rule=rule)
            config = dataclasses.replace(preset, default=LayerKV(preset.default.key, value), name=f"{preset.name} values by {rule}")
            rows.append(calibrated_dev_row(model, dev, acts, config, Path("/tmp/kvq-value-outliers") / f"{bits}-{rule}.json",
                                           bits=bits, value_outliers=rule, preset_uses=preset.default.value.outlier_rule))  # fmt: skip
    save_dev_rows(args.out, rows)
    print_dev_table(f"development text ({args.out})", rows,
                    {"bits": lambda r: str(r["bits"]), "value outliers": lambda r: r["value_outliers"]},
                    {"top-1 agreement": lambda r: f"{r['token_agreement']:.3f}", "preset uses": lambda r: r["preset_uses"]})  # fmt: skip

if __name__ == "__main__":
    main()
