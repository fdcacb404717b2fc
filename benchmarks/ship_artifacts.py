"""Regenerate what kvq_ao ships for SmolLM2 (`kvq_ao/shipped/`, see `kvq_ao.artifacts`).

    python benchmarks/ship_artifacts.py                 # calibrations + the demo's tuned config (~6 min, 2 cores)
    python benchmarks/ship_artifacts.py --profile       # also re-profile the layers for KVTuner (~8 min more)
    python benchmarks/ship_artifacts.py --presets rot-k3v2-recall   # only these presets' calibrations, no tuning

Everything is computed here from the model and pydoc calibration text with exactly what `kvq
calibrate` and `kvq demo` would run in an empty user cache (no shipped file is read, except the
layer profile without --profile), then written into the package tree. Run it whenever a preset's
layout, calibration or tuning changes: tests/test_artifacts.py fails while a shipped file no
longer fits its preset.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from kvq_ao.artifacts import SHIPPED
from kvq_ao.calibration import calibrate, collect, model_key
from kvq_ao.config import KVQuantConfig
from kvq_ao.demo import DEFAULT_BUDGET, tuned_config_name
from kvq_ao.models import calibration_windows, pydoc_text, text_windows
from kvq_ao.tuning.profile import base_config
from kvq_ao.tuning.tuner import default_profile_path, tune

from common import smollm2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", action="store_true", help="re-profile the layers too (else the shipped profile is kept)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--presets", help="comma-separated presets: calibrate only these (the tuned config is left as it is)")
    args = ap.parse_args()
    names = args.presets.split(",") if args.presets else KVQuantConfig.preset_names()
    model, tokenizer = smollm2(args.threads)
    key = model_key(model)

    t0 = time.perf_counter()
    presets = [KVQuantConfig.preset(n) for n in names if KVQuantConfig.preset(n).needs_calibration]
    windows = calibration_windows(tokenizer)
    for pre_rope in sorted({c.pre_rope_keys for c in presets}):
        activations = collect(model, windows, pre_rope)
        for config in (c for c in presets if c.pre_rope_keys == pre_rope):
            path = calibrate(model, None, config, activations=activations).save(SHIPPED / "calibration" / key / f"{config.name}.json")
            print(f"wrote {path.relative_to(SHIPPED.parent.parent)}", flush=True)
    print(f"calibrations: {time.perf_counter() - t0:.0f} s", flush=True)
    if args.presets:
        return

    t0 = time.perf_counter()
    ids = text_windows(tokenizer, pydoc_text("calib"), 2, 512)  # kvq tune's defaults, as kvq demo runs it
    base = base_config()
    shipped_profile = SHIPPED / "tune" / default_profile_path(model, base, ids).name
    with tempfile.TemporaryDirectory() as tmp:
        profile_path = Path(tmp) / shipped_profile.name if args.profile else shipped_profile
        result = tune(model, ids, DEFAULT_BUDGET, base=base, profile_path=profile_path, log=print)
        if args.profile:
            shipped_profile.write_bytes(profile_path.read_bytes())
            print(f"wrote {shipped_profile.relative_to(SHIPPED.parent.parent)}")
    path = SHIPPED / "tune" / tuned_config_name(model, DEFAULT_BUDGET)
    result.config.save(path)
    print(f"wrote {path.relative_to(SHIPPED.parent.parent)}; tuning: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
