"""The native CPU decode kernel alone, without Python in the timed loop, across kernel revisions.

benchmarks/attention.py times the op as a model calls it, through the PyTorch dispatcher (~0.1 ms a
call here) on a VM whose speed drifts between runs. For work on the kernel itself this script
times `kvq_core::decode_attention` from a small C++ program (benchmarks/kernel_alone.cpp) on the
same layer attention.py builds (SmolLM2's head shape, random N(0, 1) tokens through the cache's own
`update()`), with the cache evicted before every call (`--evict-mib` rewritten before each; 0 keeps
it warm), and alternates the kernel of each given git revision round by round so that all see the
same phases of the machine. Each row: the min and
median ms over a round's calls (min over rounds), and a checksum of the output (revisions that
compute the same thing agree to ~1e-6). `--perf` adds where one thread's time goes in the last
revision's kernel: Linux perf's user-space samples by function, as shares of the kernel's own (the
eviction loop and file reading left out), from a build that keeps the tile loop's steps (RoPE
tables, rotation, scoring a float tile, masks, online softmax) out of line (KVQ_PROFILED; a call
costs a few cycles against a step's hundreds). What the compiler still inlines counts in its caller:
`decode_attention` is the rest of the tile loop.

    python benchmarks/kernel_alone.py --revisions ab5d6bd,HEAD --presets kivi-4,kivi-2,kvquant-3-1pct --threads 1,2
    python benchmarks/kernel_alone.py --presets kivi-4,kivi-2,kvquant-3-1pct,kvquant-2-1pct --threads 1 --perf
    python benchmarks/kernel_alone.py --presets kivi-4,kivi-2,kvquant-3-1pct --evict-mib 0   # warm: the layer stays in cache
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from common import save_json, smollm2, stamp

ROOT = Path(__file__).resolve().parents[1]
HEADER = "kernels/cpu/attention_core.h"


def dump_layer(op: dict, directory: Path) -> None:
    """The op's arguments as kernel_alone.cpp reads them: contiguous tensors and a meta.txt."""
    codes = {torch.float32: 6, torch.float16: 5, torch.bfloat16: 15, torch.uint8: 0, torch.int64: 4, torch.bool: 11}
    from kvq_ao.ops import named_arguments

    named = named_arguments((), op)
    flat = {n: v for n, v in named.items() if n not in ("k", "v")}
    for prefix in ("k", "v"):
        flat.update({f"{prefix}_{field}": value for field, value in named[prefix].fields().items()})
    lines = []
    for name, value in flat.items():
        if isinstance(value, torch.Tensor):
            value.contiguous().numpy().tofile(directory / f"{name}.bin")
            lines.append(f"T {name} {codes[value.dtype]} {value.dim()} {' '.join(map(str, value.shape))}")
        elif value is None:
            lines.append(f"N {name}")
        else:
            lines.append(f"S {name} {float(value)}")
    (directory / "meta.txt").write_text("\n".join(lines) + "\n")


def build(revision: str, directory: Path, *extra: str) -> Path:
    """kernel_alone.cpp compiled against the kernel header of a git revision (flags as the extension's,
    plus `extra`)."""
    from kvq_ao.kernels.cpu import CFLAGS

    include = directory / "include"
    include.mkdir(parents=True)
    header = subprocess.run(["git", "show", f"{revision}:{HEADER}"], cwd=ROOT, check=True, capture_output=True).stdout
    (include / "attention_core.h").write_bytes(header)
    from kvq_ao.kernels.cpu import GENERATED_HEADER, generated_header

    (include / GENERATED_HEADER).write_text(generated_header())  # this checkout's (revisions before it had none)
    binary = directory / "kernel_alone"
    subprocess.run(["g++", *CFLAGS, *extra, "-std=c++17", f"-I{include}", str(ROOT / "benchmarks/kernel_alone.cpp"), "-o", str(binary)],
                   check=True)  # fmt: skip
    return binary


NOT_THE_KERNEL = ("main", "evict", "eviction_buffer", "read_dump")  # the program's own functions


def function_name(symbol: str) -> str:
    """perf's symbol without namespaces, template arguments and lambdas: `kvq_core::Operand::
    fused_values(...)::{lambda(auto:1, auto:2)#1}::operator()<...>` -> `fused_values`."""
    head = re.split(r"[<(]", symbol.replace("(anonymous namespace)::", ""), maxsplit=1)[0]
    return head.rsplit("::", 1)[-1] or symbol


def profile(binary: Path, dump: Path, seconds: float, evict_mib: int) -> dict[str, float]:
    """Percent of the kernel's samples per function, one thread, largest first (those under 0.5%
    together)."""
    data = dump / "perf.data"
    subprocess.run(["perf", "record", "-q", "-o", str(data), str(binary), str(dump), str(seconds), "1", str(evict_mib)], check=True,
                   capture_output=True)  # fmt: skip
    report = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--no-children", "--sort", "sym"], check=True,
                            capture_output=True, text=True).stdout  # fmt: skip
    samples: dict[str, float] = {}
    for line in report.splitlines():
        match = re.match(r"\s*([\d.]+)%\s+\[\.\]\s+(.+)", line)  # user space ([k]: the program's page faults)
        if match:
            name = function_name(match.group(2).strip())
            if name not in NOT_THE_KERNEL and "istreambuf" not in match.group(2):
                samples[name] = samples.get(name, 0.0) + float(match.group(1))
    total = sum(samples.values())
    percent = {name: 100 * share / total for name, share in sorted(samples.items(), key=lambda x: -x[1])}
    shown = {name: round(p, 1) for name, p in percent.items() if p >= 0.5}
    return {**shown, "other (< 0.5% each)": round(100 - sum(shown.values()), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--revisions", default="HEAD", help="comma-separated git revisions whose kernel is timed")
    parser.add_argument("--presets", default="kivi-4,kivi-2,kvquant-3-1pct")
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0, help="per revision, preset and thread count in a round")
    parser.add_argument("--evict-mib", type=int, default=1024,
                        help="MiB rewritten before each call (64 left a 32k-token layer in the Intel VM's 480 MiB L3; 0: warm)")
    parser.add_argument("--perf", action="store_true", help="add a per-function profile of each preset (needs Linux perf)")
    parser.add_argument("--out", default="results/kernel_alone/kernel_alone.json")
    args = parser.parse_args()
    if args.perf and shutil.which("perf") is None:
        raise SystemExit("--perf needs Linux perf on PATH (perf record / perf report)")
    revisions, presets = args.revisions.split(","), args.presets.split(",")
    threads = [int(t) for t in args.threads.split(",")]

    from attention import HQ, D, filled_layer, op_args

    work = Path(tempfile.mkdtemp(prefix="kvq_kernel_alone_"))
    commits = {r: subprocess.run(["git", "rev-parse", "--short", r], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()
               for r in revisions}  # fmt: skip
    binaries = {r: build(r, work / f"rev{i}") for i, r in enumerate(revisions)}
    model, _ = smollm2(1)
    q = torch.randn(1, HQ, 1, D, generator=torch.Generator().manual_seed(1))
    dumps = {preset: work / preset.replace("/", "_") for preset in presets}  # "kivi-4/float" twins
    for preset in presets:
        dumps[preset].mkdir()
        dump_layer(op_args(filled_layer(model, preset, args.length), q), dumps[preset])

    runs: dict[tuple, list] = {}
    for _ in range(args.rounds):
        for preset in presets:
            for n in threads:
                for revision in revisions:
                    line = subprocess.run([str(binaries[revision]), str(dumps[preset]), str(args.seconds), str(n), str(args.evict_mib)],
                                          check=True, capture_output=True, text=True).stdout.split()  # fmt: skip
                    runs.setdefault((preset, n, revision), []).append([float(x) for x in line])
    rows = []
    print("\n| format | cached tokens | threads | revision | min ms | median ms | checksum |\n|---|---:|---:|---|---:|---:|---:|")
    for (preset, n, revision), r in runs.items():
        row = dict(format=preset, tokens=args.length, threads=n, revision=revision, commit=commits[revision],
                   min_ms=min(x[1] for x in r), median_ms=statistics.median(x[0] for x in r), checksum=r[0][3])  # fmt: skip
        rows.append(row)
        print(f"| {preset} | {args.length} | {n} | {revision} ({commits[revision]}) | {row['min_ms']:.3f} | {row['median_ms']:.3f} | {row['checksum']:.6f} |")
    profiles = []
    if args.perf:
        profiled = build(revisions[-1], work / "profiled", "-DKVQ_PROFILED=__attribute__((noinline))")
        for preset in presets:
            shares = profile(profiled, dumps[preset], args.seconds, args.evict_mib)
            profiles.append(dict(format=preset, tokens=args.length, threads=1, commit=commits[revisions[-1]], percent=shares))
            top = ", ".join(f"{name} {share:.0f}%" for name, share in list(shares.items())[:8])
            print(f"{preset}, one thread, share of the kernel's samples: {top}")
    save_json(args.out, stamp(length=args.length, evict_mib=args.evict_mib, rows=rows, **({"profiles": profiles} if profiles else {})))


if __name__ == "__main__":
    main()
