"""Where a kvquant preset's loss comes from, on development text: keys, values, clamped outliers.

For each width, kvquant-B-1pct in its chosen layout is evaluated as is, with its keys left in full
precision, and with its values left in full precision, on the development text of
`kvquant_recipe.py` (never the evaluation text), each calibrated for itself on the same
calibration activations. Each row also reports the fraction of key and value entries whose
outliers found their vector's slots full and were clamped. A diagnostic: no preset is chosen from
it. Writes results/kvquant_error_sources/kvquant_error_sources.json and prints a table.

    python experiments/kvquant_error_sources.py [--bits 4]
"""

import argparse
import dataclasses
from pathlib import Path

from dev_text import calibrated_dev_row, dev_setup, print_dev_table, save_dev_rows

from kvq_ao import KVQuantConfig, LayerKV, QuantSpec


def variants(bits: int) -> list[tuple[str, KVQuantConfig]]:
    preset = KVQuantConfig.preset(f"kvquant-{bits}-1pct")
    key, value = preset.default.key, preset.default.value
    return [
        ("as is", preset),
        ("keys in full precision", dataclasses.replace(preset, default=LayerKV(QuantSpec(None), value))),
        ("values in full precision", dataclasses.replace(preset, default=LayerKV(key, QuantSpec(None)))),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bits", default="4")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="results/kvquant_error_sources/kvquant_error_sources.json")
    args = parser.parse_args()
    model, dev, acts = dev_setup(args.threads)
    rows = []
    for bits in [int(b) for b in args.bits.split(",")]:
        for i, (label, config) in enumerate(variants(bits)):
            config = dataclasses.replace(config, name=f"kvquant-{bits}-1pct, {label}")
            rows.append(calibrated_dev_row(model, dev, acts, config, Path("/tmp/kvq-error-sources") / f"{bits}-{i}.json",
                                           bits=bits, variant=label))  # fmt: skip
    save_dev_rows(args.out, rows)
    print_dev_table(f"development text ({args.out})", rows, {"bits": lambda r: str(r["bits"]), "variant": lambda r: r["variant"]},
                    {"keys clamped": lambda r: f"{100 * r['clamped_key_outliers']:.2f}%",
                     "values clamped": lambda r: f"{100 * r['clamped_value_outliers']:.2f}%"})  # fmt: skip

if __name__ == "__main__":
    main()
