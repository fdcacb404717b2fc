"""The GPU path in one prepared run: every conformance case on CUDA, decode attention against SDPA
on the bf16 cache with the bandwidth each reaches, prefill in chunks, and the whole decode step of a
Llama-3-8B-shaped model compiled with CUDA graphs.

    python benchmarks/gpu.py --out results/gpu              # on a machine with a CUDA GPU (~7 minutes)
    python benchmarks/gpu.py --quick --out results/gpu      # the same sections at one length each (~3 minutes)
    python benchmarks/gpu.py --dry-run --out /tmp/gpu       # anywhere: CPU tensors, Triton's interpreter, tiny shapes

Sections, each printing its rows as it goes (all rows in OUT/gpu.json, with the device, date,
versions, copy bandwidth and the script's time):

1. conformance: every decode and chunk case of the conformance suite (tests/attention_cases.py:
   formats, shapes, masks, softcap, dtypes) through `kvq.triton_decode_attention` /
   `kvq.triton_chunk_attention` on CUDA against the float64 oracle; each preset's format at 4133
   tokens, batch 2, bf16 against the reference kernel on the same device; `kvq.triton_quantize` (or
   `_fixed`) byte-identical to the reference. The run stops at the first failure.
2. attention: one layer's decode attention, SmolLM2's shape (9/3 heads, D 64) at batch 1 and
   Llama-3-8B's (32/8, D 128) at batch 1 and 8, at --lengths (and 524288 at batch 1), every preset
   family against SDPA (flash backend) on the bf16 cache: median ms of CUDA-event timings, the bytes
   each reads (packed codes, scales, outliers, side store; bf16 K/V for SDPA), the bandwidth that
   gives and its fraction of the device-to-device copy bandwidth measured in the same run.
3. launch: the split kernel's launch options (warps, pipeline stages) timed on two shapes, so the
   table in kernels/gpu/triton_ops.py (DECODE_LAUNCH) can be set from a measurement.
4. prefill: a 32768-token prompt in 2048-token chunks through an 8-layer Llama-3-8B-shaped model
   (random weights, bf16, batch 1): tokens/s of the bf16 SDPA path and of each preset.
5. step: the whole decode step of that model at batch 8 and --step-length tokens, compiled with
   mode="reduce-overhead" (CUDA graphs): a bf16 StaticCache against kvq presets, with the bandwidth
   model (weight bytes + KV bytes read) / copy bandwidth printed beside each row.

Operands and models are built without a calibration or real weights (so the script needs nothing
but this checkout and its wheels): a preset's widths, groups and outlier slots are its own, "nuq"
levels are replaced by NormalFloat levels of the same width (the same kernel path: a codebook
lookup), outlier thresholds (and calibrated key ranges) are set at the per-channel quantiles that
make about the preset's outlier fraction. Decode time does not depend on weights or values.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from common import save_json, stamp

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}  # (query heads, kv heads, head_dim)
DRY_SHAPES = {"smollm2": (9, 3, 64), "llama3-8b": (4, 2, 64)}  # head_dim 64: the presets' groups
NOMINAL_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0, "A10": 600.0, "RTX 4090": 1008.0}
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
LAUNCH_OPTIONS = [(4, 1, 255), (8, 1, 255), (8, 1, None), (4, 2, 255), (8, 2, 255), (8, 3, 255)]  # (num_warps, num_stages, maxnreg)


# ---------------------------------------------------------------------------------------- operands
def _operand(x: torch.Tensor, side: torch.Tensor, spec, scale_dtype: torch.dtype, dtype: torch.dtype):
    """K or V of x [B, H, T, D] (float32) in a QuantSpec's format with side entries `side`, as an
    attention operand (`kvq_ao.format.Operand`)."""
    from kvq_ao.format import AXIS_CHANNEL, AXIS_TOKEN, Operand, encode, format_ints
    from kvq_ao.quant.codebook import nf_codebook
    from kvq_ao.quant.uniform import fixed_range

    axis = AXIS_CHANNEL if spec.axis == "channel" else AXIS_TOKEN
    bits, _, group, query_bits, meta = encode(spec.bits, axis, spec.group_size, calibrated_rows=spec.calibrated_ranges,
                                              query_bits=spec.query_bits, meta=spec.meta)  # fmt: skip
    fields = dict(bits=bits, axis=axis, group=group, query_bits=query_bits, meta=meta, codes=x.to(dtype), scale=None, zero=None,
                  codebook=None, out_val=None, out_idx=None, side=side.to(dtype))  # fmt: skip
    if spec.bits:
        codebook = nf_codebook(spec.bits).to(x.device) if spec.dtype != "int" else None
        slots = spec.outlier_slots(x.shape[-1])
        lo = hi = x.new_zeros(0)
        if (slots and axis == AXIS_CHANNEL) or spec.calibrated_ranges:  # per-channel ranges at the quantiles of the preset's fraction
            lo, hi = _channel_ranges(x, max(spec.outliers, 0.01))
        levels_cb = codebook if codebook is not None else x.new_zeros(0)
        if spec.calibrated_ranges:  # fixed ranges: codes against one scale/zero row for every position
            zero, scale = fixed_range(lo, hi, 1 if codebook is not None else 2**spec.bits - 1, scale_dtype)
            codes, out_val, out_idx, _ = torch.ops.kvq.quantize_fixed(x, spec.bits, zero, scale, levels_cb, lo, hi, slots)
            rows = lambda t: t[None, :, None, :].expand(x.shape[0], -1, 1, -1).contiguous()  # noqa: E731
            scale, zero = rows(scale), rows(zero)
        else:
            codes, scale, zero, out_val, out_idx, _ = torch.ops.kvq.quantize(
                x, format_ints(spec.bits, axis, spec.group_size, meta=meta), scale_dtype, levels_cb, lo, hi, slots)  # fmt: skip
        fields.update(codes=codes, scale=scale, zero=zero, codebook=codebook)
        if slots:
            fields.update(out_val=out_val.to(dtype), out_idx=out_idx)
    return Operand(**fields)


def _channel_ranges(x: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head, per-channel [lo, hi] [H, D] holding all but `fraction` of x's entries (as calibration would)."""
    sample = x[0].transpose(0, 1).reshape(-1, x.shape[1], x.shape[-1])[:4096].float()
    return torch.quantile(sample, fraction / 2, dim=0), torch.quantile(sample, 1 - fraction / 2, dim=0)


def layer_arguments(preset: str, batch: int, length: int, capacity: int, device, dtype, seed: int = 0, shape=None) -> dict:
    """Named decode-attention arguments for one layer of `shape` (default SmolLM2's) holding
    `length` tokens of a preset's format in a cache of `capacity` positions (random N(0, 1) keys
    and values, drawn on the device)."""
    HQ, HKV, D = shape or SHAPES["smollm2"]
    from kvq_ao import KVQuantConfig

    cfg = KVQuantConfig.preset(preset)
    spec = cfg.default
    g = torch.Generator(device=device).manual_seed(seed)
    key_group = spec.key.group_size if spec.key.axis == "channel" and not spec.key.calibrated_ranges else 1
    capacity = -(-capacity // key_group) * key_group
    k = torch.randn(batch, HKV, capacity, D, generator=g, device=device)
    v = torch.randn(batch, HKV, capacity, D, generator=g, device=device)
    scale_dtype = getattr(torch, cfg.scale_dtype)
    named = {"q": torch.randn(batch, HQ, 1, D, generator=g, device=device).to(dtype)}
    # the body holds whole key groups behind the window; the side store the sink and the rest
    window = max(cfg.residual_length, 1)
    body_end = max(cfg.sink_tokens, (length - window) // key_group * key_group)
    side_pos = list(range(cfg.sink_tokens)) + list(range(body_end, length))
    n_side = len(side_pos)
    named["k"] = _operand(k, torch.randn(batch, HKV, n_side, D, generator=g, device=device), spec.key, scale_dtype, dtype)
    named["v"] = _operand(v, torch.randn(batch, HKV, n_side, D, generator=g, device=device), spec.value, scale_dtype, dtype)
    named.update(
        side_pos=torch.tensor(side_pos, dtype=torch.int64, device=device),
        body_end=torch.tensor(body_end, dtype=torch.int64, device=device),
        mask=(torch.arange(capacity, device=device) < length).expand(batch, 1, 1, capacity).contiguous(),
        rope_inv_freq=(1.0 / 10000.0 ** (torch.arange(0, D, 2, device=device).float() / D)) if cfg.pre_rope_keys else None,
        body_start=cfg.sink_tokens, scaling=D**-0.5, rope_scale=1.0, softcap=0.0,
    )  # fmt: skip
    return named


def op_args(named: dict) -> dict:
    """A layer's arguments (K and V as operands) as the attention ops take them."""
    from kvq_ao.ops import attention_arguments

    rest = {n: v for n, v in named.items() if n not in ("q", "k", "v")}
    return attention_arguments(named["q"], named["k"], named["v"], **rest)


def bytes_read(named: dict) -> int:
    """What the decode attention must read: the filled body's packed fields and the side store."""
    length = int(named["body_end"])
    capacity = named["k"].codes.shape[2]
    total = named["k"].side.nbytes + named["v"].side.nbytes
    for name in ("codes", "scale", "zero", "out_val", "out_idx"):
        for prefix in ("k", "v"):
            t = getattr(named[prefix], name)
            if t is not None:
                total += t.nbytes * length // capacity
    return total


# ---------------------------------------------------------------------------------------- timing
def timer(device: torch.device):
    """ms of one call: CUDA events on a GPU, perf_counter elsewhere."""
    if device.type == "cuda":

        def cuda_ms(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        return cuda_ms

    def cpu_ms(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return 1000 * (time.perf_counter() - t0)

    return cpu_ms


def median_ms(fn, device, repeats: int) -> float:
    fn()  # warm-up (Triton compiles on the first call)
    once = timer(device)
    return statistics.median(once(fn) for _ in range(repeats))


def copy_gbs(device, mib: int) -> float:
    """Device copy bandwidth (read + write bytes per second) of a `mib`-MiB buffer, best of 5."""
    src = torch.empty(mib * 2**18, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    once = timer(device)
    best = min(once(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * src.nbytes / (best / 1000) / 1e9


def sdpa_context(device):
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


# ---------------------------------------------------------------------------------------- sections
def conformance(args, device, emit) -> None:
    """The conformance suite's cases on `device`, then the presets' formats in bf16 and quantize."""
    sys.path.insert(0, str(ROOT / "tests"))
    from attention_cases import (CHUNK_CASES, DECODE_CASES, attend, chunk_case, decode_case, expected_streaming, map_tensors,
                                 reference_attention)  # fmt: skip
    from attention_cases import TOLERANCE as CASE_TOLERANCE

    from kvq_ao import masks

    def run(kind: str, case_id: str, named: dict, want: torch.Tensor, tol: float) -> None:
        op = torch.ops.kvq.triton_decode_attention if kind == "decode" else torch.ops.kvq.triton_chunk_attention
        got = attend(map_tensors(named, lambda t: t.to(device)), op).cpu()
        diff = (got.double() - want).abs().max().item()
        ok = diff <= tol * max(1.0, want.abs().max().item())
        emit(dict(section="conformance", case=f"{kind}:{case_id}", dtype=str(named["q"].dtype), max_abs_diff=diff, ok=ok))
        if not ok:
            raise SystemExit(f"the Triton {kind} attention fails conformance case {case_id}: max |diff| {diff:.3g}")

    decode_ids, chunk_ids = list(DECODE_CASES), list(CHUNK_CASES)
    if args.dry_run:  # the interpreter: a few of each (tests/kernels/test_conformance.py runs them all on CI)
        decode_ids, chunk_ids = decode_ids[:3], chunk_ids[:1]
    decode_ids = [c for c in decode_ids if not c.startswith("int8-query")]  # int8-query keys: not built in Triton
    chunk_ids = [c for c in chunk_ids if not c.startswith("int8-query")]
    for case_id in decode_ids:
        named = decode_case(case_id)
        run("decode", case_id, named, reference_attention(named), CASE_TOLERANCE[named["q"].dtype])
    for case_id in chunk_ids:
        named = chunk_case(case_id)
        want = expected_streaming(named)
        run("chunk", case_id + "/bounds", named, want, 2e-5)
        run("chunk", case_id + "/dense", dict(named, mask=masks.dense(named["mask"], named["k"].codes.shape[2])), want, 2e-5)
    check_presets(args, device, torch.bfloat16 if device.type == "cuda" else torch.float32, emit)


def check_presets(args, device, dtype, emit) -> None:
    from kvq_ao.kernels import reference
    from kvq_ao.ops import reference_arguments

    for preset in args.presets.split(","):
        named = layer_arguments(preset, 2, args.check_length, args.check_length + 37, device, dtype, seed=1)
        got = torch.ops.kvq.triton_decode_attention(**op_args(named))
        want = reference.attention(**reference_arguments(named), target="eager")
        diff = (got.float() - want.float()).abs().max().item()
        ok = diff <= TOLERANCE[dtype] * max(1.0, want.abs().max().item())
        emit(dict(section="check", format=preset, tokens=args.check_length, dtype=str(dtype), max_abs_diff=diff, ok=ok))
        if not ok:
            raise SystemExit(f"the Triton kernel differs from the reference for {preset}: {diff:.3g}")
        differing = quantize_differences(preset, device)
        emit(dict(section="check-quantize", format=preset, differing_fields=",".join(differing), ok=not differing))
        if differing:
            raise SystemExit(f"the Triton quantize differs from the reference for {preset} in {differing}")


def quantize_differences(preset: str, device) -> list[str]:
    HKV, D = SHAPES["smollm2"][1:]
    """The fields of `kvq.triton_quantize` that are not byte-identical to the reference quantize,
    for a block of a preset's keys and values (float32 input, so no two entries tie)."""
    from kvq_ao import KVQuantConfig
    from kvq_ao.kernels import reference
    from kvq_ao.quant.codebook import nf_codebook
    from kvq_ao.format import AXIS_CHANNEL, AXIS_TOKEN, format_ints
    from kvq_ao.quant.uniform import fixed_range

    cfg = KVQuantConfig.preset(preset)
    differing = []
    g = torch.Generator(device="cpu").manual_seed(2)
    for name, spec in (("key", cfg.default.key), ("value", cfg.default.value)):
        x = (torch.randn(2, HKV, 256, D, generator=g) * 2).to(device)
        axis = AXIS_CHANNEL if spec.axis == "channel" else AXIS_TOKEN
        slots = spec.outlier_slots(D)
        vector = slots and (axis == AXIS_TOKEN and spec.outlier_rule == "vector")
        lo, hi = (x.new_zeros(0), x.new_zeros(0)) if not slots or vector else (-1.5 * x.new_ones(HKV, D), 1.5 * x.new_ones(HKV, D))
        codebook = nf_codebook(spec.bits).to(device) if spec.dtype != "int" else x.new_zeros(0)
        if spec.calibrated_ranges:  # keys coded on arrival against fixed ranges
            lo, hi = -1.5 * x.new_ones(HKV, D), 1.5 * x.new_ones(HKV, D)
            zero, scale = fixed_range(lo, hi, 1 if codebook.numel() else 2**spec.bits - 1, getattr(torch, cfg.scale_dtype))
            args = (x, spec.bits, zero, scale, codebook, lo, hi, slots)
            got, want = torch.ops.kvq.triton_quantize_fixed(*args), reference.quantize_fixed(*args)
            fields = ("codes", "out_val", "out_idx", "clamped")
        else:
            args = (x, format_ints(spec.bits, axis, spec.group_size, meta=spec.meta), getattr(torch, cfg.scale_dtype), codebook, lo, hi, slots)
            got, want = torch.ops.kvq.triton_quantize(*args), reference.quantize(*args)
            fields = ("codes", "scale", "zero", "out_val", "out_idx", "clamped")
        differing += [f"{name}.{f}" for f, a, b in zip(fields, got, want) if not torch.equal(a, b)]
    return differing


def attention_grid(args) -> list[tuple[str, int, int]]:
    """(shape, batch, tokens) rows of the attention section."""
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.quick:
        return [("smollm2", 1, lengths[-1]), ("llama3-8b", 8, lengths[-1])]
    rows = [(shape, 1, n) for shape in ("smollm2", "llama3-8b") for n in lengths + [args.long_length]]
    return rows + [("llama3-8b", 8, n) for n in lengths]


def attention(args, device, dtype, gbs: float, emit) -> None:
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    for shape_name, batch, n in attention_grid(args):
        hq, hkv, d = shapes[shape_name]
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(batch, hq, 1, d, generator=g, device=device).to(torch.bfloat16)
        k = torch.randn(batch, hkv, n, d, generator=g, device=device).to(torch.bfloat16)
        v = torch.randn(batch, hkv, n, d, generator=g, device=device).to(torch.bfloat16)
        with sdpa_context(device):
            once = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
            sdpa = median_ms(once, device, args.repeats)
        rows = [("sdpa-bf16", sdpa, k.nbytes + v.nbytes)]
        k = v = None
        for preset in args.presets.split(","):
            named = layer_arguments(preset, batch, n, n, device, dtype, shape=shapes[shape_name])
            ms = median_ms(lambda: torch.ops.kvq.triton_decode_attention(**op_args(named)), device, args.repeats)
            rows.append((preset, ms, bytes_read(named)))
            named = None
        for fmt, ms, nbytes in rows:
            achieved = nbytes / (ms / 1000) / 1e9
            emit(dict(section="attention", shape=shape_name, batch=batch, format=fmt, tokens=n, ms=ms, mib_read=nbytes / 2**20,
                      gbs=achieved, of_copy_bw=achieved / gbs, vs_sdpa=sdpa / ms))  # fmt: skip


def launch(args, device, dtype, emit) -> None:
    """The split kernel under each LAUNCH_OPTIONS entry, for the first and last presets (a dry run: the
    first two options, batch 1 only)."""
    from kvq_ao.kernels.gpu import triton_ops

    shapes = DRY_SHAPES if args.dry_run else SHAPES
    n = [int(x) for x in args.lengths.split(",")][-1]
    presets = args.presets.split(",")
    for shape_name, batch in (("smollm2", 1),) if args.dry_run else (("smollm2", 1), ("llama3-8b", 8)):
        for preset in dict.fromkeys([presets[0], presets[-1]]):
            named = layer_arguments(preset, batch, n, n, device, dtype, shape=shapes[shape_name])
            for warps, stages, maxnreg in LAUNCH_OPTIONS[:2] if args.dry_run else LAUNCH_OPTIONS:
                options = dict(num_warps=warps, num_stages=stages, **({"maxnreg": maxnreg} if maxnreg else {}))
                with triton_ops.decode_launch(**options):
                    ms = median_ms(lambda: torch.ops.kvq.triton_decode_attention(**op_args(named)), device, args.repeats)
                emit(dict(section="launch", shape=shape_name, batch=batch, format=preset, tokens=n, num_warps=warps,
                          num_stages=stages, maxnreg=maxnreg, ms=ms, gbs=bytes_read(named) / (ms / 1000) / 1e9,
                          current=options == triton_ops.DECODE_LAUNCH))  # fmt: skip


def llama3_shaped(layers: int, device, dtype, dry_run: bool):
    """A Llama model of Llama-3-8B's shape (or a tiny one for dry runs) with `layers` layers and random
    weights, initialized on the device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hq, hkv, d = (DRY_SHAPES if dry_run else SHAPES)["llama3-8b"]
    size = dict(vocab_size=512, hidden_size=hq * d, intermediate_size=512) if dry_run else \
        dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336)  # fmt: skip
    cfg = LlamaConfig(num_hidden_layers=layers, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d,
                      max_position_embeddings=1 << 20, rope_theta=500000.0, **size)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


def prefill(args, device, dtype, emit) -> None:
    from kvq_ao import KVQuantConfig, make_cache, quantize_kv_

    n, chunk = args.prefill_length, args.prefill_chunk
    ids = torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(0)).to(device)
    base = None
    for preset in ["bf16-sdpa", *args.step_presets.split(",")]:
        model = llama3_shaped(args.layers, device, dtype, args.dry_run)
        if preset != "bf16-sdpa":
            cfg = KVQuantConfig.preset(preset)
            quantize_kv_(model, cfg)

        def run(tokens: torch.Tensor) -> None:
            from transformers import DynamicCache

            cache = DynamicCache(config=model.config) if preset == "bf16-sdpa" else make_cache(model, cfg, reserve=tokens.shape[1])
            with torch.no_grad():
                for s in range(0, tokens.shape[1], chunk):
                    part = tokens[:, s : s + chunk]
                    model(part, cache=cache, position_ids=torch.arange(s, s + part.shape[1], device=device)[None], logits_to_keep=1)

        run(ids[:, : 2 * chunk])  # warm-up: kernels compiled
        ms = timer(device)(lambda: run(ids))
        base = ms if preset == "bf16-sdpa" else base
        emit(dict(section="prefill", format=preset, tokens=n, chunk=chunk, layers=args.layers, ms=ms,
                  tokens_per_s=n / (ms / 1000), vs_bf16=base / ms))  # fmt: skip
        model = None


def step(args, device, dtype, gbs: float, emit) -> None:
    """The compiled decode step at batch --step-batch over --step-length tokens, with its bandwidth model."""
    from transformers import StaticCache

    from kvq_ao import KVQuantConfig, make_cache, quantize_kv_
    from kvq_ao.memory import estimate

    n, batch, steps = args.step_length, args.step_batch, args.steps
    hq, hkv, d = (DRY_SHAPES if args.dry_run else SHAPES)["llama3-8b"]
    base = None
    for preset in ["bf16-static", *args.step_presets.split(",")]:
        model = llama3_shaped(args.layers, device, dtype, args.dry_run)
        weights = sum(p.nbytes for name, p in model.named_parameters() if "embed_tokens" not in name)
        if preset == "bf16-static":
            cache = StaticCache(config=model.config, max_cache_len=n + steps + 4)
            kv_bytes = 2 * args.layers * batch * hkv * n * d * 2
        else:
            cfg = KVQuantConfig.preset(preset)
            quantize_kv_(model, cfg)
            cache = make_cache(model, cfg, reserve=n + steps + 4)
            kv_bytes = estimate(cfg, args.layers, hkv, d, n, batch=batch, dtype=dtype).bytes
        g = torch.Generator(device=device).manual_seed(0)
        for layer in range(args.layers):  # n random keys and values in every layer
            for s in range(0, n, 4096):
                size = min(4096, n - s)
                k = torch.randn(batch, hkv, size, d, generator=g, device=device).to(dtype)
                v = torch.randn(batch, hkv, size, d, generator=g, device=device).to(dtype)
                if preset == "bf16-static":
                    cache.update(k, v, layer, {"cache_position": torch.arange(s, s + size, device=device)})
                else:
                    cache.layers[layer].update(k, v)
        token = torch.full((batch, 1), 17, device=device)

        def one(pos: torch.Tensor):  # pos [batch, 1]: a tensor, so every step runs the same graph
            return model(token, cache=cache, position_ids=pos, cache_position=pos[0]).logits

        compiled = torch.compile(one, fullgraph=True, **(dict(backend="eager") if args.dry_run else dict(mode="reduce-overhead")))
        once = timer(device)
        with torch.no_grad():
            positions = [torch.full((batch, 1), n + i, device=device) for i in range(steps + 3)]
            for i in range(3):  # compile, record the CUDA graph, replay
                compiled(positions[i])
            times = [once(lambda: compiled(positions[3 + i])) for i in range(steps)]
        ms = statistics.median(times)
        model_ms = (weights + kv_bytes) / (gbs * 1e9) * 1000
        base = ms if preset == "bf16-static" else base
        emit(dict(section="step", format=preset, tokens=n, batch=batch, layers=args.layers, ms=ms, vs_bf16=base / ms,
                  model_ms=model_ms, of_model=model_ms / ms, weight_mib=weights / 2**20, kv_mib=kv_bytes / 2**20))  # fmt: skip
        model = cache = compiled = None
        torch._dynamo.reset()


def main() -> None:
    started = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU tensors in Triton's interpreter, tiny shapes (for CI)")
    p.add_argument("--quick", action="store_true", help="one length per section, fewer repeats (~3 minutes on a GPU)")
    p.add_argument("--presets", default="int8,kivi-4,kivi-2,kvquant-3-1pct,kvquant-2-1pct")
    p.add_argument("--lengths", default="8192,32768,131072")
    p.add_argument("--long-length", type=int, default=524288, help="the batch-1 rows' longest context")
    p.add_argument("--step-presets", default="kivi-4,kivi-2")
    p.add_argument("--step-length", type=int, default=32768)
    p.add_argument("--step-batch", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prefill-length", type=int, default=32768)
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--check-length", type=int, default=4133)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--sections", default="conformance,attention,launch,prefill,step")
    p.add_argument("--out", default="results/gpu", help="folder for gpu.json (or the .json file itself)")
    args = p.parse_args()
    from kvq_ao.kernels import gpu

    if args.quick:
        args.lengths, args.repeats, args.steps = "32768", 10, 10
        args.step_presets = ",".join(args.step_presets.split(",")[:2])
    if args.dry_run:
        # the interpreter runs a tile in seconds: shapes just past one tile, one timed call each
        # (the timings mean nothing here; correctness is the conformance and check sections')
        args.lengths, args.long_length, args.check_length = "128", 192, 300
        args.step_length, args.step_batch, args.prefill_length, args.prefill_chunk = 200, 2, 256, 128
        args.layers, args.steps, args.repeats = 2, 2, 1
        args.presets, args.step_presets = "kivi-4,kvquant-3-1pct", "kivi-2"
        device, context, copy_mib = torch.device("cpu"), gpu.on_cpu(), 64
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run to check the script on CPU (Triton's interpreter)")
    else:
        if not gpu.load():
            raise SystemExit("triton is not installed: pip install 'kvq_ao[gpu]'")
        device, context, copy_mib = torch.device("cuda"), contextlib.nullcontext(), 2048
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    nominal = next((bw for key, bw in NOMINAL_GBS.items() if key in name), None)
    out = Path(args.out) if args.out.endswith(".json") else Path(args.out) / "gpu.json"  # a file also works
    rows: list[dict] = []
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    import triton

    with context:
        gbs = copy_gbs(device, copy_mib)
        header = stamp(device=name, dry_run=args.dry_run, quick=args.quick, torch=torch.__version__, triton=triton.__version__,
                       copy_gbs=gbs, nominal_gbs=nominal, command=" ".join(["benchmarks/gpu.py", *sys.argv[1:]]))  # fmt: skip
        print(f"{name}: copy bandwidth {gbs:.0f} GB/s" + (f", nominal {nominal:.0f} GB/s" if nominal else ""), flush=True)

        def emit(row: dict) -> None:
            row = {**row, "elapsed_s": round(time.perf_counter() - started, 1)}
            rows.append(row)
            print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
            save_json(out, {**header, "rows": rows})

        sections = args.sections.split(",")
        if "conformance" in sections:
            conformance(args, device, emit)
        if "attention" in sections:
            attention(args, device, dtype, gbs, emit)
        if "launch" in sections:
            launch(args, device, dtype, emit)
        if "prefill" in sections:
            prefill(args, device, dtype, emit)
        if "step" in sections:
            step(args, device, dtype, gbs, emit)
    total = time.perf_counter() - started
    save_json(out, {**header, "seconds": total, "rows": rows})
    print(f"done in {total:.0f} s: {out}", flush=True)


if __name__ == "__main__":
    main()
