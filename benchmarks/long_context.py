"""Long contexts on SmolLM2: decode at up to 1M cached tokens, append cost, prefill throughput,
and the memory of one prefill chunk over a long cache. Every row of a run comes from that run.

Sections (each preset runs in a fresh Python process, so peak memory is its own):

* `decode`: ms per generated token and peak resident memory at each cached length, for the fp
  cache (transformers' DynamicCache + SDPA) and quantized presets (eager; the native decode
  kernel). A real 8k-token prefill of held-out pydoc text fills the cache; longer caches are made
  from it by **tiling**: body rows (codes, scales, outliers of the real prefill, past the sink's
  block) are copied periodically to later positions, and the full-precision recent window moves
  to the end, so every cached value is one the model really produced; keys keep the rotation of
  the position they were computed at (post-RoPE presets), or are rotated at their new position
  (pre-RoPE presets). SmolLM2 was trained on 8,192 positions: past that, the timings and memory
  are real but the generated text is not a quality claim. The fp cache is tiled the same way
  (float K/V concatenated) up to `--fp-max` tokens (its K/V at 46 KB per token outgrow this
  24 GB machine past ~400k tokens).
* `append`: per-token cost of the cache's `update()` (one token, all 30 layers, random K/V)
  after the decode timing at each length: it must not grow with the length.
* `prefill`: tokens/s of a real `--prefill-len` prompt fed in chunks of `--chunk` tokens (the
  faster of `--repeats` runs), and the greedy continuation of the same prompt prefilled in chunks
  vs in one pass.
* `chunk-memory`: peak memory of one `--memory-chunk`-token forward over a tiled `--memory-len` cache,
  against the cache's bytes and the same chunk's peak over an empty cache (its activations).

    python benchmarks/long_context.py --lengths 8192,32768,131072,524288,1048576 \\
        --presets fp,kivi-2,kvquant-2-1pct,kvquant-3-1pct --fp-max 262144
    python benchmarks/long_context.py --sections prefill,chunk-memory --presets fp,kivi-4,kvquant-3-1pct,kivi-2 \
        --out results/long_context/long_context_prefill.json
    python benchmarks/long_context.py --tiny   # seconds: what CI runs
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time

import torch

from common import reset_peak, save_json, smollm2, stamp, status_mib

SECTIONS = ("decode", "append", "prefill", "chunk-memory")


# ----------------------------------------------------------------------------- filling a long cache
def _real_ids(tokenizer, n: int) -> torch.Tensor:
    from kvq_ao.models import pydoc_text

    ids = tokenizer(pydoc_text("eval"), return_tensors="pt").input_ids[:, :n]
    if ids.shape[1] < n:
        raise ValueError(f"pydoc's held-out text has {ids.shape[1]} tokens, fewer than {n}")
    return ids


@torch.no_grad()
def prefill(model, cache, ids: torch.Tensor, chunk: int) -> float:
    """Feed ids into the cache `chunk` tokens at a time; seconds taken."""
    t0 = time.perf_counter()
    for s in range(0, ids.shape[1], chunk):
        model(ids[:, s : s + chunk], cache=cache, logits_to_keep=1)
    return time.perf_counter() - t0


class QuantizedTiler:
    """Tiles a quantized cache holding a real prefill out to any length (see the module docstring)."""

    margin = 512  # room for the decode steps and the append timing after a tiling

    def __init__(self, cache):
        self.cache = cache
        self.saved = [(l.side_k.clone(), l.side_v.clone(), l.side_pos.clone(), int(l.body_end), int(l.cumulative_length))
                      for l in cache.layers]  # fmt: skip

    def tile(self, target: int) -> int:
        for layer, (side_k, side_v, side_pos, b, length) in zip(self.cache.layers, self.saved):
            tail = length - b  # positions after the body, held in full precision by the side store
            first = math.ceil(layer.sink / layer.block) * layer.block  # body rows past the sink's block
            period = b - first
            if period <= 0:
                raise ValueError("the real prefill is too short to have a quantized body to tile")
            end = max(b, math.ceil((target - tail) / layer.block) * layer.block)
            layer.ensure_capacity(end + tail + self.margin, exact=True)  # allocated for this length, not more
            for body in (layer.k_body, layer.v_body):
                r = body.meta_per_row
                for t, per in ((body.codes, 1), (body.out_val, 1), (body.out_idx, 1), (body.scale, r), (body.zero, r)):
                    if t.dim() != 4 or t.shape[-1] == 0:
                        continue
                    pos = b
                    while pos < end:
                        n = min(period, end - pos)
                        t[:, :, pos // per : (pos + n) // per] = t[:, :, first // per : (first + n) // per]
                        pos += n
            moved = side_pos >= b
            new_pos = torch.where(moved, side_pos + (end - b), side_pos)
            keep = (side_pos >= 0) & ((side_pos < layer.sink) | moved)
            layer.side_pos.fill_(-1)
            slots = layer._slot(new_pos[keep])
            layer.side_k.index_copy_(2, slots, side_k[:, :, keep])
            layer.side_v.index_copy_(2, slots, side_v[:, :, keep])
            layer.side_pos.index_copy_(0, slots, new_pos[keep])
            layer.body_end.fill_(end)
            layer.cumulative_length = end + tail
        return self.cache.get_seq_length()


class FloatTiler:
    """The same for transformers' DynamicCache: the prefill's float K/V repeated."""

    def __init__(self, cache):
        self.cache = cache
        self.saved = [(l.keys.clone(), l.values.clone()) for l in cache.layers]

    def tile(self, target: int) -> int:
        for layer, (k, v) in zip(self.cache.layers, self.saved):
            layer.keys = layer.values = None  # free the previous tiling first
            reps = math.ceil(target / k.shape[2])
            layer.keys = k.repeat(1, 1, reps, 1)[:, :, :target].contiguous()
            layer.values = v.repeat(1, 1, reps, 1)[:, :, :target].contiguous()
        return self.cache.get_seq_length()


def _model_and_cache(preset: str, threads: int):
    from transformers import DynamicCache

    model, tokenizer = smollm2(threads)
    if preset == "fp":
        return model, tokenizer, DynamicCache(config=model.config), FloatTiler
    from kvq_ao import KVQuantConfig, make_cache, quantize_kv_

    quantize_kv_(model, KVQuantConfig.preset(preset))
    return model, tokenizer, make_cache(model), QuantizedTiler


def _breakdown_mib(cache) -> dict:
    """Where a quantized cache's bytes go: packed codes, scales and zeros, outlier slots, the
    full-precision side store (sink + window), summed over layers (capacity, not just length)."""
    kinds = dict(codes=0, scale_zero=0, outliers=0, side=0)
    for layer in cache.layers:
        for body in (layer.k_body, layer.v_body):
            kinds["codes"] += body.codes.numel() * body.codes.element_size()
            kinds["scale_zero"] += (body.scale.numel() + body.zero.numel()) * body.scale.element_size()
            kinds["outliers"] += body.out_val.numel() * body.out_val.element_size() + body.out_idx.numel()
        kinds["side"] += (layer.side_k.numel() + layer.side_v.numel()) * layer.side_k.element_size()
    return {k: v / 2**20 for k, v in kinds.items()}


def _cache_bytes(cache) -> int:
    if hasattr(cache, "tensor_bytes"):
        return cache.tensor_bytes()
    return sum(l.keys.numel() * l.keys.element_size() * 2 for l in cache.layers)


@torch.no_grad()
def _decode_ms(model, cache, steps: int) -> list[float]:
    token = torch.tensor([[13]])
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(token, cache=cache)
        times.append(1000 * (time.perf_counter() - t0))
        token = out.logits[:, -1:].argmax(-1)
    return times


def _append_us(cache, n: int = 64) -> float:
    """Microseconds per token of cache.update() for one token in every layer (random K/V)."""
    layer0 = cache.layers[0]
    shape = (1, 3, 1, 64) if not hasattr(layer0, "side_k") else (*layer0.side_k.shape[:2], 1, layer0.side_k.shape[-1])
    kv = [(torch.randn(shape), torch.randn(shape)) for _ in range(n)]
    t0 = time.perf_counter()
    for k, v in kv:
        for i in range(len(cache.layers)):
            cache.update(k, v, i)
    return 1e6 * (time.perf_counter() - t0) / n


def run_preset(preset: str, args) -> list[dict]:
    """Every section for one preset, in this process."""
    sections = args.sections.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    if preset == "fp":
        lengths = [n for n in lengths if n <= args.fp_max]
    model, tokenizer, cache, tiler_cls = _model_and_cache(preset, args.threads)
    rows = []
    if "prefill" in sections:
        rows += _prefill_rows(model, tokenizer, preset, args)
    if "chunk-memory" in sections:
        rows.append(_chunk_memory_row(model, tokenizer, preset, args))
    if not {"decode", "append"} & set(sections):
        return rows
    fill_s = prefill(model, cache, _real_ids(tokenizer, args.fill_len), args.chunk)
    tiler = tiler_cls(cache)
    for n in lengths:
        length = tiler.tile(n)
        reset_peak()
        times = _decode_ms(model, cache, args.steps + 1)[1:]  # the first step warms up
        row = dict(section="decode", preset=preset, cached_tokens=length, ms_per_token=statistics.median(times),
                   peak_rss_mib=status_mib("VmHWM"), cache_mib=_cache_bytes(cache) / 2**20, fill_s=fill_s)  # fmt: skip
        if preset != "fp":
            row["cache_by_kind_mib"] = _breakdown_mib(cache)
        if "append" in sections:
            row["append_us_per_token"] = _append_us(cache)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _prefill_rows(model, tokenizer, preset: str, args) -> list[dict]:
    """Chunked prefill throughput and chunked vs one-pass greedy continuations."""
    from transformers import DynamicCache

    from kvq_ao import make_cache

    ids = _real_ids(tokenizer, args.prefill_len)

    def fresh():
        return DynamicCache(config=model.config) if preset == "fp" else make_cache(model, reserve=ids.shape[1] + 64)

    seconds = min(prefill(model, fresh(), ids, args.chunk) for _ in range(args.repeats))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens, do_sample=False)
    with torch.no_grad():
        chunked = model.generate(ids, prefill_chunk_size=args.chunk, cache=fresh(), **kw)[0, ids.shape[1] :]
        whole = model.generate(ids, prefill_chunk_size=ids.shape[1], cache=fresh(), **kw)[0, ids.shape[1] :]
    row = dict(section="prefill", preset=preset, prompt_tokens=ids.shape[1], chunk=args.chunk,
               tokens_per_s=ids.shape[1] / seconds, same_continuation=bool(torch.equal(chunked, whole)),
               chunked_text=tokenizer.decode(chunked), one_pass_text=tokenizer.decode(whole))  # fmt: skip
    print(json.dumps(row), flush=True)
    return [row]


@torch.no_grad()
def _chunk_memory_row(model, tokenizer, preset: str, args) -> dict:
    """Peak memory of one chunk forward over an empty cache, then over a tiled long cache."""
    from transformers import DynamicCache

    from kvq_ao import make_cache

    chunk = _real_ids(tokenizer, args.fill_len + args.memory_chunk)[:, -args.memory_chunk :]

    def fresh():
        return DynamicCache(config=model.config) if preset == "fp" else make_cache(model)

    empty = fresh()
    before = reset_peak()
    model(chunk, cache=empty, logits_to_keep=1)
    activations = status_mib("VmHWM") - before
    del empty
    cache = fresh()
    prefill(model, cache, _real_ids(tokenizer, args.fill_len), args.chunk)
    tiler = (FloatTiler if preset == "fp" else QuantizedTiler)(cache)
    length = tiler.tile(args.memory_len)
    cache_mib = _cache_bytes(cache) / 2**20
    before = reset_peak()
    model(chunk, cache=cache, logits_to_keep=1)
    extra = status_mib("VmHWM") - before
    row = dict(section="chunk-memory", preset=preset, cached_tokens=length, chunk=args.memory_chunk, cache_mib=cache_mib,
               chunk_alone_peak_mib=activations, chunk_over_cache_peak_mib=extra,
               ratio=(cache_mib + extra) / (cache_mib + activations))  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def _child(preset: str, args) -> list[dict]:
    cmd = [sys.executable, __file__, "--child", preset, *sys.argv[1:]]
    out = subprocess.run(cmd, capture_output=True, text=True)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-1:] or [f"exit {out.returncode}"]
        rows.append(dict(section="error", preset=preset, error=tail[0], returncode=out.returncode))
        print(f"{preset}: failed ({tail[0]})", file=sys.stderr)
    return rows


def _table(rows: list[dict]) -> str:
    lines = []
    decode = [r for r in rows if r["section"] == "decode"]
    if decode:
        lines += ["| preset | cached tokens | ms/token | peak RSS GiB | cache GiB | append us/token |", "|---|---:|---:|---:|---:|---:|"]
        for r in decode:
            append = f"{r['append_us_per_token']:.0f}" if "append_us_per_token" in r else "-"
            lines.append(f"| {r['preset']} | {r['cached_tokens']:,} | {r['ms_per_token']:.1f} | {r['peak_rss_mib'] / 1024:.2f} | "
                         f"{r['cache_mib'] / 1024:.2f} | {append} |")  # fmt: skip
    for r in rows:
        if r["section"] == "prefill":
            lines.append(f"prefill {r['preset']}: {r['prompt_tokens']} tokens in chunks of {r['chunk']}: "
                         f"{r['tokens_per_s']:.0f} tokens/s; chunked == one pass: {r['same_continuation']}")  # fmt: skip
        elif r["section"] == "chunk-memory":
            lines.append(f"chunk memory {r['preset']}: {r['chunk']} tokens over {r['cached_tokens']:,}: cache "
                         f"{r['cache_mib']:.0f} MiB, chunk peak {r['chunk_over_cache_peak_mib']:.0f} MiB over it "
                         f"({r['chunk_alone_peak_mib']:.0f} MiB over an empty cache): {r['ratio']:.2f}x")  # fmt: skip
        elif r["section"] == "error":
            lines.append(f"{r['preset']}: failed: {r['error']}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="8192,32768,131072,524288,1048576")
    p.add_argument("--presets", default="fp,kivi-2,kvquant-2-1pct,kvquant-3-1pct")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--fp-max", type=int, default=262144, help="longest fp cache to try (46 KB per token)")
    p.add_argument("--fill-len", type=int, default=8192, help="tokens of real prefill that longer caches are tiled from")
    p.add_argument("--prefill-len", type=int, default=8192)
    p.add_argument("--memory-len", type=int, default=131072)
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (generate()'s default, kvq_ao.api.PREFILL_CHUNK)")
    p.add_argument("--memory-chunk", type=int, default=512, help="the chunk whose memory chunk-memory measures")
    p.add_argument("--repeats", type=int, default=2, help="timed prefills per preset (the faster is reported)")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="seconds-long version (CI): short lengths, 2 presets")
    p.add_argument("--out", default="results/long_context/long_context.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.tiny:
        args.lengths, args.fill_len, args.prefill_len, args.memory_len = "1024,4096", 512, 256, 4096
        args.chunk, args.memory_chunk, args.new_tokens, args.steps, args.repeats = 128, 128, 4, 1, 1
        args.presets = args.presets if "--presets" in sys.argv else "fp,kivi-2"
    if args.child:
        run_preset(args.child, args)
        return
    rows = []
    for preset in args.presets.split(","):
        print(f"{preset} ...", file=sys.stderr, flush=True)
        rows += _child(preset, args)
    save_json(args.out, dict(**stamp(command=" ".join(sys.argv), threads=args.threads), rows=rows))
    print(_table(rows))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
