"""Decode steps of the fp cache and a quantized cache (eager and compiled), interleaved in one process.

`decode_step.py` times each variant in a fresh process, which is right for memory but leaves
speed to whatever phase a shared machine is in during that process: on the 2-core VM these docs
were measured on, the same step moved by 10-15% between runs, as much as the difference between
the eager fp and kivi-4 steps at 2k tokens. Here each variant loads a model of its own, all caches are
prefilled with the same random tokens (chunks of 512), and the timed steps alternate: one step
of each variant in turn, `--rounds` times, so all see the same phases. Variants: `eager-fp`
(transformers' DynamicCache), `eager-kvq` (the dynamic quantized cache) and `compiled-kvq` (a
static quantized cache of capacity n + warm-up + rounds, the step under torch.compile with
fullgraph; compilation happens in the warm-up steps). Each variant's median ms per step; rows in
results/decode_step_interleaved/decode_step_interleaved.json.

    python benchmarks/decode_step_interleaved.py --lengths 2048,8192 --preset kivi-4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import machine, save_json, smollm2, stamp


VARIANTS = ("eager-fp", "eager-kvq", "compiled-kvq")
WARMUP = 3


def prefilled(variant: str, preset: str, ids: torch.Tensor, threads: int, capacity: int):
    """[forward(token) -> logits, next token] of a model of its own after prefilling `ids`."""
    from transformers import DynamicCache

    from kvq_ao import KVQuantConfig, make_cache, quantize_kv_

    model, _ = smollm2(threads)
    if variant == "eager-fp":
        cache = DynamicCache()
    else:
        config = KVQuantConfig.preset(preset)
        quantize_kv_(model, config)
        cache = make_cache(model, config, max_cache_len=capacity if variant == "compiled-kvq" else None)
    with torch.no_grad():
        for start in range(0, ids.shape[1], 512):
            out = model(ids[:, start : start + 512], cache=cache, use_cache=True)

    def forward(token: torch.Tensor) -> torch.Tensor:
        return model(token, cache=cache, use_cache=True).logits

    if variant == "compiled-kvq":
        forward = torch.compile(forward, fullgraph=True)
    return [forward, out.logits[:, -1:].argmax(-1)]


def step(state: list) -> float:
    """One greedy decode step of `state` (updated in place); its wall time in ms."""
    forward, token = state
    t0 = time.perf_counter()
    with torch.no_grad():
        logits = forward(token)
    state[1] = logits[:, -1:].argmax(-1)
    return 1000 * (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--preset", default="kivi-4")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--out", default="results/decode_step_interleaved/decode_step_interleaved.json")
    args = parser.parse_args()
    print(f"{machine()}, {args.threads} threads", flush=True)
    names = [v for v in args.variants.split(",") if v]
    if unknown := set(names) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    rows = []
    for n in [int(x) for x in args.lengths.split(",")]:
        ids = torch.randint(100, 20000, (1, n), generator=torch.Generator().manual_seed(0))
        capacity = n + WARMUP + args.rounds + 1
        states = {name: prefilled(name, args.preset, ids, args.threads, capacity) for name in names}
        for state in states.values():  # warm-up (and compilation)
            for _ in range(WARMUP):
                step(state)
        times = {name: [] for name in states}
        for _ in range(args.rounds):
            for name, state in states.items():
                times[name].append(step(state))
        fp = statistics.median(times["eager-fp"]) if "eager-fp" in times else float("nan")
        for name, t in times.items():
            rows.append(dict(variant=name, cached_tokens=n, ms_per_token=statistics.median(t), min_ms=min(t)))
            print(f"{name:13} {n:>7} tokens  median {rows[-1]['ms_per_token']:7.1f} ms  min {min(t):7.1f} ms  "
                  f"{rows[-1]['ms_per_token'] / fp:.2f}x of eager fp", flush=True)  # fmt: skip
        save_json(args.out, stamp(threads=args.threads, rounds=args.rounds, preset=args.preset, rows=rows))
        states = None


if __name__ == "__main__":
    main()
