"""Registers, spills and inner-loop loads of the Triton kernels the presets use, compiled ahead of
time for real GPUs.

No GPU needed: the launches generate() makes with each preset are recorded on a one-layer random
model of SmolLM2's attention shape (bfloat16, Triton's interpreter on CPU tensors), then compiled by
triton's own compiler for each --capabilities target and assembled by its bundled ptxas, whose
report gives registers, spill bytes, stack and shared memory per kernel (`kvq_ao.kernels.gpu.aot`).
For the decode split and chunk kernels it also counts, in the generated PTX, the global loads one
thread issues per iteration of the body loop (`aot.loop_loads`: instruction and width), beside the tokens an
iteration covers and the packed bytes those tokens hold: every byte read once, in wide loads.
tests/kernels/test_triton_aot.py compiles these and the format matrix on every CI run; this
writes the tables: results/triton_aot/presets.json.

    python benchmarks/triton_aot.py --presets kivi-4,kivi-2,kvquant-3-1pct,kvquant-2-1pct
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from common import save_json, stamp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="int8,kivi-4,kivi-2,kvquant-4-1pct,kvquant-3-1pct,kvquant-2-1pct")
    parser.add_argument("--capabilities", default="80,90", help="compute capabilities (80: A100, 90: H100/H200)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--out", default="results/triton_aot/presets.json")
    args = parser.parse_args()

    import triton

    from kvq_ao.kernels import gpu
    from kvq_ao.kernels.gpu.aot import KernelReport, compile_all, compiled, loop_loads, preset_launches, unique

    if not gpu.load():
        raise SystemExit("triton is not installed: pip install 'kvq_ao[gpu]'")
    presets = [p for p in args.presets.split(",") if p]
    capabilities = [int(c) for c in args.capabilities.split(",")]
    rows = []
    for preset in presets:
        launches = unique(preset_launches([preset], getattr(torch, args.dtype)))
        for launch, capability, result in compile_all(launches, capabilities):
            if not isinstance(result, KernelReport):
                raise SystemExit(f"{preset}: {launch.label()} does not compile for sm_{capability}: {result}")
            row = dict(preset=preset, kernel=launch.kernel, sm=capability, specialization=launch.label(), **dataclasses.asdict(result))
            if launch.kernel in ("_decode_split", "_chunk_attention"):
                census = loop_loads(compiled(launch, capability).asm["ptx"])
                consts, options = dict(launch.constexprs), dict(launch.options)
                threads = 32 * options.get("num_warps", 4)
                row.update(loop_loads=census["loop"], outside_loads=census["outside"], loop_bytes_per_thread=census["loop_bytes"],
                           threads=threads, tokens_per_iteration=consts["BLOCK_T"],
                           loop_bytes=census["loop_bytes"] * threads)  # fmt: skip
            rows.append(row)
    print("| preset | kernel | sm | registers | spill stores / loads (bytes) | stack | shared |\n|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['preset']} | {r['kernel']} | {r['sm']} | {r['registers']} | {r['spill_stores']} / {r['spill_loads']} "
              f"| {r['stack']} | {r['shared']} |")  # fmt: skip
    print("\n| preset | kernel | sm | global loads a thread issues per body-loop iteration | bytes a thread | threads "
          "| tokens an iteration | bytes an iteration |\n|---|---|---|---|---:|---:|---:|---:|")  # fmt: skip
    for r in rows:
        if "loop_loads" in r:
            loads = ", ".join(f"{n} x {k}" for k, n in sorted(r["loop_loads"].items()))
            print(f"| {r['preset']} | {r['kernel']} | {r['sm']} | {loads} | {r['loop_bytes_per_thread']} | {r['threads']} | {r['tokens_per_iteration']} "
                  f"| {r['loop_bytes']} |")  # fmt: skip
    path = save_json(args.out, dict(**stamp(triton=triton.__version__, dtype=args.dtype, shape="SmolLM2: 9 q / 3 kv heads, D 64"),
                                    rows=rows))  # fmt: skip
    print(f"rows: {path}")


if __name__ == "__main__":
    main()
