"""What scoring keys against an integer query costs on SmolLM2: each preset's layout with float key
scores against the same layout with keys scored against an int8 (`--query int8`) or int16
(`--query int16`) query.

The twins (`QuantSpec(scores=...)`, `kvq_ao.format.INT8_QUERY`/`INT16_QUERY`) differ only in how
key scores are computed: q * scale rounded to 127 (int8) or 32512 (int16) steps a side once per
query head and scale row, integer dot products with the codes. Both run on the same held-out windows (the 48
windows of 1025 tokens the presets are judged on, fresh cache per window, chunks of 64, through
the package's own kernels), so the per-window difference of their mean NLL isolates the rounding.
Issue 48's budget: |dPPL| against the float scores within 0.05 points of percentage of fp PPL.

    python benchmarks/int8_query_quality.py --presets kivi-4,kivi-2 --windows 48
    python benchmarks/int8_query_quality.py --query int16 --presets kivi-4,kivi-2 --windows 48 --threads 1

`--query threads` measures the noise floor of that comparison: the float twin against itself run
with 2 threads instead of `--threads` (the model's matrix products then sum in another order, a
float rounding apart). Each window's cache is rebuilt from the model's own keys and values, which
are quantized again: a key that moves by a rounding error can cross a code boundary (a whole step at
2 bits), so any float-level change moves a window's PPL by more than the change itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

import torch
from scipy import stats

from kvq_ao.eval import evaluate_many

from common import eval_windows, preset_config, save_json, smollm2, stamp


def paired_points(nll_float: list[float], nll_int: list[float], ppl_fp: float) -> dict:
    """dPPL of the integer query against float scores in points of fp PPL, with a 95% t-interval over windows
    (the PPL ratio from the mean per-window NLL difference)."""
    diffs = torch.tensor(nll_int, dtype=torch.float64) - torch.tensor(nll_float, dtype=torch.float64)
    n = diffs.numel()
    mean, sd = diffs.mean().item(), diffs.std().item() if n > 1 else 0.0
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n) if n > 1 else 0.0
    ppl_float = math.exp(sum(nll_float) / n)
    points = lambda d: 100 * ppl_float * (math.exp(d) - 1) / ppl_fp  # noqa: E731
    return dict(dppl_points=points(mean), ci95=[points(mean - half), points(mean + half)], windows=n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="kivi-4,kivi-2")
    parser.add_argument("--windows", type=int, default=48)
    parser.add_argument("--window-len", type=int, default=1025)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--query", choices=("int8", "int16", "threads"), default="int8")
    parser.add_argument("--out", default=None, help="default results/int8_query/<query>_query_native.json")
    args = parser.parse_args()
    args.out = args.out or f"results/int8_query/{args.query}_query_native.json"
    model, tok = smollm2(args.threads)
    windows = eval_windows(tok, args.windows, args.window_len)
    rows = []
    for name in args.presets.split(","):
        float_cfg = preset_config(f"{name}/float")
        int_cfg = dataclasses.replace(float_cfg, name=f"{name}/float, 2 threads") if args.query == "threads" else \
            preset_config(f"{name}/{args.query}")  # fmt: skip
        configs = [float_cfg, int_cfg]
        start = time.time()
        nll = {c.name: [] for c in configs}
        nll_fp = []
        for i in range(windows.shape[0]):  # one window at a time: its NLL under each config
            if args.query == "threads":
                results = evaluate_many(model, windows[i : i + 1], configs[:1], progress=False)
                torch.set_num_threads(2)
                results += evaluate_many(model, windows[i : i + 1], configs[1:], progress=False)
                torch.set_num_threads(args.threads)
            else:
                results = evaluate_many(model, windows[i : i + 1], configs, progress=False)
            for c, r in zip(configs, results):
                nll[c.name].append(math.log(r.ppl))
            nll_fp.append(math.log(results[0].ppl_fp))
            print(f"\r{name}: window {i + 1}/{windows.shape[0]}", end="", flush=True)
        ppl_fp = math.exp(sum(nll_fp) / len(nll_fp))
        a, b = nll[float_cfg.name], nll[int_cfg.name]
        row = dict(preset=name, query=args.query, ppl_fp=ppl_fp, ppl_float=math.exp(sum(a) / len(nll_fp)),
                   **{f"ppl_{args.query}": math.exp(sum(b) / len(nll_fp))}, **paired_points(a, b, ppl_fp),
                   seconds=round(time.time() - start, 1))  # fmt: skip
        print(f"\r{name}: PPL fp {ppl_fp:.3f}, float scores {row['ppl_float']:.3f}, {args.query} query {row[f'ppl_{args.query}']:.3f}, "
              f"dPPL {row['dppl_points']:+.3f} points [{row['ci95'][0]:+.3f}, {row['ci95'][1]:+.3f}]")  # fmt: skip
        rows.append(row)
    save_json(args.out, dict(**stamp(windows=args.windows, window_len=args.window_len, threads=args.threads), rows=rows))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
