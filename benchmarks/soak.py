"""Soak: thousands of one-token decode steps on SmolLM2, checking that nothing drifts.

Each cache kind runs in its own process and decodes the held-out text one token at a time
(teacher-forced: the same tokens whatever the cache predicts, so every kind and the fp reference
see one sequence). Every `--check-every` steps it checks:

- **bytes**: every layer's stored bytes (codes, scales, zeros, outliers, clamp counts, the
  full-precision sink and window, lengths) equal those of a cache built at once from the same
  keys and values. The keys and values are read back from the full-precision window after each
  step (every token passes through it before it is quantized: the preset needs a window), in the
  form the cache stores them, so presets with pre-RoPE or rotated keys are checked too;
- **memory**: resident memory (RSS, after returning freed heap to the OS, as at the baseline) grown
  since the end of warm-up, against what the cache itself reports it grew (`tensor_bytes`,
  allocated capacity included) plus a stated constant;
- **recompiles** (compiled kinds): graphs dynamo compiled after warm-up;
- **agreement**: top-1 of the quantized cache against the fp cache's, since the start and in the
  last interval, beside the figure over the warm-up (the first 512 steps). Until the cache holds
  quantized tokens (kivi-4: 160 steps, its 128-token full-precision window plus one block) it holds
  what an fp cache holds and agrees by construction, so agreement is also counted from the first
  step whose cache holds quantized tokens: the short-run level is then its first 512 such steps,
  and drift is the whole run's figure against it.

The fp top-1 comes from one chunked forward over the same tokens (fp DynamicCache, SDPA) in its
own process, so its memory never counts against a kind's RSS.

Reproduce (the figures in docs/reliability.md):
    python benchmarks/soak.py --steps 10000 --kinds dynamic,compiled-static --preset kivi-4 \\
        --out results/soak/soak_kivi4.json
CI runs the same loop for a few hundred steps (tests/test_soak.py).
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import eval_windows, reset_peak, save_json, smollm2, stamp  # noqa: E402

KINDS = ("dynamic", "static", "compiled-static")
RSS_SLACK_MIB = 64.0  # the stated constant: allocator and interpreter noise allowed on top of the cache's growth
WARMUP = 512  # steps before the RSS baseline (and the first-512 agreement figure)


def token_stream(steps: int, threads: int) -> torch.Tensor:
    """[steps + 1] token ids of held-out text (the model reads steps + 1 tokens: prompt token + steps)."""
    _, tok = smollm2(threads)
    return eval_windows(tok, 1, steps + 1)[0]


def fp_top1(ids: torch.Tensor, threads: int, chunk: int = 512) -> torch.Tensor:
    """The fp cache's top-1 prediction after each token of `ids` (chunked forward, SDPA)."""
    from transformers import DynamicCache

    model, _ = smollm2(threads)
    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    out = []
    with torch.no_grad():
        for s in range(0, ids.numel(), chunk):
            out.append(model(ids[s : s + chunk][None], cache=cache).logits[0].argmax(-1))
    return torch.cat(out)


# ---------------------------------------------------------------------------- what a layer stores
def _stored(layer) -> dict[str, torch.Tensor]:
    """Everything a layer's stored state is, restricted to what its length makes meaningful (a dynamic
    cache's capacity depends on how it grew, so rows past the quantized body's end are left out)."""
    length, end = int(layer.cumulative_length), int(layer.body_end)
    held = sorted({*range(min(layer.sink, length)), *range(min(max(layer._boundary(length), layer.sink), length), length)})
    slots = layer._slot(torch.tensor(held, dtype=torch.int64))
    out = {"length": torch.tensor(length), "body_end": torch.tensor(end),
           "side_k": layer.side_k.index_select(2, slots), "side_v": layer.side_v.index_select(2, slots),
           "side_pos": layer.side_pos.index_select(0, slots),
           "clamped": torch.tensor(layer.clamped_by_kind)}  # fmt: skip
    for name, body in (("k", layer.k_body), ("v", layer.v_body)):
        codes, scale, zero = body.tensors()
        out[f"{name}_codes"] = codes[:, :, :end]
        if body.spec.is_quantized and not body.spec.calibrated_ranges:
            r = body.meta_per_row
            out[f"{name}_scale"], out[f"{name}_zero"] = scale[:, :, : end // r], zero[:, :, : end // r]
        if body.n_outliers:
            out[f"{name}_out_val"], out[f"{name}_out_idx"] = body.out_val[:, :, :end], body.out_idx[:, :, :end]
    return out


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def bytes_mismatch(cache, rebuilt) -> list[str]:
    """'layer i: field' for every stored field that differs between two caches ([] when equal)."""
    bad = []
    for i, (a, b) in enumerate(zip(cache.layers, rebuilt.layers)):
        sa, sb = _stored(a), _stored(b)
        bad += [f"layer {i}: {k}" for k in sorted(sa.keys() | sb.keys()) if k not in sa or k not in sb or not _same_bytes(sa[k], sb[k])]
    return bad


def rebuild_at_once(model, config, static_len: int | None, keys: list[torch.Tensor], values: list[torch.Tensor]):
    """A fresh cache holding the recorded keys/values, appended in one call per layer. They are in
    stored form already (after any pre-RoPE undoing and rotation), so they go to the append itself."""
    from kvq_ao import make_cache

    cache = make_cache(model, config, max_cache_len=static_len)
    for layer, k, v in zip(cache.layers, keys, values):
        layer.lazy_initialization(k, v)
        layer._append_eager(k, v)
    return cache


# ---------------------------------------------------------------------------- one kind
def soak_kind(kind: str, preset: str, ids: torch.Tensor, fp: torch.Tensor, check_every: int, threads: int,
              log=print, warmup: int = WARMUP) -> dict:  # fmt: skip
    """Decode `ids` one token at a time with `kind`'s cache; the result row with every check
    (`warmup`: steps before the RSS baseline and the first agreement figure)."""
    from kvq_ao import KVQuantConfig, make_cache, quantize_kv_

    if kind not in KINDS:
        raise ValueError(f"unknown cache kind {kind!r}; choose from {', '.join(KINDS)}")
    config = KVQuantConfig.preset(preset)
    if config.residual_length < 1:
        raise ValueError(f"the soak reads each token back from the full-precision window: {preset!r} keeps none")
    model, _ = smollm2(threads)
    quantize_kv_(model, config)
    n = ids.numel()
    static_len = n if kind != "dynamic" else None
    cache = make_cache(model, config, max_cache_len=static_len)
    forward = lambda t: model(t, cache=cache).logits[0, -1]  # noqa: E731
    step = torch.compile(forward, fullgraph=True) if kind == "compiled-static" else forward
    graphs = torch._dynamo.utils.counters["stats"]
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    top1 = torch.empty(n, dtype=torch.int64)
    checks, t0 = [], time.perf_counter()
    base = None  # (RSS MiB, cache bytes, graphs) at the end of warm-up
    quantized_from = None  # first step (0-based token index) whose cache holds quantized tokens
    with torch.no_grad():
        for t in range(n):
            logits = (forward if t == 0 else step)(ids[t].view(1, 1))  # the first token initializes the layers eagerly
            top1[t] = logits.argmax()
            if t == 0:
                keys = [torch.zeros(*layer.side_k.shape[:2], n, layer.side_k.shape[-1], dtype=layer.side_k.dtype)
                        for layer in cache.layers]  # fmt: skip  (zeroed: their pages count before the RSS baseline)
                values = [torch.zeros(*layer.side_v.shape[:2], n, layer.side_v.shape[-1], dtype=layer.side_v.dtype)
                          for layer in cache.layers]  # fmt: skip
            slot = cache.layers[0]._slot(torch.tensor([t]))
            for layer, k, v in zip(cache.layers, keys, values):
                k[:, :, t] = layer.side_k[:, :, slot[0]]
                v[:, :, t] = layer.side_v[:, :, slot[0]]
            done = t + 1
            if quantized_from is None and cache.layers[0]._boundary(done) > cache.layers[0].sink:
                quantized_from = t
            if done == warmup:
                base = (reset_peak(), cache.tensor_bytes(), graphs["unique_graphs"])
            if done % check_every == 0 or done == n:
                rss = reset_peak()  # trimmed as the baseline was: the previous check's rebuilt cache is not counted
                rebuilt = rebuild_at_once(model, config, static_len, [k[:, :, :done] for k in keys],
                                          [v[:, :, :done] for v in values])  # fmt: skip
                bad = bytes_mismatch(cache, rebuilt)
                del rebuilt
                agree = (top1[:done] == fp[:done]).float().mean().item() * 100
                last = (top1[done - check_every : done] == fp[done - check_every : done]).float().mean().item() * 100
                row = dict(step=done, seconds=round(time.perf_counter() - t0, 1), bytes_equal=not bad, mismatched=bad[:8],
                           rss_mib=round(rss, 1), cache_mib=round(cache.tensor_bytes() / 2**20, 2),
                           agreement_pct=round(agree, 2), agreement_last_interval_pct=round(last, 2),
                           graphs=graphs["unique_graphs"])  # fmt: skip
                if quantized_from is not None:
                    row["agreement_quantized_pct"] = round(_agreement(top1, fp, quantized_from, done), 2)
                if base is not None:
                    grown = rss - base[0]
                    cache_grown = (cache.tensor_bytes() - base[1]) / 2**20
                    row |= dict(rss_grown_mib=round(grown, 1), cache_grown_mib=round(cache_grown, 2),
                                rss_within_bound=grown <= cache_grown + RSS_SLACK_MIB,
                                recompiles=graphs["unique_graphs"] - base[2])  # fmt: skip
                checks.append(row)
                log(f"  {kind} step {done}: bytes {'equal' if not bad else 'DIFFER ' + ', '.join(bad[:3])}, "
                    f"RSS {rss:.0f} MiB (cache {row['cache_mib']} MiB), agreement {agree:.2f}% (last interval {last:.2f}%), "
                    f"graphs {row['graphs']}, {row['seconds']} s")  # fmt: skip
    first = _agreement(top1, fp, 0, warmup) if n >= warmup else None
    q = quantized_from
    q_first = _agreement(top1, fp, q, q + warmup) if q is not None and n >= q + warmup else None
    q_all = _agreement(top1, fp, q, n) if q is not None else None
    final = checks[-1]
    return dict(kind=kind, preset=preset, steps=n - 1, tokens=n, check_every=check_every,
                warmup=warmup, agreement_first_warmup_pct=None if first is None else round(first, 2),
                quantized_from_step=q,
                agreement_quantized_first_warmup_pct=None if q_first is None else round(q_first, 2),
                agreement_quantized_all_pct=None if q_all is None else round(q_all, 2),
                agreement_drift_points=None if q_first is None else round(q_first - q_all, 2),
                all_bytes_equal=all(c["bytes_equal"] for c in checks),
                rss_always_within_bound=all(c.get("rss_within_bound", True) for c in checks),
                recompiles_after_warmup=final.get("recompiles"),
                seconds_per_step=round(final["seconds"] / n, 4), checks=checks)  # fmt: skip


def _agreement(top1: torch.Tensor, fp: torch.Tensor, start: int, stop: int) -> float:
    """Percent of steps in [start, stop) where the quantized cache's top-1 equals the fp cache's."""
    return (top1[start:stop] == fp[start:stop]).float().mean().item() * 100


def _child(target, args, queue) -> None:
    try:
        queue.put(("ok", target(*args)))
    except BaseException as e:  # noqa: BLE001 (reported by the parent, with the traceback printed here)
        import traceback

        traceback.print_exc()
        queue.put(("error", f"{type(e).__name__}: {e}"))


def in_child(target, *args):
    """target(*args) in a fresh interpreter: each kind's memory and compiled graphs start clean."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(target, args, queue))
    proc.start()
    status, value = queue.get()
    proc.join()
    if status != "ok":
        raise RuntimeError(f"{getattr(target, '__name__', target)} failed in its process: {value}")
    return value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--kinds", default="dynamic,compiled-static", help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--preset", default="kivi-4")
    p.add_argument("--check-every", type=int, default=1000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="results/soak/soak.json")
    args = p.parse_args(argv)
    kinds = args.kinds.split(",")
    for kind in kinds:
        if kind not in KINDS:
            p.error(f"unknown cache kind {kind!r}; choose from {', '.join(KINDS)}")
    ids = token_stream(args.steps, args.threads)
    print(f"fp top-1 over {ids.numel()} tokens ...", flush=True)
    fp = in_child(fp_top1, ids, args.threads)
    rows = []
    for kind in kinds:
        print(f"{kind}, {args.preset}: {args.steps} steps, checks every {args.check_every}", flush=True)
        rows.append(in_child(soak_kind, kind, args.preset, ids, fp, args.check_every, args.threads))
    out = save_json(args.out, stamp(steps=args.steps, preset=args.preset, rss_slack_mib=RSS_SLACK_MIB, threads=args.threads,
                                    rows=rows))  # fmt: skip
    print("\n| kind | steps | bytes equal at every check | RSS grown after warm-up (bound) | recompiles | agreement first 512 | "
          "agreement all | quantized from step | agreement quantized: first 512 / all (drift) | ms/step |\n"
          "|---|---:|---|---|---:|---:|---:|---:|---|---:|")  # fmt: skip
    ok = True
    for r in rows:
        c = r["checks"][-1]
        bound = f"{c.get('rss_grown_mib', '-')} MiB ({c.get('cache_grown_mib', 0) + RSS_SLACK_MIB:.1f})"
        print(f"| {r['kind']} | {r['steps']} | {r['all_bytes_equal']} | {bound} | {r['recompiles_after_warmup']} | "
              f"{r['agreement_first_warmup_pct']}% | {c['agreement_pct']}% | {r['quantized_from_step']} | "
              f"{r['agreement_quantized_first_warmup_pct']}% / {r['agreement_quantized_all_pct']}% "
              f"({r['agreement_drift_points']} points) | {1000 * r['seconds_per_step']:.1f} |")  # fmt: skip
        ok &= r["all_bytes_equal"] and r["rss_always_within_bound"] and not r["recompiles_after_warmup"]
    print(f"\nwrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
