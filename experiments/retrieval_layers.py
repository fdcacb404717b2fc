"""Development-text quality of presets beside their variants with wider keys in the layers that retrieve.

The passkey diagnoses (docs/long_context.md, docs/rotation.md) found retrieval in a few layers'
keys: layers 15-22 for needles in the middle of the prompt, layers 0-7 for the earliest. A variant
widens those layers' keys and pays for it with a shorter full-precision window, to stay within its
preset's budget. This measures what that trade costs in perplexity, on the development windows
(never the evaluation half), each config calibrated for itself on the calibration samples
`kvq calibrate` uses (pre- or post-RoPE, as the config stores its keys).

    python experiments/retrieval_layers.py   # kvquant-2-rotv and its 2.5-bit variant
    python experiments/retrieval_layers.py --configs rot-k3v2,benchmarks/configs/passkey/rot-k3v2-4-bit-keys-layers-0-7-15-22.json \
        --out results/passkey/dev/rot_k3v2_layers_dev_ppl.json
"""

import argparse
from pathlib import Path

from dev_text import calibrated_dev_row, dev_model, save_dev_rows

from kvq_ao.config import PRESETS, KVQuantConfig

CONFIGS = "kvquant-2-rotv,benchmarks/configs/passkey/kvquant-2-rotv-4-bit-keys-layers-15-22.json"
OUT = "results/passkey/dev/kvquant2_rotv_layers_dev_ppl.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default=CONFIGS, help="comma-separated preset names or config files")
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args()
    model, dev, activations_of = dev_model(threads=1)
    rows = []
    for name in args.configs.split(","):
        cfg = PRESETS[name] if name in PRESETS else KVQuantConfig.load(name)
        label = cfg.name or name
        saved = Path("/tmp/kvq-retrieval-layers") / f"{Path(name).stem}.json"
        saved.parent.mkdir(exist_ok=True)
        rows.append(calibrated_dev_row(model, dev, activations_of(cfg.pre_rope_keys), cfg, saved, config_label=label))
    save_dev_rows(args.out, rows)


if __name__ == "__main__":
    main()
