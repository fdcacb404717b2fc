"""Would 8-bit per-vector metadata buy issue 47's budgets? A screening on development text.

Today every per-vector (token-axis) group stores a float16 scale and a float16 zero: 32 bits per 64
channels, half a bit of every element, a fifth of a 2.5-bit budget. This experiment measures, before
any kernel reads a new format, what two bytes per vector instead of four would buy:

* the scale as an 8-bit code on a log grid, 16 steps an octave (scale = base * 2**(c / 16); a
  256-code window covers 16 octaves, so one power-of-two base per layer and kind fits every
  scale seen), rounded up so that the range still covers the vector;
* the zero as an 8-bit fraction of the range: zero = -scale * levels * z / 255 (the integer zero
  point of asymmetric int8 quantization, 255 steps over the range instead of `levels`), rounded so
  that the range still covers the vector. A range that does not contain 0 is widened to 0.

The rounding is emulated, not stored: the reference quantizer (`KVQ_AO_NATIVE=0`, set here) runs with
`group_range` replaced for per-vector groups (calibrated per-channel ranges are left alone), so every
dequantized value is what a kernel reading the 8-bit fields would see. Bits per element at 4096
tokens count one byte per scale and zero of a per-vector group (everything else as the memory
report counts it).

Candidates: keys and values rotated per vector as `rot-k4v3`/`rot-k3v2` store them
(experiments/rotation.py's "rot tokens"), and at 2.5 bits KVQuant's keys without outliers beside
rotated per-vector values; each takes the largest full-precision window (a multiple of 16, at most
256) its budget leaves with 8-bit metadata. Two controls measure the rounding alone: `rot-k3v2`'s
layout (K3V2, window 112) with float16 and with 8-bit metadata, both through the reference quantizer.
Rule (as experiments/rotation.py, fixed before any row was seen): per budget, the lowest
development KL to the fp model.

    python experiments/lean_metadata.py [--budgets 4.5,3.5,2.5] [--windows 8]

`--held-out` then evaluates, once, each budget's chosen candidate (read from the development rows)
on the 48 held-out windows that issue 47's acceptance names (pydoc's evaluation half, 48 x 1025
tokens), calibrated as on development text: no choice is made on these rows.

    python experiments/lean_metadata.py --held-out   # -> results/rotation/lean_metadata_48windows.json

`--scale-spans` measures what a stored 8-bit scale code must cover: per layer and kind, the
smallest and largest per-vector range (max - min of a rotated vector, post-RoPE keys and values, the
sink token left out) over the calibration samples, in octaves. A 256-code window of 16 steps an
octave spans 16 octaves above its base.

    python experiments/lean_metadata.py --scale-spans  # -> results/rotation/lean_metadata_scale_spans.json

`--symmetric` runs each budget's 8-bit choice (and the control) with another two-byte encoding
instead: a float16 scale of the symmetric range [-max|x|, max|x|], the zero implied (-scale *
levels / 2), which a kernel reads with no new decoding.

    python experiments/lean_metadata.py --symmetric    # -> results/rotation/symmetric_metadata_dev.json
"""

import argparse
import dataclasses
import math
import os
from pathlib import Path

os.environ["KVQ_AO_NATIVE"] = "0"  # the reference quantizer, whose group_range is replaced below

import torch  # noqa: E402
from dev_text import calibrated_dev_row, dev_model, load_dev_rows, print_dev_table, save_dev_rows  # noqa: E402
from rotation import candidate  # noqa: E402

import kvq_ao.quant.codebook as codebook_mod  # noqa: E402
import kvq_ao.quant.uniform as uniform_mod  # noqa: E402
from kvq_ao.memory import body_bytes, _SIDE_POS_BYTES  # noqa: E402

STEPS_PER_OCTAVE = 16
ZERO_STEPS = 255
WINDOWS = range(256, -1, -16)
# budget -> (family, key bits, value bits)
CANDIDATES = {
    4.5: [("rot tokens", 4, 4), ("rot tokens", 4, 3)],
    3.5: [("rot tokens", 4, 2), ("rot tokens", 3, 3), ("rot tokens", 3, 2)],
    2.5: [("rot tokens", 2, 2), ("kvq keys, no outliers + rot values", 2, 2)],
}
CONTROL = ("rot tokens", 3, 2, 112)  # rot-k3v2's layout, float16 and 8-bit metadata
# --symmetric: each budget's 8-bit choice (lowest development KL) with the implied-zero range instead
SYMMETRIC_CANDIDATES = {4.5: [("rot tokens", 4, 3)], 3.5: [("rot tokens", 3, 2)], 2.5: [("kvq keys, no outliers + rot values", 2, 2)]}

_float16_group_range = uniform_mod.group_range


def _up_log(x: torch.Tensor) -> torch.Tensor:
    """x (> 0) rounded up to the log grid 2**(k / STEPS_PER_OCTAVE)."""
    k = torch.ceil(torch.log2(x.double()) * STEPS_PER_OCTAVE - 1e-9)
    return torch.exp2(k / STEPS_PER_OCTAVE)


def lean_group_range(g: torch.Tensor, dim: int, levels: int, scale_dtype: torch.dtype):
    """`group_range` with the scale on the 8-bit log grid and the zero an 8-bit fraction of the
    range, for per-vector groups (dim -1); other groups (calibrated, per-channel) as before."""
    if dim != -1:
        return _float16_group_range(g, dim, levels, scale_dtype)
    lo = g.amin(dim=dim, keepdim=True).double().clamp(max=0.0)
    hi = g.amax(dim=dim, keepdim=True).double().clamp(min=0.0)
    span = (hi - lo).clamp(min=1e-30)
    scale = _up_log(span / levels)
    while True:  # the zero's rounding can leave the top short: a grid step more covers it
        z = torch.ceil(-lo / (scale * levels) * ZERO_STEPS - 1e-9).clamp(0, ZERO_STEPS)
        zero = -scale * levels * z / ZERO_STEPS
        short = zero + levels * scale < hi
        if not bool(short.any()):
            break
        scale = torch.where(short, scale * 2 ** (1 / STEPS_PER_OCTAVE), scale)
    assert bool((zero <= lo + 1e-12).all()) and bool((zero + levels * scale >= hi - 1e-9 * hi.abs()).all())
    empty = (hi - lo) <= 0
    return torch.where(empty, lo, zero).float(), torch.where(empty, torch.zeros_like(scale), scale).float()


def symmetric_group_range(g: torch.Tensor, dim: int, levels: int, scale_dtype: torch.dtype):
    """`group_range` of a symmetric range for per-vector groups (dim -1): the float16 scale covers
    [-m, m], m = max |x|, and the zero is not stored but implied, -scale * levels / 2 (a rotated
    vector's channels are spread around 0). Other groups as before."""
    if dim != -1:
        return _float16_group_range(g, dim, levels, scale_dtype)
    m = torch.maximum(g.amin(dim=dim, keepdim=True).abs(), g.amax(dim=dim, keepdim=True).abs()).float()
    scale = uniform_mod._rounded(2 * m / levels, scale_dtype)
    short = scale.double() * levels < 2 * m.double()
    scale = torch.where(short, uniform_mod._step(scale, 1.0, scale_dtype), scale)
    return -scale * (levels / 2), scale


def use_lean_metadata(on: bool | str) -> None:
    """Route per-vector groups of both quantizers (uniform and codebook levels) through the 8-bit
    emulation (True), the implied-zero symmetric range ("symmetric"), or back to float16 (False)."""
    fn = symmetric_group_range if on == "symmetric" else lean_group_range if on else _float16_group_range
    uniform_mod.group_range = fn
    codebook_mod.group_range = fn


def bits_at_4096(config, lean: bool, layers: int = 30, heads: int = 3, head_dim: int = 64, tokens: int = 4096) -> float:
    """Bits per element as `kvq_ao.memory.estimate` counts them, with one byte per scale and zero of a
    per-vector group when `lean` (calibrated per-channel rows stay float16; they are one row a layer)."""
    total = 0
    for spec in config.resolve(layers):  # per layer: a tuned config's layers differ
        block = spec.token_block
        capacity = math.ceil(tokens / block) * block
        side = config.sink_tokens + config.residual_length + block
        for s in (spec.key, spec.value):
            per_vector = s.axis == "token" and s.ranges != "calibrated"
            total += body_bytes(s, heads, head_dim, capacity, 4, 1 if lean and per_vector else 2)
        total += 2 * heads * side * head_dim * 2 + side * _SIDE_POS_BYTES + 8
    return 8 * total / (2 * layers * heads * head_dim * tokens)


def fitted(budget: float, family: str, kb: int, vb: int):
    for window in WINDOWS:
        cfg = candidate(family, kb, vb, window)
        if bits_at_4096(cfg, lean=True) <= budget:
            return cfg
    return None


def held_out(dev_out: str, out: str, budgets: list[float], windows: int, threads: int) -> None:
    """Each budget's development choice (lowest KL), calibrated under the 8-bit emulation, on the
    held-out windows; rows merged into `out` as they finish."""
    import json
    import sys
    import time

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from common import eval_windows, save_json, stamp

    from kvq_ao.calibration import calibrate, collect
    from kvq_ao.eval import evaluate
    from kvq_ao.models import calibration_windows, load_model

    dev_rows = load_dev_rows(dev_out)
    torch.set_num_threads(threads)
    model, tok = load_model("smollm2")
    calib_ids, ids = calibration_windows(tok), eval_windows(tok, windows, 1025)
    saved = json.loads(Path(out).read_text())["rows"] if Path(out).exists() else []
    for b in budgets:
        chosen = min((r for r in dev_rows if r["budget"] == b), key=lambda r: r["kl"])
        cfg = candidate(chosen["family"], chosen["key_bits"], chosen["value_bits"], chosen["fp_window"])
        label = f"{cfg.name} 8-bit metadata"
        if any(r["label"] == label for r in saved):
            continue
        use_lean_metadata(True)
        t0 = time.perf_counter()
        path = calibrate(model, None, cfg, activations=collect(model, calib_ids, pre_rope=cfg.pre_rope_keys), progress=False).save(
            Path("/tmp/kvq-lean-metadata") / f"{label.replace(' ', '-')}-held-out.json")  # fmt: skip
        r = evaluate(model, ids, dataclasses.replace(cfg, calibration=str(path)))
        use_lean_metadata(False)
        row = dict(label=label, budget=b, dev_kl=chosen["kl"], **r.as_dict(), bits_lean=bits_at_4096(cfg, True),
                   seconds=round(time.perf_counter() - t0, 1))  # fmt: skip
        print(json.dumps(row), flush=True)
        saved.append(row)
        save_json(Path(out), stamp(threads=threads, text="pydoc evaluation half, held out", rows=saved))
    print(f"\nheld-out, {windows} windows ({out})")
    print("| budget | config | ΔPPL vs fp | 95% interval | KL | bits @4096 (8-bit metadata) |")
    print("|---|---|---:|---:|---:|---:|")
    for r in saved:
        print(f"| {r['budget']} | {r['label']} | {held_out_cells(r)} | {r['bits_lean']:.2f} |")


def held_out_cells(r: dict) -> str:
    """A held-out row's 'ΔPPL | 95% interval | KL' table cells."""
    lo, hi = r["ppl_ratio_ci95"]
    return f"{100 * (r['ppl_ratio'] - 1):+.2f}% | {100 * (lo - 1):+.2f} .. {100 * (hi - 1):+.2f} | {r['kl']:.4f}"


def scale_spans(out: str, threads: int) -> None:
    """Per layer and kind: log2 of the smallest and largest per-vector range of the rotated
    calibration activations (the sink token, kept in float, left out), and the octaves between."""
    import json

    from kvq_ao.calibration import collect
    from kvq_ao.models import calibration_windows, load_model
    from kvq_ao.quant.rotation import rotation_matrix

    torch.set_num_threads(threads)
    model, tok = load_model("smollm2")
    acts = collect(model, calibration_windows(tok), pre_rope=False)
    rows = []
    for kind in ("key", "value"):
        for layer, x in enumerate(acts.of(kind)[0]):  # [S, H, T, D]
            y = x[:, :, 1:, :].double() @ rotation_matrix(x.shape[-1]).double()
            span = (y.amax(-1) - y.amin(-1)).flatten()
            lo, hi = float(torch.log2(span.min())), float(torch.log2(span.max()))
            rows.append(dict(kind=kind, layer=layer, log2_min_range=round(lo, 3), log2_max_range=round(hi, 3), octaves=round(hi - lo, 3)))
    worst = max(rows, key=lambda r: r["octaves"])
    payload = dict(text="calibration samples (16 x 512 tokens), post-RoPE keys and values, rotated, sink left out", rows=rows,
                   widest=worst, log2_min_over_all=min(r["log2_min_range"] for r in rows), log2_max_over_all=max(r["log2_max_range"] for r in rows))  # fmt: skip
    Path(out).write_text(json.dumps(payload, indent=2) + "\n")
    for r in rows:
        print(f"{r['kind']:5} layer {r['layer']:2}: range 2^{r['log2_min_range']:+.2f} .. 2^{r['log2_max_range']:+.2f} ({r['octaves']:.2f} octaves)")
    print(f"widest: {worst['kind']} layer {worst['layer']}, {worst['octaves']:.2f} octaves; over all layers 2^{payload['log2_min_over_all']:+.2f} .. "
          f"2^{payload['log2_max_over_all']:+.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budgets", default="4.5,3.5,2.5")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="results/rotation/lean_metadata_dev.json")
    parser.add_argument("--held-out", action="store_true", help="evaluate each budget's development choice on the held-out windows")
    parser.add_argument("--held-out-windows", type=int, default=48)
    parser.add_argument("--held-out-out", default="results/rotation/lean_metadata_48windows.json")
    parser.add_argument("--scale-spans", action="store_true", help="measure the octaves a layer's per-vector ranges span")
    parser.add_argument("--symmetric", action="store_true",
                        help="the implied-zero symmetric range instead (-> results/rotation/symmetric_metadata_dev.json)")
    args = parser.parse_args()
    if args.scale_spans:
        scale_spans("results/rotation/lean_metadata_scale_spans.json", args.threads)
        return
    if args.held_out:
        held_out(args.out, args.held_out_out, [float(b) for b in args.budgets.split(",")], args.held_out_windows, args.threads)
        return
    budgets = [float(b) for b in args.budgets.split(",")]
    family, kb, vb, w = CONTROL
    mode = "symmetric" if args.symmetric else True
    out = "results/rotation/symmetric_metadata_dev.json" if args.symmetric else args.out
    plan = [(None, (family, kb, vb), candidate(family, kb, vb, w), lean) for lean in ((mode,) if args.symmetric else (False, True))]
    for b in budgets:
        for c in SYMMETRIC_CANDIDATES.get(b, []) if args.symmetric else CANDIDATES[b]:
            cfg = fitted(b, *c)
            print(f"budget {b}: {cfg.name if cfg else f'{c} fits no window: skipped'}")
            if cfg is not None:
                plan.append((b, c, cfg, mode))
    model, dev, activations_of = dev_model(args.threads, args.windows)
    rows = load_dev_rows(out)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    folder = Path("/tmp/kvq-lean-metadata")
    for budget, (family, kb, vb), cfg, lean in plan:
        kind = "symmetric" if lean == "symmetric" else "8-bit" if lean else "float16"
        label = f"{cfg.name} {kind} metadata"
        if any(r["config_label"] == label for r in rows):
            continue
        use_lean_metadata(lean)
        row = calibrated_dev_row(model, dev, activations_of(cfg.pre_rope_keys), cfg, folder / f"{label.replace(' ', '-')}.json",
                                 config_label=label, budget=budget, family=family, key_bits=kb, value_bits=vb,
                                 fp_window=cfg.residual_length, metadata=kind, bits_lean=bits_at_4096(cfg, bool(lean)))  # fmt: skip
        rows.append(row)
        save_dev_rows(out, rows)
    use_lean_metadata(False)
    chosen = {b: min((r for r in rows if r["budget"] == b), key=lambda r: r["kl"]) for b in budgets if any(r["budget"] == b for r in rows)}
    print_dev_table(f"development text: {'symmetric' if args.symmetric else '8-bit'} per-vector metadata (emulated)", rows,
                    {"budget": lambda r: str(r["budget"] or "control"), "family": lambda r: r["family"],
                     "K/V bits": lambda r: f"{r['key_bits']}/{r['value_bits']}", "window": lambda r: str(r["fp_window"]),
                     "metadata": lambda r: r["metadata"]},
                    {"bits/elem @4096": lambda r: f"{r['bits_lean']:.2f}",
                     "chosen (KL)": lambda r: "yes" if chosen.get(r["budget"]) is r else ""})  # fmt: skip


if __name__ == "__main__":
    main()
