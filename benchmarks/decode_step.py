"""Per-token decode latency and memory on SmolLM2, every cache variant in one run.

Variants: eager fp cache (transformers DynamicCache + SDPA), eager kvq (dynamic quantized cache),
compiled fp (transformers StaticCache + torch.compile), compiled kvq (static quantized cache +
torch.compile, fused decode attention), ExecuTorch (.pte, linear layers on XNNPACK; the kvq decode
attention in the kvq kernel library, or with `executorch-portable` decomposed into ExecuTorch's
portable ops), onnxruntime (.onnx), and transformers' own QuantizedCache (quanto, 4-bit), at
several cached-token counts.

Latency: median wall time of one decode step (one new token, batch 1) over `--steps` steps after
warm-up, with `--threads` threads. Static-shaped programs (compiled static caches, ExecuTorch,
ONNX) do the same work at every position of a cache of a given capacity (attention runs over the
whole capacity under the mask), so they are timed with capacity = cached tokens + steps. The
ExecuTorch programs are exported with the first n tokens' cache stored in them (`prefix_ids`: the
same chunked prefill as the others, run before export) and timed from position n, like the rest
(`--portable-at-zero`: the portable program without the prefix, from position 0; its decomposed
attention covers the whole capacity at every position, so the work is the same).

    python benchmarks/decode_step.py --lengths 512,8192,32768 --preset kivi-4 --skip quanto-4,compiled-fp,onnx \
        --export-lengths 512,8192,32768 --out results/decode_step/decode_step_executorch.json

Memory, two figures: the bytes of the KV tensors each variant holds at that length, and the
process's peak resident memory during the timed decode steps (Linux VmHWM, reset after warm-up
and compilation). Each (variant, length) runs in a fresh Python process, so one variant's
allocations, compiled code or runtime session never count against another. The torch variants
hold the torch model; the ExecuTorch and onnxruntime ones are exported in a process of their own and
timed in one that loads only the artifact (the runtime's own copy of the weights), so the peaks
compare like with like ("one model + its cache +
what a decode step allocates"). `step MiB` is the growth during the steps over the resident size
just before them: what a decode step allocates beyond what is already held.

    python benchmarks/decode_step.py --lengths 512,2048,8192 --preset kivi-4
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch

from common import machine, reset_peak, save_json, smollm2, stamp, status_mib

VARIANTS = ("eager-fp", "quanto-4", "compiled-fp", "eager-kvq", "compiled-kvq", "executorch", "executorch-portable", "onnx")
RUNTIMES = ("executorch", "executorch-portable", "onnx")  # exported in a process of their own


def static_capacity(n: int, steps: int) -> int:
    """Capacity of the static caches and exported programs timed at `n` cached tokens: the
    timed steps plus warm-up room, the same in the exporting and the timing process."""
    return n + steps + 4


def _measure(step, steps: int, warmup: int = 2) -> dict:
    """Median ms of `step(i)` over `steps` calls after `warmup` calls (compilation happens there),
    with the peak resident memory of the timed calls."""
    for i in range(warmup):
        step(i)
    rss_before = reset_peak()
    times = []
    for i in range(warmup, warmup + steps):
        t0 = time.perf_counter()
        step(i)
        times.append(1000 * (time.perf_counter() - t0))
    peak = status_mib("VmHWM")
    return dict(ms_per_token=statistics.median(times), peak_rss_mib=peak, step_mib=peak - rss_before)


@torch.no_grad()
def _prefill(model, cache, ids: torch.Tensor, chunk: int = 512) -> None:
    for s in range(0, ids.shape[1], chunk):
        model(ids[:, s : s + chunk], cache=cache)


def _fp_bytes(cache) -> int:
    return sum(l.keys.numel() * l.keys.element_size() + l.values.numel() * l.values.element_size() for l in cache.layers)


@torch.no_grad()
def prepare_artifact(variant: str, n: int, preset: str, steps: int, out_dir: Path, portable_at_zero: bool = False) -> None:
    """Export the .pte / .onnx for `n` cached tokens (and, for ONNX, the cache filled to position n
    by an eager decode step of the same format), in a process of its own, so the process that
    times the runtime holds only the runtime and its artifact, as a deployment would."""
    import numpy as np

    from kvq_ao import KVQuantConfig, quantize_kv_
    from kvq_ao.export import export_executorch, export_onnx
    from kvq_ao.export.decoder import DecodeStep
    from kvq_ao.models import pydoc_text

    model, tok = smollm2(torch.get_num_threads())
    cfg = KVQuantConfig.preset(preset)
    quantize_kv_(model, cfg)
    capacity = static_capacity(n, steps)
    if variant.startswith("executorch"):
        ids = tok(pydoc_text("eval"), return_tensors="pt").input_ids[0, :n].tolist()
        kernels = "portable" if variant == "executorch-portable" else "native"
        if kernels == "portable" and portable_at_zero:
            ids = None  # timed from position 0 (see --portable-at-zero)
        started = time.perf_counter()
        pte = export_executorch(model, cfg, out_dir / f"bench-{variant}-{n}.pte", max_seq_len=capacity, kvq_kernels=kernels, prefix_ids=ids)
        meta = {"kv_bytes": pte.cache_bytes, "export_s": round(time.perf_counter() - started, 1), "kvq_kernels": pte.kvq_kernels}
        (out_dir / f"bench-{variant}-{n}.pte.json").write_text(json.dumps(meta))
    elif variant == "onnx":
        export_onnx(model, cfg, out_dir / f"bench-{n}.onnx", max_seq_len=capacity)
        filled = DecodeStep(model, cfg, capacity)
        _prefill(model, filled.cache, tok(pydoc_text("eval"), return_tensors="pt").input_ids[:, :n])
        np.savez(out_dir / f"bench-{n}.filled.npz", **{k: t.numpy() for k, t in zip(filled.cache_names(), filled.cache_tensors())})
    else:
        raise ValueError(f"{variant!r} has no artifact to prepare")


@torch.no_grad()
def measure_variant(variant: str, n: int, preset: str, steps: int, out_dir: Path) -> dict:
    """One variant at `n` cached tokens, in this (fresh) process: a result row."""
    from transformers import DynamicCache, QuantizedCache, StaticCache

    from kvq_ao import KVQuantConfig, make_cache, quantize_kv_
    from kvq_ao.models import pydoc_text

    cfg = KVQuantConfig.preset(preset)
    name = {"eager-fp": "eager-fp", "quanto-4": "transformers-quanto-4", "compiled-fp": "compiled-fp-static"}.get(
        variant, f"{variant.replace('onnx', 'onnxruntime')}-{cfg.name}"
    )
    token = torch.tensor([[42]])
    capacity = static_capacity(n, steps)
    if variant not in RUNTIMES:  # the runtimes' processes hold no torch model
        model, tok = smollm2(torch.get_num_threads())
        model.set_attn_implementation("sdpa")
        ids = tok(pydoc_text("eval"), return_tensors="pt").input_ids[:, :n]

    def eager(cache) -> dict:
        _prefill(model, cache, ids)
        return _measure(lambda i: model(token, cache=cache), steps)

    if variant == "eager-fp":
        cache = DynamicCache(config=model.config)
        row = eager(cache) | dict(kv_bytes=_fp_bytes(cache))
    elif variant == "quanto-4":
        cache = QuantizedCache(backend="quanto", config=model.config, nbits=4)
        row = eager(cache) | dict(kv_bytes=None)
    elif variant == "compiled-fp":
        cache = StaticCache(config=model.config, max_cache_len=capacity)
        _prefill(model, cache, ids)
        step = torch.compile(lambda t: model(t, cache=cache).logits, fullgraph=True)
        row = _measure(lambda i: step(token), steps) | dict(kv_bytes=_fp_bytes(cache))
    elif variant == "eager-kvq":
        quantize_kv_(model, cfg)
        cache = make_cache(model, cfg)
        row = eager(cache) | dict(kv_bytes=cache.tensor_bytes())
    elif variant == "compiled-kvq":
        quantize_kv_(model, cfg)
        cache = make_cache(model, cfg, max_cache_len=capacity)
        _prefill(model, cache, ids)
        step = torch.compile(lambda t: model(t, cache=cache).logits, fullgraph=True)
        row = _measure(lambda i: step(token), steps) | dict(kv_bytes=cache.tensor_bytes())
    elif variant.startswith("executorch"):  # the artifact comes from a `prepare` process: this one holds no torch model
        from kvq_ao.export.executorch import ExecuTorchRunner

        meta = json.loads((out_dir / f"bench-{variant}-{n}.pte.json").read_text())
        runner = ExecuTorchRunner(out_dir / f"bench-{variant}-{n}.pte")
        start = runner.prefix_len  # n, or 0 for a portable program timed from position 0
        row = _measure(lambda i: runner.step(42, start + i), steps) | meta | {"from_position": start}
    elif variant == "onnx":
        import numpy as np

        from kvq_ao.export.onnx import OnnxRunner

        runner = OnnxRunner(out_dir / f"bench-{n}.onnx")
        with np.load(out_dir / f"bench-{n}.filled.npz") as filled:  # the cache at position n, from eager
            runner.past = {k: filled[k] for k in runner.names}
        row = _measure(lambda i: runner.step(42, n + i), steps) | dict(kv_bytes=sum(v.nbytes for v in runner.past.values()))
    else:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    return dict(variant=name, cached_tokens=n) | row


def _run_in_child(variant: str, n: int, args) -> dict:
    """`measure_variant` in a fresh interpreter (after `prepare_artifact` in another, for the
    runtimes); a failure becomes a row (a peer's failure is a result too)."""
    common = ["--lengths", str(n), "--preset", args.preset, "--steps", str(args.steps), "--threads", str(args.threads),
              "--work-dir", args.work_dir] + (["--portable-at-zero"] if args.portable_at_zero else [])  # fmt: skip
    if variant in RUNTIMES:
        proc = subprocess.run([sys.executable, __file__, "--prepare", variant, *common], capture_output=True, text=True)
        if proc.returncode != 0:
            return dict(variant=variant, cached_tokens=n, error="export: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:300])
    proc = subprocess.run([sys.executable, __file__, "--child", variant, *common], capture_output=True, text=True)
    rows = [line for line in proc.stdout.splitlines() if line.startswith('{"variant"')]
    if proc.returncode == 0 and rows:
        return json.loads(rows[-1])
    error = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return dict(variant=variant, cached_tokens=n, error=error[:300])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--preset", default="kivi-4")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip", default="", help=f"comma-separated variants to skip, of {', '.join(VARIANTS)}")
    parser.add_argument("--export-lengths", default="512",
                        help="lengths at which to export and time ExecuTorch/ONNX (each export of SmolLM2 takes minutes)")
    parser.add_argument("--portable-at-zero", action="store_true",
                        help="export executorch-portable without the n-token prefix and time it from position 0: its "
                             "decomposed attention runs over the whole capacity at every position, so the work is the "
                             "same, and the slow prefill before export is skipped")
    parser.add_argument("--out", default="results/decode_step/decode_step.json")
    parser.add_argument("--work-dir", default="/tmp/kvq-bench")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: measure one variant in this process
    parser.add_argument("--prepare", help=argparse.SUPPRESS)  # internal: export one runtime's artifact
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out_dir = Path(args.work_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.prepare:
        prepare_artifact(args.prepare, int(args.lengths), args.preset, args.steps, out_dir, args.portable_at_zero)
        return
    if args.child:
        print(json.dumps(measure_variant(args.child, int(args.lengths), args.preset, args.steps, out_dir)), flush=True)
        return

    rows: list[dict] = []
    for n in [int(x) for x in args.lengths.split(",")]:
        skip = set(args.skip.split(","))
        if str(n) not in args.export_lengths.split(","):
            skip |= set(RUNTIMES)
        for variant in [v for v in VARIANTS if v not in skip]:
            rows.append(_run_in_child(variant, n, args))
            print(json.dumps(rows[-1]), flush=True)
            save_json(args.out, stamp(threads=args.threads, rows=rows))  # after every row: a stopped run keeps its rows
    base = {r["cached_tokens"]: r["ms_per_token"] for r in rows if r.get("variant") == "eager-fp" and "ms_per_token" in r}
    print(f"\nSmolLM2-135M decode step, batch 1, {args.threads} threads, {machine()}, {date.today()}")
    print(f"{'variant':28} {'tokens':>7} {'ms/token':>9} {'vs eager fp':>11} {'KV MiB':>8} {'peak RSS MiB':>12} {'step MiB':>9}")
    for r in rows:
        if "ms_per_token" not in r:
            print(f"{r['variant']:28} {r['cached_tokens']:>7}   failed: {r['error']}")
            continue
        ratio = r["ms_per_token"] / base[r["cached_tokens"]] if r["cached_tokens"] in base else float("nan")
        kv = f"{r['kv_bytes'] / 2**20:8.1f}" if r["kv_bytes"] else "       -"
        print(f"{r['variant']:28} {r['cached_tokens']:>7} {r['ms_per_token']:9.2f} {ratio:11.2f} {kv} "
              f"{r['peak_rss_mib']:12.0f} {r['step_mib']:9.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
