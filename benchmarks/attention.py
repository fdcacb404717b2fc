"""One-token decode attention alone, at long contexts: the kvq op against fp32 SDPA and the memory floor.

One layer of SmolLM2's shape (9 query heads, 3 kv heads, head_dim 64), batch 1. The quantized
layer is filled through the cache's own `update()` (chunks of 4096 tokens of random N(0, 1) keys
and values; the layer's real calibration for kvquant presets), so it holds exactly what a
generating model would hold at that length. Variants:

* `sdpa-fp32`: `scaled_dot_product_attention` over the float cache (GQA), what an fp cache costs;
* `native`: `torch.ops.kvq.decode_attention` with the native CPU kernel (the op alone);
* `attention`: `kvq_ao.tensor.attention`, what eager generation calls: the op's dispatch, plus for
  rotated formats the query rotated by the keys' R and the output rotated back by the values' R^T;
* `compiled`: the same op under `torch.compile` (the graph calls the native kernel);
* `reference`: the reference kernel (kernels/reference.py) run eagerly, what CPU ran before the
  native kernel and what any device without one runs.
* `--profile` adds, per quantized format, the native kernel with one feature at a time taken away
  (codebook -> uniform levels, no outliers, post-RoPE keys): same bytes, so the differences say
  where the time goes.

`--shape HQ,HKV,D` times another layer shape instead (a one-layer Llama with random weights;
presets with calibrated levels then take `<preset>/nf`, the same kernel path without a calibration).

Each row: median ms over `--repeats` rounds after a warm-up (within one length every variant but
the slow reference is called once per round in turn, so all see the same phases of a noisy
machine), the bytes a kernel must read (the filled rows of codes, scales and outliers, the
full-precision side store, the mask; not the spare capacity the cache holds beyond them), and the
time those bytes take at the memory bandwidth measured in the same run (a large `copy_`), i.e. the floor a
bandwidth-bound kernel would reach. Rows in results/attention/attention.json.

    python benchmarks/attention.py --lengths 4096,32768,131072,524288 --presets kivi-4,kivi-2,kvquant-3-1pct,kvquant-2-1pct --profile
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import machine, preset_config, save_json, smollm2, stamp

HQ, HKV, D = 9, 3, 64


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up (and compilation)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def interleaved_ms(fns: dict, repeats: int) -> dict:
    """Median ms of each of `fns` over `repeats` rounds that call every one of them once in turn.

    A shared 2-core VM here drifts between fast and slow phases lasting seconds; timing each variant
    in its own block put whole variants in one phase or the other (the same op measured 2.2 and 2.8 ms
    minutes apart), so ratios between variants moved by ~40%. Interleaved, every variant sees the
    same phases."""
    for fn in fns.values():
        fn()  # warm-up (and compilation)
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def bandwidth_gbs(mib: int = 1024) -> float:
    """Copy bandwidth (read + write bytes per second) of a `mib`-MiB buffer, best of 5."""
    src = torch.empty(mib * 2**18, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * src.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def shaped_model(hq: int, hkv: int, d: int, threads: int):
    """A one-layer Llama with random weights whose attention has this shape (no tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(threads)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=hq,
                         num_key_value_heads=hkv, head_dim=d, vocab_size=256, max_position_embeddings=1 << 20)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def filled_layer(model, preset: str, n: int):
    """Layer 0 of a fresh quantized cache for `model`, filled with `n` random tokens (`preset`: a
    name, or "<preset>/<scores>", `common.preset_config`)."""
    from kvq_ao import make_cache, quantize_kv_

    config = preset_config(preset)
    quantize_kv_(model, config)
    layer = make_cache(model, config).layers[0]
    g = torch.Generator().manual_seed(0)
    for start in range(0, n, 4096):
        size = min(4096, n - start)
        layer.update(torch.randn(1, HKV, size, D, generator=g), torch.randn(1, HKV, size, D, generator=g))
    return layer


def attention_inputs(layer, q: torch.Tensor) -> tuple:
    """(q, keys, values, mask, scaling): `kvq_ao.tensor.attention`'s arguments over the filled layer."""
    keys, values = layer.keys_values()
    mask = torch.ones(1, 1, 1, keys.shape[2], dtype=torch.bool)
    mask[..., int(layer.cumulative_length) :] = False
    return q, keys, values, mask, D**-0.5


def op_args(layer, q: torch.Tensor) -> dict:
    """The decode attention op's named arguments for q over the filled layer (unrotated q: the op
    alone; `attention` rotates it for rotated formats)."""
    from kvq_ao.tensor import attention_arguments

    return attention_arguments(*attention_inputs(layer, q))


def bytes_read(op: dict) -> int:
    """Bytes of the op's cache tensors a decode step reads: the body up to `body_end` (the layer's
    spare capacity beyond it is held but never read), the whole side store, outliers and scales of
    the filled rows."""
    from kvq_ao.ops import named_arguments

    named = named_arguments((), op)
    capacity, filled = named["k"].codes.shape[2], int(op["body_end"])
    tensors = {"mask": op["mask"], "side_pos": op["side_pos"]}
    for prefix in ("k", "v"):
        tensors.update({f"{prefix}_{n}": t for n, t in named[prefix].fields().items() if isinstance(t, torch.Tensor)})
    total = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        rows = t.shape[-1] if name == "mask" else t.shape[2] if t.dim() == 4 else None
        if name.startswith("side_") or name.endswith("_side") or rows is None:  # read whole (codebooks have no rows)
            total += size
        elif rows == capacity:  # one row per position
            total += size * filled // capacity
        else:  # one row per group of positions (per-channel key scales)
            group = capacity // rows
            total += size * -(-filled // group) // rows
    return total


def _without(op: dict, **fields) -> dict:
    """The op's arguments with operand fields of both K and V replaced."""
    from kvq_ao.ops import attention_arguments, named_arguments

    named = named_arguments((), op)
    rest = {n: v for n, v in named.items() if n not in ("q", "k", "v")}
    return attention_arguments(named["q"], named["k"].replace(**fields), named["v"].replace(**fields), **rest)


def _same(a: dict, b: dict) -> bool:
    """Whether two argument dicts hold the same objects (an ablation that removed nothing)."""
    same = lambda x, y: x is y or (isinstance(x, list) and len(x) == len(y) and all(p is q for p, q in zip(x, y)))  # noqa: E731
    return a.keys() == b.keys() and all(same(a[n], b[n]) for n in a)


ABLATIONS = {  # what the profile takes away: the op's arguments without one feature
    "no-codebook": lambda a: _without(a, codebook=None),
    "no-outliers": lambda a: _without(a, out_val=None, out_idx=None),
    "post-rope": lambda a: {**a, "rope_inv_freq": None},
}


def main() -> None:
    global HQ, HKV, D
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="4096,32768,131072")
    parser.add_argument("--presets", default="kivi-4,kivi-2,kvquant-3-1pct,kvquant-2-1pct")
    parser.add_argument("--variants", default="sdpa-fp32,native,attention,compiled,reference")
    parser.add_argument("--profile", action="store_true", help="add the native kernel without each feature a format uses")
    parser.add_argument("--reference-max", type=int, default=131072, help="longest context the slow reference kernel is timed at")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shape", default=f"{HQ},{HKV},{D}", help="query heads, kv heads, head_dim (other than SmolLM2's: a random model)")
    parser.add_argument("--out", default="results/attention/attention.json")
    args = parser.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    if shape == (HQ, HKV, D):
        model, _ = smollm2(args.threads)
    else:
        HQ, HKV, D = shape
        model = shaped_model(HQ, HKV, D, args.threads)
    gbs = bandwidth_gbs()
    print(f"{machine()}, {args.threads} threads; copy bandwidth {gbs:.1f} GB/s", flush=True)
    variants = args.variants.split(",")
    rows = []
    q = torch.randn(1, HQ, 1, D, generator=torch.Generator().manual_seed(1))
    from kvq_ao.kernels import cpu, reference
    from kvq_ao.ops import named_arguments, reference_arguments
    from kvq_ao.tensor import attention

    if not cpu.load():
        raise SystemExit("the native CPU kernels did not build (see the warning): nothing to measure")

    def add(row: dict) -> None:
        row["floor_ms"] = 1000 * row["bytes"] / (gbs * 1e9)
        row["x_floor"] = row["ms"] / row["floor_ms"]
        rows.append(row)
        print(f"{row['format']:15} {row['tokens']:>8} {row['variant']:13} {row['ms']:9.2f} ms  {row['bytes'] / 2**20:8.1f} MiB  "
              f"floor {row['floor_ms']:7.2f} ms ({row['x_floor']:.1f}x)", flush=True)  # fmt: skip
        save_json(args.out, stamp(threads=args.threads, copy_gbs=round(gbs, 2), shape=dict(q_heads=HQ, kv_heads=HKV, head_dim=D), rows=rows))

    for n in [int(x) for x in args.lengths.split(",")]:
        timed: dict[tuple[str, str], tuple] = {}  # (format, variant) -> (fn, bytes read): timed together below
        if "sdpa-fp32" in variants:
            g = torch.Generator().manual_seed(0)
            k, v = torch.randn(1, HKV, n, D, generator=g), torch.randn(1, HKV, n, D, generator=g)
            sdpa = lambda k=k, v=v: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
            timed[("fp32", "sdpa-fp32")] = (sdpa, 2 * k.numel() * 4)
        references = []
        for preset in args.presets.split(","):
            layer = filled_layer(model, preset, n)
            op, inputs = op_args(layer, q), attention_inputs(layer, q)
            held = bytes_read(op)
            layer = None
            if "native" in variants:
                timed[(preset, "native")] = (lambda op=op: torch.ops.kvq.decode_attention(**op), held)
            if "attention" in variants:
                timed[(preset, "attention")] = (lambda inputs=inputs: attention(*inputs), held)
            if args.profile:
                for name, strip in ABLATIONS.items():
                    stripped = strip(op)
                    if not _same(stripped, op):
                        timed[(preset, f"native {name}")] = (lambda a=stripped: torch.ops.kvq.decode_attention(**a), held)
            if "compiled" in variants:  # one compiled function per preset (dynamo's recompile limit is per function)
                compiled = torch.compile(lambda **a: torch.ops.kvq.decode_attention(**a), fullgraph=True, dynamic=False)
                timed[(preset, "compiled")] = (lambda op=op, f=compiled: f(**op), held)
            if "reference" in variants and n <= args.reference_max:
                references.append((preset, reference_arguments(named_arguments((), op)), held))
        with torch.no_grad():
            medians = interleaved_ms({key: fn for key, (fn, _) in timed.items()}, args.repeats)
            for (fmt, variant), (_, nbytes) in timed.items():
                add(dict(format=fmt, tokens=n, variant=variant, bytes=nbytes, ms=medians[(fmt, variant)]))
            for preset, ref, held in references:  # tens to hundreds of ms: timed alone, fewer times
                add(dict(format=preset, tokens=n, variant="reference", bytes=held,
                         ms=median_ms(lambda: reference.attention(**ref, target="eager"), max(3, args.repeats // 3))))  # fmt: skip
        timed = k = v = None  # free this length's caches before the next one's are built
        torch._dynamo.reset()
    fp = {r["tokens"]: r["ms"] for r in rows if r["variant"] == "sdpa-fp32"}
    print("\n| format | cached tokens | variant | ms | MiB read | floor ms | x floor | vs fp32 SDPA |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        speedup = f"{fp[r['tokens']] / r['ms']:.2f}x" if r["tokens"] in fp else "-"
        print(f"| {r['format']} | {r['tokens']} | {r['variant']} | {r['ms']:.2f} | {r['bytes'] / 2**20:.1f} | "
              f"{r['floor_ms']:.2f} | {r['x_floor']:.1f} | {speedup} |")


if __name__ == "__main__":
    main()
