"""One-token append: what the NaN/Inf check costs (kvq_ao.finite) on each append path.

A cache of SmolLM2's shape (30 layers, 3 KV heads, head_dim 64, float32) starts with `--prefill`
tokens, then appends one token per layer per step, `--steps` steps (block completions included,
so the per-block work is amortized as in decoding). Each round times the same appends with the
check on and off (`refuse_non_finite` replaced by a pass-through), alternating which goes first;
the table gives the median over rounds of (on - off) / off. On this shared VM that difference
of two ~equal timings moves by a few percent between runs, so the check is also timed directly:
with the check on, the time spent inside `refuse_non_finite` (a perf_counter pair around each
call, ~0.1 us) over the whole step time; the median of that share over rounds is the `in-check`
column, the figure the issue's budget is judged by.

The native CPU kernels are loaded first, as `quantize_kv_` loads them (their use is recorded).
With them the two writers scan their input for NaN/Inf themselves and the cache runs no check in
Python on a clean append (kvq_ao/finite.py), so on/off and in-check measure nothing there; the
scan, which cannot be switched off inside the kernels, is timed alone (native_scan.cpp, built
with the kernels' flags) and charged as two scans per layer and step: `native_scan_pct`.

Paths: the eager dynamic cache (every decode step outside torch.compile) and the eager static
cache (generate's `cache_implementation="static"` without compiling). Compiled and exported code
carry no check (kvq_ao/finite.py says why), so there is nothing to time there. Presets: kivi-4 (window of 128), kvquant-3-1pct (calibrated key ranges: the
native one-token key append) and int4-token (no window: every append quantizes).

Reproduce (docs/reliability.md):
    python benchmarks/append.py --out results/append/append_check_cost.json
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save_json, stamp  # noqa: E402

LAYERS, HEADS, HEAD_DIM = 30, 3, 64
PATHS = ("eager-dynamic", "eager-static")


@functools.cache
def _calibration_and_rope(preset: str):
    """SmolLM2's calibration and rotary embedding for `preset` (loaded once, not per timing)."""
    from kvq_ao import KVQuantConfig
    from kvq_ao.api import calibration_for, rope_for
    from kvq_ao.models import load_model

    cfg = KVQuantConfig.preset(preset)
    if not (cfg.needs_calibration or cfg.pre_rope_keys):
        return None, None
    model, _ = load_model("smollm2", log=lambda *a: None)
    return calibration_for(model, cfg), rope_for(model, cfg)


def _cache(preset: str, static_len: int | None):
    from kvq_ao import KVQuantConfig, QuantizedKVCache

    calibration, rope = _calibration_and_rope(preset)
    return QuantizedKVCache(KVQuantConfig.preset(preset), LAYERS, max_cache_len=static_len, calibration=calibration, rope=rope)


def _timed(path: str, preset: str, prefill: int, steps: int, check: bool) -> tuple[float, float]:
    """(seconds per step (all layers) of `steps` one-token appends after a prefill, seconds per
    step spent inside the check)."""
    import kvq_ao.cache as cache_module
    from kvq_ao.finite import refuse_non_finite

    in_check = [0.0]

    def timed_check(blocks, first, layer):
        t0 = time.perf_counter()
        try:
            refuse_non_finite(blocks, first, layer)
        finally:
            in_check[0] += time.perf_counter() - t0

    cache_module.refuse_non_finite = timed_check if check else (lambda blocks, first, layer: None)
    try:
        cache = _cache(preset, None if path == "eager-dynamic" else prefill + steps + 1)
        g = torch.Generator().manual_seed(0)
        kv = torch.randn(2, LAYERS, 1, HEADS, prefill + steps, HEAD_DIM, generator=g)
        for i, layer in enumerate(cache.layers):
            layer.update(kv[0, i, :, :, :prefill], kv[1, i, :, :, :prefill])
            if path == "eager-dynamic":
                layer.ensure_capacity(prefill + steps, exact=True)  # no growth copy inside the timed steps

        def step(k: torch.Tensor, v: torch.Tensor) -> None:
            for i, layer in enumerate(cache.layers):
                layer.update(k[i], v[i])

        tokens = [(kv[0, :, :, :, t : t + 1].clone(), kv[1, :, :, :, t : t + 1].clone()) for t in range(prefill, prefill + steps)]
        with torch.no_grad():
            for k, v in tokens[:8]:  # warm-up
                step(k, v)
            in_check[0] = 0.0
            start = time.perf_counter()
            for k, v in tokens[8:]:
                step(k, v)
        return (time.perf_counter() - start) / (steps - 8), in_check[0] / (steps - 8)
    finally:
        cache_module.refuse_non_finite = refuse_non_finite


def _native_scan_ns(entries: int) -> float:
    """ns per call of the native appends' NaN/Inf scan over `entries` float32 (native_scan.cpp,
    built with the kernels' flags)."""
    import subprocess
    import tempfile

    from kvq_ao.kernels import cpu

    here = Path(__file__).resolve().parent
    with tempfile.TemporaryDirectory() as tmp:
        cpu.write_generated_header(Path(tmp))
        binary = Path(tmp) / "native_scan"
        subprocess.run(["g++", *cpu.CFLAGS, f"-I{here.parent / 'kernels' / 'cpu'}", f"-I{tmp}", str(here / "native_scan.cpp"),
                        "-o", str(binary)], check=True)  # fmt: skip
        return float(subprocess.run([str(binary), str(entries)], check=True, capture_output=True, text=True).stdout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="kivi-4,kvquant-3-1pct,int4-token")
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--prefill", type=int, default=1024)
    p.add_argument("--steps", type=int, default=264)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="results/append/append_check_cost.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kvq_ao.kernels import cpu

    # the appends as users run them: quantize_kv_ loads the native kernels (kvq.quantize and
    # kvq.quantize_fixed on CPU); without them every append would time the reference's ATen ops
    native = cpu.load()
    print(f"native CPU kernels: {'in use' if native else 'not in use (KVQ_AO_NATIVE=0, or no compiler): the reference ops serve the appends'}")
    # with them the check is the writers' own scan (refuse_non_finite runs only to name a refused
    # entry): timed alone, it is charged per kind and layer of every append that quantizes
    scan_ns = _native_scan_ns(HEADS * HEAD_DIM) if native else None
    if scan_ns is not None:
        print(f"native NaN/Inf scan: {scan_ns:.1f} ns per kind and layer ({HEADS} x {HEAD_DIM} float32)")
    rows = []
    for path in args.paths.split(","):
        for preset in args.presets.split(","):
            on, off, share = [], [], []
            for r in range(args.rounds):
                order = (True, False) if r % 2 == 0 else (False, True)
                for check in order:
                    seconds, in_check = _timed(path, preset, args.prefill, args.steps, check)
                    (on if check else off).append(seconds)
                    if check:
                        share.append(in_check / seconds)
            cost = statistics.median((a - b) / b for a, b in zip(on, off)) * 100
            rows.append(dict(path=path, preset=preset, check_on_us=round(statistics.median(on) * 1e6, 1),
                             check_off_us=round(statistics.median(off) * 1e6, 1), cost_pct=round(cost, 2),
                             in_check_pct=round(statistics.median(share) * 100, 2)))  # fmt: skip
            if scan_ns is not None:  # an upper bound: every step charged two scans per layer, as if each quantized
                rows[-1]["native_scan_pct"] = round(2 * LAYERS * scan_ns * 1e-3 / rows[-1]["check_on_us"] * 100, 3)
            print(f"{path:16} {preset:15} on {rows[-1]['check_on_us']:8.1f} us  off {rows[-1]['check_off_us']:8.1f} us  "
                  f"cost {cost:+.2f}%  in-check {rows[-1]['in_check_pct']:.2f}%  native scan {rows[-1].get('native_scan_pct', '-')}%",
                  flush=True)  # fmt: skip
    out = save_json(args.out, stamp(layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, prefill=args.prefill, steps=args.steps,
                                    rounds=args.rounds, threads=args.threads, native_kernels=native, native_scan_ns=scan_ns, rows=rows))  # fmt: skip
    print("\n| path | preset | append, check on (us/step, 30 layers) | check off | on - off | in-check | native scan |\n"
          "|---|---|---:|---:|---:|---:|---:|")  # fmt: skip
    for r in rows:
        print(f"| {r['path']} | {r['preset']} | {r['check_on_us']} | {r['check_off_us']} | {r['cost_pct']:+.2f}% | "
              f"{r['in_check_pct']:.2f}% | {r.get('native_scan_pct', '-')}% |")  # fmt: skip
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
