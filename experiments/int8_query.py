"""Would integer dot products for key scores cost quality? Simulated on SmolLM2 before any kernel is built.

Issue 48 proposes scoring keys in per-channel groups from their codes with integer dot products
(VNNI `vpdpbusd` on x86, `sdot` on Arm), against a query quantized to int8 once per step, as
llama.cpp's q8 `vec_dot` does. For such keys, q . (s * code + z) = (q * s) . code + q . z over a
group of tokens sharing the scale row s and zero row z; the integer path would quantize
qs = q * s (per query head and token group, over blocks of `--blocks` channels) to int8 with
alpha = max|qs| / 127, and score alpha * (int8 qs . code) + q . z, exact in int32. Everything else
(side store, softmax, values) stays float.

This script computes exactly that in float64 inside the reference attention (products of int8 and
codes below 2^24 are exact) and measures, on the 48 held-out windows the presets are judged on,
the change of perplexity against the same cache scored in float by the same float64 code (block 0;
float32 vs float64 alone moves a window's NLL by ~1e-4 a token): issue 48's budget is |dPPL|
within 0.05 points of percentage of fp PPL, per preset where the path would be on by default.
Windows of 1025 tokens, chunks of 64 as `benchmarks/kvquant_quality.py`; KVQ_AO_NATIVE=0, so that
every score (the last token's decode step too) goes through the simulated reference. Rows are
merged into --out by preset and block. docs/integer_scores.md has the results.

    KVQ_AO_NATIVE=0 python experiments/int8_query.py --presets kivi-4,kivi-2 --blocks 64,32
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import eval_windows, save_json, smollm2, stamp  # noqa: E402


def int8_query(qs: torch.Tensor, block: int) -> torch.Tensor:
    """qs [..., D] -> alpha * round(qs / alpha) with alpha = max|qs| / 127 per block of channels
    (block 0: qs unchanged, the float scores computed by the same float64 code)."""
    if block == 0:
        return qs
    shape = qs.shape
    x = qs.reshape(*shape[:-1], shape[-1] // block, block)
    alpha = x.abs().amax(-1, keepdim=True) / 127
    alpha = torch.where(alpha > 0, alpha, torch.ones_like(alpha))
    return (torch.round(x / alpha).clamp(-127, 127) * alpha).reshape(shape)


def simulated_attention(block: int):
    """A stand-in for `kvq_ao.kernels.reference.attention` that scores per-channel uniform keys
    (no outliers, keys after RoPE: the kivi presets) with an int8-quantized q * scale."""
    from kvq_ao.kernels import reference
    from kvq_ao.kernels.reference import dequantize_operand, dequantize_uniform

    def attention(q, k, v, side_pos, body_end, mask, rope_inv_freq, body_start, scaling, rope_scale, softcap=0.0, *,
                  target="export"):  # fmt: skip
        from kvq_ao import masks
        from kvq_ao.format import AXIS_CHANNEL

        present = lambda t: t is not None and t.numel() > 0  # noqa: E731
        if k.axis != AXIS_CHANNEL or present(k.codebook) or present(k.out_val) or present(rope_inv_freq) or softcap:
            raise ValueError("the simulation covers per-channel uniform keys after RoPE without outliers (kivi)")
        if masks.is_bounds(mask):
            mask = masks.dense(mask, k.codes.shape[2])
        b, hq, tq, d = q.shape
        hkv, t, g = k.codes.shape[1], k.codes.shape[2], k.group
        n = hq // hkv
        ng = t // g
        codes = dequantize_uniform(k.codes, torch.ones_like(k.scale), torch.zeros_like(k.zero), k.bits, k.axis, k.group,
                                   torch.float32).double()  # fmt: skip
        scale, zero = k.scale.double(), k.zero.double()  # [B, Hkv, NG, D]
        qd = q.double().reshape(b, hkv, n, tq, d)
        qs = qd.unsqueeze(4) * scale[:, :, None, None]  # [B, Hkv, n, Tq, NG, D]
        qi = int8_query(qs, block)
        s_int = torch.einsum("bhnqgd,bhgjd->bhnqgj", qi, codes.reshape(b, hkv, ng, g, d)).reshape(b, hkv, n, tq, t)
        bias = torch.einsum("bhnqd,bhgd->bhnqg", qd, zero).repeat_interleave(g, dim=-1)
        s_body = (s_int + bias) * scaling
        sk, sv = k.side.double(), v.side.double()
        s_side = torch.einsum("bhnqd,bhsd->bhnqs", qd, sk) * scaling
        body_mask, side_mask = reference._masks(mask, side_pos, body_start, body_end, t)
        heads = (hkv, n) if body_mask.shape[1] > 1 else (1, 1)
        s_body = s_body.masked_fill(~body_mask.reshape(b, *heads, tq, t), float("-inf"))
        s_side = s_side.masked_fill(~side_mask.reshape(b, *heads, tq, side_pos.shape[0]), float("-inf"))
        scores = torch.cat([s_body, s_side], dim=-1)
        top = scores.amax(-1, keepdim=True)
        p = torch.exp(scores - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
        denom = p.sum(-1, keepdim=True)
        vd = dequantize_operand(v, torch.float64)
        out = torch.einsum("bhnqt,bhtd->bhnqd", p[..., :t], vd) + torch.einsum("bhnqs,bhsd->bhnqd", p[..., t:], sv)
        out = out / torch.where(denom > 0, denom, torch.ones_like(denom))
        return out.reshape(b, hq, tq, -1).to(q.dtype)

    def streaming_attention(*, position_offset: int = 0, with_lse: bool = False, **arguments):
        if position_offset or with_lse:
            raise ValueError("the simulation covers whole-sequence chunks (no shards)")
        return attention(**arguments)

    return attention, streaming_attention


def patched(functions):
    """Context: the reference's `attention` and `streaming_attention` replaced by `functions`
    (None: left as they are)."""
    import contextlib

    from kvq_ao.kernels import reference

    @contextlib.contextmanager
    def scope():
        saved = reference.attention, reference.streaming_attention
        if functions is not None:
            reference.attention, reference.streaming_attention = functions
        try:
            yield
        finally:
            reference.attention, reference.streaming_attention = saved

    return scope()


@torch.no_grad()
def window_nll(model, config, ids: torch.Tensor, chunk: int) -> float:
    """Summed NLL of a window's next tokens through a fresh quantized cache, chunk by chunk."""
    from kvq_ao import make_cache

    cache = make_cache(model, config)
    logits = torch.cat([model(ids[:, s : s + chunk], cache=cache).logits[0].float() for s in range(0, ids.shape[1], chunk)])
    return F.nll_loss(F.log_softmax(logits[:-1], -1), ids[0, 1:], reduction="sum").item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="kivi-4,kivi-2")
    parser.add_argument("--blocks", default="64,32", help="channels per int8 block of q * scale, one pass each")
    parser.add_argument("--windows", type=int, default=48)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--out", default="results/int8_query/int8_query.json")
    args = parser.parse_args()
    if os.environ.get("KVQ_AO_NATIVE") != "0":
        raise SystemExit("run with KVQ_AO_NATIVE=0: the native decode kernel would score the last token in float")
    from tqdm import tqdm

    from kvq_ao import KVQuantConfig, quantize_kv_
    model, tokenizer = smollm2(2)
    windows = eval_windows(tokenizer, args.windows, 1025)
    blocks = [int(b) for b in args.blocks.split(",")]
    passes = {0: simulated_attention(0), **{b: simulated_attention(b) for b in blocks}}
    tokens = windows.shape[0] * (windows.shape[1] - 1)
    out = Path(args.out)
    rows = json.loads(out.read_text())["rows"] if out.exists() else []  # rows of other presets/blocks are kept
    for preset in args.presets.split(","):
        config = KVQuantConfig.preset(preset)
        quantize_kv_(model, config)
        nll = {b: [] for b in passes}
        t0 = time.time()
        for row in tqdm(windows, desc=preset):
            for block, functions in passes.items():
                with patched(functions):
                    nll[block].append(window_nll(model, config, row.unsqueeze(0), args.chunk))
        with torch.no_grad():  # quantize_kv_ leaves a cache-less forward in float: the fp reference
            fp = sum(F.cross_entropy(model(row.unsqueeze(0)).logits[0, :-1].float(), row[1:], reduction="sum").item() for row in windows)
        ppl_fp, ppl_float = math.exp(fp / tokens), math.exp(sum(nll[0]) / tokens)
        for block in blocks:
            ppl = math.exp(sum(nll[block]) / tokens)
            per_token = torch.tensor([(a - b) / (windows.shape[1] - 1) for a, b in zip(nll[block], nll[0])], dtype=torch.float64)
            half = 1.96 * per_token.std().item() / math.sqrt(len(per_token))  # 95% interval of the mean NLL change a token
            mean = per_token.mean().item()
            row = dict(preset=preset, block=block, windows=args.windows, tokens=tokens, ppl_fp=ppl_fp, ppl_float=ppl_float,
                       ppl_int8=ppl, delta_points=100 * (ppl - ppl_float) / ppl_fp,
                       delta_points_ci95=[100 * ppl_float * (math.exp(mean + s * half) - 1) / ppl_fp for s in (-1, 1)],
                       seconds=round(time.time() - t0, 1))  # fmt: skip
            rows = [r for r in rows if (r["preset"], r["block"]) != (preset, block)] + [row]
            print(f"{preset}, int8 blocks of {block}: PPL fp {ppl_fp:.4f}, float {ppl_float:.4f}, int8 {ppl:.4f}: "
                  f"{row['delta_points']:+.4f} points of fp PPL [{row['delta_points_ci95'][0]:+.4f}, {row['delta_points_ci95'][1]:+.4f}]",
                  flush=True)  # fmt: skip
            save_json(args.out, stamp(threads=2, windows=args.windows, chunk=args.chunk, rows=rows))


if __name__ == "__main__":
    main()
