"""Development-text quality of kvquant-2-rotv and its variant with 4-bit keys in layers 15-22.

The passkey diagnosis of kvquant-2-1pct (docs/long_context.md) found retrieval in layers 15-22's
keys. The variant (`benchmarks/configs/passkey/kvquant-2-rotv-4-bit-keys-layers-15-22.json`) widens
those layers' keys to 4 bits (calibrated ranges, uniform levels, no outliers) and pays for it with a
48-token window instead of 112, to stay within 2.5 bits per element at 4096 tokens. This measures
what that trade costs in perplexity, on the development windows (never the evaluation half), each
config calibrated for itself on the calibration samples `kvq calibrate` uses.

    python experiments/retrieval_layers.py   # -> results/passkey/dev/kvquant2_rotv_layers_dev_ppl.json
"""

from pathlib import Path

from dev_text import calibrated_dev_row, dev_setup, save_dev_rows

from kvq_ao.config import PRESETS, KVQuantConfig

VARIANT = "benchmarks/configs/passkey/kvquant-2-rotv-4-bit-keys-layers-15-22.json"
OUT = "results/passkey/dev/kvquant2_rotv_layers_dev_ppl.json"


def main() -> None:
    model, dev, acts = dev_setup(threads=1)
    rows = []
    for label, cfg in [("kvquant-2-rotv", PRESETS["kvquant-2-rotv"]),
                       ("kvquant-2-rotv, 4-bit keys in layers 15-22, window 48", KVQuantConfig.load(VARIANT))]:  # fmt: skip
        saved = Path("/tmp/kvq-retrieval-layers") / f"{label.replace(' ', '_').replace(',', '')}.json"
        rows.append(calibrated_dev_row(model, dev, acts, cfg, saved, config_label=label))
    save_dev_rows(OUT, rows)


if __name__ == "__main__":
    main()
