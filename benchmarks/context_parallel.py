"""SmolLM2 with a context-parallel quantized cache (kvq_ao.parallel) over gloo processes on one machine.

Run with torchrun; rank 0 writes the rows:

    torchrun --nproc-per-node 2 benchmarks/context_parallel.py --sections greedy,long --length 2097152

* `greedy`: a real `--prompt-len` prompt of held-out pydoc text prefilled in chunks, then
  `--new-tokens` greedy tokens, with the context-parallel cache and with the ordinary
  single-process cache (rank 0 runs it while the others wait); tokens and every step's logits
  compared (max relative difference), per preset.
* `long`: decode ms/token with `--length` cached tokens of `--long-preset` split over the ranks,
  and each rank's peak and current resident memory and cache bytes. The cache is filled as
  benchmarks/long_context.py fills it: a real `--fill-len` prefill (each rank runs it in an
  ordinary cache) tiled out to the length, every rank copying only the rows of its own segments;
  the side store (sink, window) is the real prefill's, moved to the end.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.distributed as dist

from common import reset_peak, save_json, smollm2, stamp, status_mib
from long_context import _real_ids, prefill


def _model(preset: str, threads: int):
    from kvq_ao import KVQuantConfig, quantize_kv_

    model, tokenizer = smollm2(threads)
    quantize_kv_(model, KVQuantConfig.preset(preset))
    return model, tokenizer


@torch.no_grad()
def _generate(model, cache, ids: torch.Tensor, new: int, chunk: int) -> tuple[list[int], torch.Tensor]:
    for s in range(0, ids.shape[1], chunk):
        logits = model(ids[:, s : s + chunk], cache=cache, logits_to_keep=1).logits[:, -1]
    tokens, steps = [], [logits]
    for _ in range(new - 1):
        token = steps[-1].argmax(-1, keepdim=True)
        tokens.append(int(token))
        steps.append(model(token, cache=cache).logits[:, -1])
    tokens.append(int(steps[-1].argmax(-1)))
    return tokens, torch.stack(steps)


def greedy_row(preset: str, args) -> dict | None:
    from kvq_ao import make_cache
    from kvq_ao.parallel import make_context_parallel_cache

    model, tokenizer = _model(preset, args.threads)
    ids = _real_ids(tokenizer, args.prompt_len)
    t0 = time.perf_counter()
    tokens, logits = _generate(model, make_context_parallel_cache(model, segment=args.segment), ids, args.new_tokens, args.chunk)
    seconds = time.perf_counter() - t0
    if dist.get_rank() == 0:
        want_tokens, want = _generate(model, make_cache(model), ids, args.new_tokens, args.chunk)
    dist.barrier()
    if dist.get_rank() != 0:
        return None
    rel = float(((logits - want).abs().max() / want.abs().max()))
    return dict(section="greedy", preset=preset, world=dist.get_world_size(), prompt_tokens=ids.shape[1], chunk=args.chunk,
                new_tokens=args.new_tokens, same_tokens=tokens == want_tokens, max_rel_logit_diff=rel,
                context_parallel_s=seconds, text=tokenizer.decode(tokens))  # fmt: skip


def _fill(cp, ordinary, target: int, margin: int = 512) -> None:
    """Tile the ordinary cache's real prefill into this rank's segments of `cp` out to `target` tokens."""
    for layer, src in zip(cp.layers, ordinary.layers):
        b, length = int(src.body_end), int(src.cumulative_length)
        tail = length - b
        first = math.ceil(layer.sink / layer.block) * layer.block
        period = b - first
        end = max(b, math.ceil((target - tail) / layer.block) * layer.block)
        shape = (*src.side_k.shape[:2], 1, src.side_k.shape[-1])
        layer.lazy_initialization(torch.zeros(shape, dtype=src.dtype), torch.zeros(shape, dtype=src.dtype))
        layer.ensure_capacity(end + tail + margin, exact=True)
        for body, src_body in ((layer.k_body, src.k_body), (layer.v_body, src.v_body)):
            r = src_body.meta_per_row
            for offset, local in layer.plan.segments(0, end):
                pos = torch.arange(offset, min(offset + layer.plan.segment, end))
                source = torch.where(pos < b, pos, first + (pos - b) % period)
                store, n = body.store, pos.numel()
                for name in ("codes", "out_val", "out_idx", "scale", "zero"):
                    t, s = getattr(store, name), getattr(src_body, name)
                    if t.dim() != 4 or t.shape[-1] == 0 or (name in ("scale", "zero") and src_body.spec.calibrated_ranges):
                        continue
                    per = r if name in ("scale", "zero") else 1
                    t[:, :, local // per : (local + n) // per] = s.index_select(2, source[::per] // per)
        moved = src.side_pos >= b
        new_pos = torch.where(moved, src.side_pos + (end - b), src.side_pos)
        keep = (src.side_pos >= 0) & ((src.side_pos < src.sink) | moved)
        slots = layer._slot(new_pos[keep])
        layer.side_k.index_copy_(2, slots, src.side_k[:, :, keep])
        layer.side_v.index_copy_(2, slots, src.side_v[:, :, keep])
        layer.side_pos.index_copy_(0, slots, new_pos[keep])
        layer.body_end.fill_(end)
        layer.cumulative_length = end + tail


@torch.no_grad()
def long_row(args) -> dict | None:
    from kvq_ao import make_cache
    from kvq_ao.parallel import make_context_parallel_cache

    model, tokenizer = _model(args.long_preset, args.threads)
    ordinary = make_cache(model)
    t0 = time.perf_counter()
    prefill(model, ordinary, _real_ids(tokenizer, args.fill_len), args.chunk)
    cp = make_context_parallel_cache(model, segment=args.segment)
    _fill(cp, ordinary, args.length)
    del ordinary
    fill_s = time.perf_counter() - t0
    reset_peak()
    token, times = torch.tensor([[13]]), []
    for _ in range(args.steps + 1):
        dist.barrier()
        t = time.perf_counter()
        token = model(token, cache=cp).logits[:, -1:].argmax(-1)
        times.append(1000 * (time.perf_counter() - t))
    mine = dict(rank=dist.get_rank(), cache_mib=cp.tensor_bytes() / 2**20, peak_rss_mib=status_mib("VmHWM"),
                rss_mib=status_mib("VmRSS"), ms_per_token=statistics.median(times[1:]), fill_s=fill_s)  # fmt: skip
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() != 0:
        return None
    return dict(section="long", preset=args.long_preset, world=len(ranks), cached_tokens=cp.get_seq_length(),
                segment=args.segment, ms_per_token=max(r["ms_per_token"] for r in ranks), ranks=ranks)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default="greedy,long")
    p.add_argument("--presets", default="kivi-2,kvquant-3-1pct", help="presets of the greedy section")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--segment", type=int, default=32768)
    p.add_argument("--long-preset", default="kivi-2")
    p.add_argument("--length", type=int, default=2**21)
    p.add_argument("--fill-len", type=int, default=8192)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--out", default="results/context_parallel/context_parallel.json")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rows = []
    sections = args.sections.split(",")
    if "greedy" in sections:
        rows += [greedy_row(preset, args) for preset in args.presets.split(",")]
    if "long" in sections:
        rows.append(long_row(args))
    if dist.get_rank() == 0:
        rows = [r for r in rows if r is not None]
        for r in rows:
            print(json.dumps(r), flush=True)
        save_json(args.out, dict(**stamp(command="torchrun --nproc-per-node " + str(dist.get_world_size()) + " "
                                         + " ".join(sys.argv), threads_per_rank=args.threads), rows=rows))  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
