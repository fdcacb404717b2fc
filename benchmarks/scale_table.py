"""What a context-parallel quantized cache needs for 1M and 10M tokens of 7-8B models on 8 GPUs.

Derived, not run on GPUs: every figure comes from a quantity measured or checked here.
* Cache bytes come from `kvq_ao.estimate`, the memory accounting whose figures the tests compare
  with the bytes a live cache holds; it is checked again against the per-rank bytes the
  context-parallel SmolLM2 run measured (results/context_parallel/context_parallel.json, section "long").
* A rank holds 1/world of every body (segments dealt round-robin) plus the whole side store
  (sink and window: every rank keeps it; rank 0 reads it).
* Bytes exchanged per decode step: one all-gather per layer of each rank's (out, log-sum-exp),
  batch x query heads x (head_dim + 1) float32, the message `kvq_ao.parallel.merge.gather_merge`
  sends (checked against the size of the tensor it packs for SmolLM2).
* Step latency bound: each rank reads the weights (replicated) and its share of the cache once
  per step at the GPU's memory bandwidth (H100 SXM 3.35 TB/s, H200 4.8 TB/s, vendor figures),
  plus one all-gather latency per layer (assumed 20 us on NVLink, not measured here).

    python benchmarks/scale_table.py [--measured results/context_parallel/context_parallel.json] [--out results/scale_table/scale_table.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from common import save_json, stamp

SHAPES = {  # layers, query heads, kv heads, head_dim, parameters
    "LLaMA-7B": (32, 32, 32, 128, 6.74e9),
    "Llama-3-8B": (32, 32, 8, 128, 8.03e9),
}
PRESETS = {4: "kvquant-4-1pct", 3: "kvquant-3-1pct", 2: "kvquant-2-1pct"}
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}
GPU_MEMORY = {"H100": 80e9, "H200": 141e9}
ALLGATHER_S = 20e-6
WORLD = 8


def side_bytes(config, layers: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """The side store every rank keeps: sink + window + one block, keys and values, every layer."""
    positions = config.sink_tokens + config.residual_length + max(s.token_block for s in config.resolve(layers))
    side_dtype_bytes = dtype_bytes if config.side_dtype == "model" else 2
    return positions * 2 * layers * kv_heads * head_dim * side_dtype_bytes


def check_measured(path: Path) -> dict | None:
    """The accounting against the context-parallel run's per-rank bytes (SmolLM2, 30 layers, 3 kv heads, d 64)."""
    from kvq_ao import KVQuantConfig, estimate

    if not path.exists():
        return None
    rows = [r for r in json.loads(path.read_text())["rows"] if r["section"] == "long"]
    if not rows:
        return None
    row = rows[-1]
    config = KVQuantConfig.preset(row["preset"])
    world, tokens = row["world"], row["cached_tokens"]
    whole = estimate(config, 30, 3, 64, tokens, dtype=torch.float32).bytes
    side = side_bytes(config, 30, 3, 64, dtype_bytes=4)
    predicted = (whole - side) / world + side
    measured = [r["cache_mib"] * 2**20 for r in row["ranks"]]
    return dict(preset=row["preset"], world=world, tokens=tokens, predicted_per_rank_mib=predicted / 2**20,
                measured_per_rank_mib=[m / 2**20 for m in measured],
                worst_relative_error=max(abs(m - predicted) / predicted for m in measured),
                message_bytes_per_layer=9 * (64 + 1) * 4)  # fmt: skip


def table() -> list[dict]:
    from kvq_ao import KVQuantConfig, estimate

    rows = []
    for shape, (layers, q_heads, kv_heads, head_dim, params) in SHAPES.items():
        for bits, preset in PRESETS.items():
            config = KVQuantConfig.preset(preset)
            for tokens in (2**20, 10 * 2**20):
                report = estimate(config, layers, kv_heads, head_dim, tokens, dtype=torch.float16)
                side = side_bytes(config, layers, kv_heads, head_dim)
                per_rank = (report.bytes - side) / WORLD + side
                weights = 2 * params
                message = layers * q_heads * (head_dim + 1) * 4  # one rank's (out, lse) per step, batch 1
                row = dict(shape=shape, bits=bits, preset=preset, tokens=tokens, bits_per_element=report.bits_per_element,
                           cache_gb=report.bytes / 1e9, per_rank_cache_gb=per_rank / 1e9, weights_gb=weights / 1e9,
                           sent_per_step_kb=message / 1e3, received_per_step_kb=message * (WORLD - 1) / 1e3)  # fmt: skip
                for gpu, bw in BANDWIDTH.items():
                    row[f"fits_{gpu}"] = per_rank + weights < GPU_MEMORY[gpu]
                    row[f"step_ms_{gpu}"] = 1e3 * ((per_rank + weights) / bw + layers * ALLGATHER_S)
                rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measured", default="results/context_parallel/context_parallel.json")
    p.add_argument("--out", default="results/scale_table/scale_table.json")
    args = p.parse_args()
    check = check_measured(Path(args.measured))
    rows = table()
    save_json(args.out, dict(**stamp(command="python benchmarks/scale_table.py"), world=WORLD, check=check, rows=rows))
    if check:
        print(f"accounting check ({check['preset']}, {check['tokens']} tokens over {check['world']} ranks): predicted "
              f"{check['predicted_per_rank_mib']:.1f} MiB a rank, measured {[round(m, 1) for m in check['measured_per_rank_mib']]}")  # fmt: skip
    print(f"| model | bits | tokens | bits/elem | cache GB | per rank GB (x{WORLD}) | weights GB | sent/recv KB a step | "
          "step ms H100 | step ms H200 |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        fits = "" if r["fits_H100"] else " (over 80 GB)"
        print(f"| {r['shape']} | {r['bits']} | {r['tokens'] // 2**20}M | {r['bits_per_element']:.2f} | {r['cache_gb']:.0f} | "
              f"{r['per_rank_cache_gb']:.1f}{fits} | {r['weights_gb']:.1f} | {r['sent_per_step_kb']:.0f} / {r['received_per_step_kb']:.0f} | "
              f"{r['step_ms_H100']:.1f} | {r['step_ms_H200']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
