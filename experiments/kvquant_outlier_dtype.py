"""What storing outlier values in 16 bits costs a float32 model, on development text.

kvquant-B-1pct as shipped (outlier values in the model's dtype, float32 for SmolLM2) against the
same preset with `QuantSpec.outlier_dtype="float16"` for keys and values (24 bits a slot with its
uint8 index instead of 40), on the development windows of `dev_text.py` (never the evaluation
text), with the presets' own calibrations (the fit does not depend on the outlier dtype). Writes
results/kvquant_outlier_dtype/kvquant_outlier_dtype.json and prints a table.

    python experiments/kvquant_outlier_dtype.py [--bits 4,3,2] [--windows 4]
"""

import argparse
import dataclasses

import torch
from dev_text import dev_row, dev_windows, print_dev_table, save_dev_rows

from kvq_ao import KVQuantConfig
from kvq_ao.models import load_model


def with_outlier_dtype(cfg: KVQuantConfig, dtype: str) -> KVQuantConfig:
    kv = cfg.default
    layer = dataclasses.replace(kv, key=dataclasses.replace(kv.key, outlier_dtype=dtype),
                                value=dataclasses.replace(kv.value, outlier_dtype=dtype))  # fmt: skip
    return dataclasses.replace(cfg, default=layer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bits", default="4,3,2")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="results/kvquant_outlier_dtype/kvquant_outlier_dtype.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2")
    dev = dev_windows(tok, args.windows, 1025)
    rows = []
    for bits in [int(b) for b in args.bits.split(",")]:
        preset = KVQuantConfig.preset(f"kvquant-{bits}-1pct")
        for dtype in ("model", "float16"):
            cfg = with_outlier_dtype(preset, dtype)
            rows.append(dev_row(model, dev, cfg, bits=bits, outlier_dtype=dtype))
            save_dev_rows(args.out, rows)
    print_dev_table("development text: outlier values in the model's dtype (float32) vs float16", rows,
                    {"preset": lambda r: f"kvquant-{r['bits']}-1pct", "outliers": lambda r: r["outlier_dtype"]},
                    {"bits/elem @4096": lambda r: f"{r['avg_bits_at_4096']:.2f}"})  # fmt: skip


if __name__ == "__main__":
    main()
