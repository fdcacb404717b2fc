"""Per-token decode latency and KV memory on SmolLM2, every cache variant in one run.

Variants: eager fp cache (transformers DynamicCache + SDPA), eager kvq (dynamic quantized cache),
compiled fp (transformers StaticCache + torch.compile), compiled kvq (static quantized cache +
torch.compile, fused decode attention), ExecuTorch (.pte, portable kernels), onnxruntime (.onnx),
and transformers' own QuantizedCache (quanto, 4-bit), at several cached-token counts.

Latency: median wall time of one decode step (one new token, batch 1) over `--steps` steps after
warm-up, with `--threads` threads. Static-shaped programs (compiled static caches, ExecuTorch,
ONNX) do the same work at every position of a cache of a given capacity (attention runs over the
whole capacity under the mask), so they are timed with capacity = cached tokens + steps; the
ExecuTorch program cannot be filled any faster than one token per call, so it is timed from
position 0 of such a program. Memory: bytes of the KV tensors each variant holds at that length.

    python benchmarks/decode_step.py --lengths 512,2048,8192 --preset kivi-4
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import torch

import kvq_ao  # noqa: F401
from kvq_ao import KVQuantConfig, make_cache, quantize_kv_
from kvq_ao.models import load_model, pydoc_text


def _median_ms(step, steps: int, warmup: int = 2) -> float:
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        step(i)
        if i >= warmup:
            times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


@torch.no_grad()
def _prefill(model, cache, ids: torch.Tensor, chunk: int = 512) -> None:
    for s in range(0, ids.shape[1], chunk):
        model(ids[:, s : s + chunk], cache=cache)


@torch.no_grad()
def bench_length(model, cfg, ids: torch.Tensor, steps: int, out_dir: Path, skip: set[str], rows: list[dict], save) -> None:
    """All variants at one cached-token count (ids.shape[1]), appended to `rows`; `save()` runs after
    each row so a long run that is stopped keeps what it measured. `skip` names variants to leave out."""
    from transformers import DynamicCache, QuantizedCache, StaticCache

    n = ids.shape[1]
    token = torch.tensor([[42]])

    def add(name, ms, kv_bytes):
        rows.append(dict(variant=name, cached_tokens=n, ms_per_token=ms, kv_bytes=kv_bytes))
        print(json.dumps(rows[-1]), flush=True)
        save()

    def eager(cache):
        _prefill(model, cache, ids)
        return _median_ms(lambda i: model(token, cache=cache), steps)

    model.set_attn_implementation("sdpa")
    if "eager-fp" not in skip:
        cache = DynamicCache(config=model.config)
        add("eager-fp", eager(cache), sum(l.keys.numel() * 4 + l.values.numel() * 4 for l in cache.layers))
    if "quanto-4" not in skip:
        try:
            cache = QuantizedCache(backend="quanto", config=model.config, nbits=4)
            add("transformers-quanto-4", eager(cache), None)
        except Exception as e:  # reported, not hidden: the peer's failure is a result too
            rows.append(dict(variant="transformers-quanto-4", cached_tokens=n, error=str(e)[:200]))
            print(json.dumps(rows[-1]), flush=True)
    if "compiled-fp" not in skip:
        cache = StaticCache(config=model.config, max_cache_len=n + steps + 4)
        _prefill(model, cache, ids)
        step = torch.compile(lambda t: model(t, cache=cache).logits, fullgraph=True)
        add("compiled-fp-static", _median_ms(lambda i: step(token), steps), sum(l.keys.numel() * 4 + l.values.numel() * 4 for l in cache.layers))
    quantize_kv_(model, cfg)
    if "eager-kvq" not in skip:
        cache = make_cache(model, cfg)
        add(f"eager-kvq-{cfg.name}", eager(cache), cache.tensor_bytes())
    if "compiled-kvq" not in skip:
        cache = make_cache(model, cfg, max_cache_len=n + steps + 4)
        _prefill(model, cache, ids)
        step = torch.compile(lambda t: model(t, cache=cache).logits, fullgraph=True)
        add(f"compiled-kvq-{cfg.name}", _median_ms(lambda i: step(token), steps), cache.tensor_bytes())
    if "executorch" not in skip:
        from kvq_ao.export import export_executorch
        from kvq_ao.export.executorch import ExecuTorchRunner

        pte = export_executorch(model, cfg, out_dir / f"bench-{n}.pte", max_seq_len=n + steps + 4)
        runner = ExecuTorchRunner(pte.path)
        add(f"executorch-{cfg.name}", _median_ms(lambda i: runner.step(42, i), steps), pte.cache_bytes)
    if "onnx" not in skip:
        from kvq_ao.export import export_onnx
        from kvq_ao.export.decoder import DecodeStep
        from kvq_ao.export.onnx import OnnxRunner

        path = export_onnx(model, cfg, out_dir / f"bench-{n}.onnx", max_seq_len=n + steps + 4)
        runner = OnnxRunner(path)
        # Fill the ONNX cache from an eager decode step's cache (same format) to time at position n.
        filled = DecodeStep(model, cfg, n + steps + 4)
        _prefill(model, filled.cache, ids)
        runner.past = {k: t.numpy() for k, t in zip(filled.cache_names(), filled.cache_tensors())}
        add(f"onnxruntime-{cfg.name}", _median_ms(lambda i: runner.step(42, n + i), steps),
            sum(t.numel() * t.element_size() for t in filled.cache_tensors()))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--preset", default="kivi-4")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip", default="", help="comma-separated variants to skip")
    parser.add_argument("--export-lengths", default="512",
                        help="lengths at which to export and time ExecuTorch/ONNX (each export of SmolLM2 takes minutes)")
    parser.add_argument("--out", default="results/decode_step.json")
    parser.add_argument("--work-dir", default="/tmp/kvq-bench")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out_dir = Path(args.work_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, tok = load_model("smollm2")
    text_ids = tok(pydoc_text("eval"), return_tensors="pt").input_ids
    cfg = KVQuantConfig.preset(args.preset)
    rows: list[dict] = []

    def save() -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(date=str(date.today()), threads=args.threads, rows=rows), indent=2) + "\n")

    for n in [int(x) for x in args.lengths.split(",")]:
        skip = set(args.skip.split(","))
        if str(n) not in args.export_lengths.split(","):
            skip |= {"executorch", "onnx"}
        bench_length(model, cfg, text_ids[:, :n], args.steps, out_dir, skip, rows, save)
    base = {r["cached_tokens"]: r["ms_per_token"] for r in rows if r.get("variant") == "eager-fp"}
    print(f"\nSmolLM2-135M decode step, batch 1, {args.threads} threads, {platform.processor() or platform.machine()}, {date.today()}")
    print(f"{'variant':28} {'tokens':>7} {'ms/token':>9} {'vs eager fp':>11} {'KV MiB':>8}")
    for r in rows:
        if "ms_per_token" not in r:
            print(f"{r['variant']:28} {r['cached_tokens']:>7}   failed: {r['error']}")
            continue
        ratio = r["ms_per_token"] / base[r["cached_tokens"]] if r["cached_tokens"] in base else float("nan")
        kv = f"{r['kv_bytes'] / 2**20:8.1f}" if r["kv_bytes"] else "       -"
        print(f"{r['variant']:28} {r['cached_tokens']:>7} {r['ms_per_token']:9.2f} {ratio:11.2f} {kv}")


if __name__ == "__main__":
    main()
