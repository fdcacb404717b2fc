"""KVTuner on SmolLM2 end to end: `kvq tune` at several budgets, then held-out quality.

1. Runs the CLI `kvq tune --max-avg-bits B` for each budget, as a user would, and times each run
   (the first profiles the model unless a profile is already at --profile; --fresh-profile deletes
   it first so the first time includes profiling).
2. Evaluates every tuned config and the uniform assignments (the same base: KIVI's axes, group 32,
   128-token fp window) on held-out pydoc text (8 windows x 1025 tokens = 8192 predicted tokens,
   the eval half; tuning only sees the calibration half), and prints one table.

    python benchmarks/tune_smollm2.py --budgets 4.0,3.0,2.5 --fresh-profile
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvq_ao.config import KVQuantConfig
from kvq_ao.eval import evaluate
from kvq_ao.tuning.pareto import pair_bits
from kvq_ao.tuning.profile import assignment_config, base_config
from kvq_ao.artifacts import SHIPPED

from common import eval_windows, save_json, smollm2, stamp

SHIPPED_PROFILE = SHIPPED / "tune" / "SmolLM2-135M-Instruct.Q4_1-98362432-L30-H3-D64-r128-g32-2x512.json"


def run_tune(budget: float, out: Path, profile: Path, threads: int) -> float:
    """`kvq tune` in a fresh process (model load included); its wall time in seconds."""
    cmd = [sys.executable, "-m", "kvq_ao.cli", "tune", "--max-avg-bits", str(budget), "--out", str(out),
           "--profile", str(profile), "--threads", str(threads)]  # fmt: skip
    print("$", " ".join(cmd[2:]), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budgets", default="4.0,3.0,2.5")
    parser.add_argument("--uniform", default="2-2,2-4,4-2,4-4,8-4,4-8", help="uniform (key-value) pairs to evaluate beside")
    parser.add_argument("--out-dir", default="results/tune")
    parser.add_argument("--profile", default=str(SHIPPED_PROFILE),
                        help="layer profile; default: the one kvq_ao ships for SmolLM2 (kvq demo seeds its tuning from it)")
    parser.add_argument("--fresh-profile", action="store_true", help="delete --profile first (time profiling too, and re-make it)")
    parser.add_argument("--skip-tune", action="store_true", help="evaluate the configs already in --out-dir")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window-len", type=int, default=1025)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out_dir, profile = Path(args.out_dir), Path(args.profile)
    out_dir.mkdir(parents=True, exist_ok=True)
    budgets = [float(b) for b in args.budgets.split(",")]
    result_path = out_dir / "tune.json"
    saved = json.loads(result_path.read_text()) if result_path.exists() else {"timings": [], "rows": []}

    def save() -> None:
        save_json(result_path, {**saved, **stamp(threads=args.threads)})

    if not args.skip_tune:
        if args.fresh_profile and profile.exists():
            profile.unlink()
        saved["timings"] = []
        for budget in budgets:
            cached = profile.exists()
            seconds = run_tune(budget, out_dir / f"tuned-{budget:g}bit.json", profile, args.threads)
            saved["timings"].append(dict(budget=budget, seconds=round(seconds, 1), profile_reused=cached))
            print(f"kvq tune --max-avg-bits {budget}: {seconds:.0f} s ({'profile reused' if cached else 'profiling included'})")
            save()

    model, tok = smollm2(args.threads)
    windows = eval_windows(tok, args.windows, args.window_len)
    n_layers = model.config.num_hidden_layers
    configs = [(f"tuned {b:g}", KVQuantConfig.load(out_dir / f"tuned-{b:g}bit.json")) for b in budgets]
    for text in args.uniform.split(","):
        pair = tuple(int(x) for x in text.split("-"))
        configs.append((f"uniform K{pair[0]}V{pair[1]}", assignment_config([pair] * n_layers, base_config(), name=f"K{pair[0]}V{pair[1]}")))
    rows = []
    for label, config in configs:
        t0 = time.perf_counter()
        r = evaluate(model, windows, config)
        nominal = sum(pair_bits((layer.key.bits, layer.value.bits)) for layer in config.layers) / len(config.layers)
        rows.append(dict(label=label, nominal_bits=nominal, **r.as_dict(), seconds=round(time.perf_counter() - t0, 1)))
        print(json.dumps(rows[-1]), flush=True)
        saved["rows"] = rows
        save()
    print(f"\nSmolLM2-135M, {rows[0]['tokens']} held-out pydoc tokens ({result_path})")
    print("| config | nominal bits | bits/elem @4096 | PPL | ΔPPL vs fp | KL | top-1 agree |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: (r["nominal_bits"], r["label"])):
        print(f"| {r['label']} | {r['nominal_bits']:.2f} | {r['avg_bits_at_4096']:.2f} | {r['ppl']:.3f} | "
              f"{100 * (r['ppl_ratio'] - 1):+.2f}% | {r['kl']:.4f} | {r['token_agreement']:.3f} |")
    for t in saved["timings"]:
        print(f"kvq tune --max-avg-bits {t['budget']}: {t['seconds']:.0f} s" + (" (profile reused)" if t["profile_reused"] else " (profiling included)"))


if __name__ == "__main__":
    main()
