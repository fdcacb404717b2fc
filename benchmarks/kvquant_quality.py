"""KVQuant on SmolLM2: preset quality and the ablations, on held-out pydoc text.

Calibration uses pydoc's calibration half (16 x 512 tokens); evaluation uses the evaluation half
(8 windows x 1025 tokens = 8192 predicted tokens for presets, the first 4 windows for ablations;
fresh cache per window, chunks of 64), so the two never overlap. Rows are merged into the results
file as they finish, so the table can be filled by several invocations. Presets use the model's calibrations in the user cache (`kvq calibrate`, or
made here on first use); each ablation changes one thing of `kvquant-B-1pct` and is calibrated
for itself. Prints a markdown table and writes results/kvquant_quality/kvquant.json.

    python benchmarks/kvquant_quality.py [--bits 3,2] [--presets a,b,config.json] [--skip-ablations]
    python benchmarks/kvquant_quality.py --presets kvquant-3-1pct --sink 1 --residual 0 --skip-ablations

`--sink S` / `--residual N` evaluate the presets with another layout (S sink tokens, an N-token
full-precision window), as rows labelled `<preset> [sink S, window N]`: the paper's layout is
`--sink 1 --residual 0`. A changed sink is calibrated for itself; the window needs no calibration.
"""

import argparse
import dataclasses
import json
import time
from pathlib import Path


from kvq_ao import KVQuantConfig
from kvq_ao.calibration import calibrate, collect
from kvq_ao.config import LayerKV
from kvq_ao.eval import evaluate
from kvq_ao.models import pydoc_text, text_windows

from common import eval_windows, save_json, smollm2, stamp

PRESETS = ["kivi-4", "kivi-3", "kivi-2", "kvquant-4", "kvquant-4-1pct", "kvquant-3", "kvquant-3-1pct", "kvquant-2", "kvquant-2-1pct"]


def ablations(bits: int) -> list[tuple[str, KVQuantConfig, dict]]:
    """(label, config, calibrate kwargs): each changes one thing of kvquant-<bits>-1pct in the
    paper's layout (a 1-token sink, no full-precision window), the parts KVQuant's paper ablates."""
    base = dataclasses.replace(KVQuantConfig.preset(f"kvquant-{bits}-1pct"), sink_tokens=1, residual_length=0)
    k, v = base.default.key, base.default.value

    def with_dtype(dtype):
        return dataclasses.replace(base, default=LayerKV(dataclasses.replace(k, dtype=dtype), dataclasses.replace(v, dtype=dtype)))

    return [
        ("full (nuq, pre-RoPE, 1% outliers, sink, Fisher)", base, {}),
        ("uniform int instead of nuq", with_dtype("int"), {}),
        ("NormalFloat levels instead of nuq", with_dtype("nf"), {}),
        ("post-RoPE keys", dataclasses.replace(base, pre_rope_keys=False), {}),
        ("no outliers", dataclasses.replace(base, default=LayerKV(dataclasses.replace(k, outliers=0.0), dataclasses.replace(v, outliers=0.0))), {}),
        ("no sink token", dataclasses.replace(base, sink_tokens=0), {}),
        ("unweighted k-means", base, {"fisher": False}),
        other_value_outlier_rule(base),
    ]


def other_value_outlier_rule(base: KVQuantConfig) -> tuple[str, KVQuantConfig, dict]:
    """The preset's value outliers judged the other way (per vector online <-> calibrated per channel)."""
    v = base.default.value
    other = "channel" if v.outlier_rule == "vector" else "vector"
    label = {"vector": "value outliers per vector (online)", "channel": "value outliers by calibrated channel thresholds"}[other]
    return label, dataclasses.replace(base, default=LayerKV(base.default.key, dataclasses.replace(v, outlier_rule=other))), {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bits", default="3,2", help="ablation bit widths")
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--skip-ablations", action="store_true")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--ablation-windows", type=int, default=4, help="windows for the ablation rows (4 x 1025 = 4096 tokens)")
    parser.add_argument("--window-len", type=int, default=1025)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--residual", type=int, default=None, help="evaluate the presets with an N-token fp window instead of theirs")
    parser.add_argument("--sink", type=int, default=None, help="evaluate the presets with S sink tokens instead of theirs (calibrated for it)")
    parser.add_argument("--out", default="results/kvquant_quality/kvquant.json")
    args = parser.parse_args()
    model, tok = smollm2(args.threads)
    windows = eval_windows(tok, args.windows, args.window_len)
    ablation_windows = windows[: args.ablation_windows]
    calib_ids = text_windows(tok, pydoc_text("calib"), 16, 512)
    out = Path(args.out)
    saved = json.loads(out.read_text())["rows"] if out.exists() else []

    def run(table: str, label: str, config: KVQuantConfig) -> None:
        t0 = time.perf_counter()
        r = evaluate(model, windows if table == "presets" else ablation_windows, config)
        row = dict(table=table, label=label, **r.as_dict(), seconds=round(time.perf_counter() - t0, 1))
        print(json.dumps(row), flush=True)
        # merged into the results file as it goes: separate invocations fill one table
        keep = [x for x in saved if (x["table"], x["label"]) != (table, label)]
        saved[:] = keep + [row]
        save_json(out, stamp(threads=args.threads, rows=saved))

    acts = {}  # calibration activations per pre_rope_keys setting: one pass over the model serves every fit

    def activations(pre_rope: bool):
        if pre_rope not in acts:
            acts[pre_rope] = collect(model, calib_ids, pre_rope)
        return acts[pre_rope]

    for name in [p for p in args.presets.split(",") if p]:
        if name.endswith(".json"):  # a config file (e.g. benchmarks/configs/, or `kvq tune`'s output)
            config = KVQuantConfig.load(name)
            name = config.name
        else:
            config = KVQuantConfig.preset(name)  # calibrates on first use (user cache)
        if args.residual is not None or args.sink is not None:
            sink = config.sink_tokens if args.sink is None else args.sink
            window = config.residual_length if args.residual is None else args.residual
            changed = dataclasses.replace(config, sink_tokens=sink, residual_length=window)
            if config.needs_calibration and sink != config.sink_tokens:  # the fit depends on the sink, not the window
                path = calibrate(model, None, changed, activations=activations(changed.pre_rope_keys)).save(Path("/tmp/kvq-layout") / f"{name}-sink{sink}.json")
                changed = dataclasses.replace(changed, calibration=str(path))
            config, name = changed, f"{name} [sink {sink}, window {window}]"
        run("presets", name, config)
    if not args.skip_ablations:
        for bits in [int(b) for b in args.bits.split(",")]:
            for label, config, kwargs in ablations(bits):
                if config.needs_calibration:
                    calib = calibrate(model, None, config, activations=activations(config.pre_rope_keys), **kwargs)
                    path = calib.save(Path("/tmp/kvq-ablation") / f"{bits}-{abs(hash(label))}.json")
                    config = dataclasses.replace(config, calibration=str(path))
                run(f"ablation-{bits}bit", label, dataclasses.replace(config, name=f"{bits}bit: {label}"))
    print(f"\nSmolLM2-135M, held-out pydoc text ({out})")
    print("| table | config | tokens | PPL | fp PPL | ΔPPL | 95% interval | KL | top-1 agree | bits/elem @4096 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in saved:
        ci = r.get("ppl_ratio_ci95")  # rows measured before the interval existed have none
        span = f"{100 * (ci[0] - 1):+.2f}% .. {100 * (ci[1] - 1):+.2f}%" if ci else "-"
        print(f"| {r['table']} | {r['label']} | {r['tokens']} | {r['ppl']:.3f} | {r['ppl_fp']:.3f} | {100 * (r['ppl_ratio'] - 1):+.2f}% | "
              f"{span} | {r['kl']:.4f} | {r['token_agreement']:.3f} | {r['avg_bits_at_4096']:.2f} |")


if __name__ == "__main__":
    main()
