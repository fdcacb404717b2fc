"""Eager decode steps of the fp cache and a quantized cache, interleaved in one process.

`decode_step.py` times each variant in a fresh process, which is right for memory but leaves
speed to whatever phase a shared machine is in during that process: on the 2-core VM these docs
were measured on, the same step moved by 10-15% between runs, as much as the difference between
the eager fp and kivi-4 steps at 2k tokens. Here both models are loaded, both caches are
prefilled with the same random tokens (chunks of 512), and the timed steps alternate: one fp
step, one quantized step, `--rounds` times, so both see the same phases. Each variant's median ms
per step; rows in results/decode_step_interleaved.json.

    python benchmarks/decode_step_interleaved.py --lengths 2048,8192 --preset kivi-4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import machine, save_json, smollm2, stamp


def prefilled(preset: str, ids: torch.Tensor, threads: int):
    """[model, cache, next token] after prefilling `ids` (preset "fp": transformers' DynamicCache)."""
    from transformers import DynamicCache

    from kvq_ao import KVQuantConfig, make_cache, quantize_kv_

    model, _ = smollm2(threads)
    if preset == "fp":
        cache = DynamicCache()
    else:
        config = KVQuantConfig.preset(preset)
        quantize_kv_(model, config)
        cache = make_cache(model, config)
    with torch.no_grad():
        for start in range(0, ids.shape[1], 512):
            out = model(ids[:, start : start + 512], past_key_values=cache, use_cache=True)
    return [model, cache, out.logits[:, -1:].argmax(-1)]


def step(state: list) -> float:
    """One greedy decode step of `state` (updated in place); its wall time in ms."""
    model, cache, token = state
    t0 = time.perf_counter()
    with torch.no_grad():
        logits = model(token, past_key_values=cache, use_cache=True).logits
    state[2] = logits[:, -1:].argmax(-1)
    return 1000 * (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--preset", default="kivi-4")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="results/decode_step_interleaved.json")
    args = parser.parse_args()
    print(f"{machine()}, {args.threads} threads", flush=True)
    rows = []
    for n in [int(x) for x in args.lengths.split(",")]:
        ids = torch.randint(100, 20000, (1, n), generator=torch.Generator().manual_seed(0))
        states = {name: prefilled(name, ids, args.threads) for name in ("fp", args.preset)}
        for state in states.values():  # warm-up
            for _ in range(3):
                step(state)
        times = {name: [] for name in states}
        for _ in range(args.rounds):
            for name, state in states.items():
                times[name].append(step(state))
        fp = statistics.median(times["fp"])
        for name, t in times.items():
            rows.append(dict(variant=f"eager-{name}", cached_tokens=n, ms_per_token=statistics.median(t), min_ms=min(t)))
            print(f"{name:10} {n:>7} tokens  median {rows[-1]['ms_per_token']:7.1f} ms  min {min(t):7.1f} ms  "
                  f"{rows[-1]['ms_per_token'] / fp:.2f}x of eager fp", flush=True)  # fmt: skip
        save_json(args.out, stamp(threads=args.threads, rounds=args.rounds, preset=args.preset, rows=rows))
        states = None


if __name__ == "__main__":
    main()
