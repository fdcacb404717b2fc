"""The GPU path in one prepared run: the Triton decode attention checked against the reference and
timed against SDPA on a bf16 cache, then a whole decode step, on a CUDA device.

    python benchmarks/gpu.py --out results/gpu.json        # on a machine with a CUDA GPU
    python benchmarks/gpu.py --dry-run --out /tmp/gpu.json # anywhere: CPU tensors, Triton's interpreter, tiny shapes

Sections, each printing its rows as it goes (all rows in --out, with the device, date and versions):

1. check: `kvq.triton_decode_attention` against the reference kernel (kernels/reference.py) on the
   same device, per preset format, batch 2, a length that ends mid-block, a sink and a window in the
   side store; the largest difference must be within float tolerance, else the run stops. Then
   `kvq.triton_quantize` (or `kvq.triton_quantize_fixed` for calibrated key ranges) on a block of the
   preset's keys and values: byte-identical to the reference, else the run stops.
2. attention: one layer of SmolLM2's shape (9 query heads, 3 kv heads, head_dim 64), batch 1, at each
   --lengths: the Triton op against `scaled_dot_product_attention` on the bf16 cache (flash or
   memory-efficient backend), median of CUDA-event timings; the bytes each reads (packed codes,
   scales, outliers, side store; bf16 K/V for SDPA) and the bandwidth that gives, as a fraction of
   the device-to-device copy bandwidth measured in the same run (and of the nominal peak when the
   device is in NOMINAL_GBS).
3. step: a whole decode step (all 30 layers, eager) of a SmolLM2-shaped model in bf16, fp cache
   (DynamicCache, SDPA) against kivi-4 and kivi-2 at each --step-lengths. The weights are random and
   the caches are filled with random keys and values: the step's time does not depend on either,
   and SmolLM2's weights (a 93 MB GGUF) cannot travel to a lent device machine (64 MiB limit).

Operands are built without a calibration (so the script needs nothing but this repository):
a preset's widths, groups and outlier slots are its own, "nuq" levels are replaced by NormalFloat
levels of the same width (the same kernel path: a codebook lookup), and outlier thresholds (and the
fixed ranges of calibrated keys, read as one scale/zero row) are set at the per-channel quantiles
that make about the preset's outlier fraction.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import sys
import time

import torch

from common import save_json, stamp

HQ, HKV, D = 9, 3, 64  # SmolLM2-135M's attention shape
NOMINAL_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0, "A10": 600.0, "RTX 4090": 1008.0}
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


# ---------------------------------------------------------------------------------------- operands
def _operand(x: torch.Tensor, side: torch.Tensor, spec, scale_dtype: torch.dtype, dtype: torch.dtype):
    """K or V of x [B, H, T, D] (float32) in a QuantSpec's format with side entries `side`, as an
    attention operand (`kvq_ao.format.Operand`)."""
    from kvq_ao.format import AXIS_CHANNEL, AXIS_TOKEN, Operand, encode, format_ints
    from kvq_ao.quant.codebook import nf_codebook
    from kvq_ao.quant.uniform import fixed_range

    axis = AXIS_CHANNEL if spec.axis == "channel" else AXIS_TOKEN
    bits, _, group = encode(spec.bits, axis, spec.group_size, calibrated_rows=spec.calibrated_ranges)
    fields = dict(bits=bits, axis=axis, group=group, codes=x.to(dtype), scale=None, zero=None,
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
                x, format_ints(spec.bits, axis, spec.group_size), scale_dtype, levels_cb, lo, hi, slots)  # fmt: skip
        fields.update(codes=codes, scale=scale, zero=zero, codebook=codebook)
        if slots:
            fields.update(out_val=out_val.to(dtype), out_idx=out_idx)
    return Operand(**fields)


def _channel_ranges(x: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head, per-channel [lo, hi] [H, D] holding all but `fraction` of x's entries (as calibration would)."""
    sample = x[0].transpose(0, 1).reshape(-1, x.shape[1], x.shape[-1])[:4096].float()
    return torch.quantile(sample, fraction / 2, dim=0), torch.quantile(sample, 1 - fraction / 2, dim=0)


def layer_arguments(preset: str, batch: int, length: int, capacity: int, device, dtype, seed: int = 0) -> dict:
    """Named decode-attention arguments for one SmolLM2-shaped layer holding `length` tokens of a
    preset's format in a cache of `capacity` positions (random N(0, 1) keys and values)."""
    from kvq_ao import KVQuantConfig

    cfg = KVQuantConfig.preset(preset)
    spec = cfg.default
    g = torch.Generator(device="cpu").manual_seed(seed)
    key_group = spec.key.group_size if spec.key.axis == "channel" and not spec.key.calibrated_ranges else 1
    capacity = -(-capacity // key_group) * key_group
    k = torch.randn(batch, HKV, capacity, D, generator=g).to(device)
    v = torch.randn(batch, HKV, capacity, D, generator=g).to(device)
    scale_dtype = getattr(torch, cfg.scale_dtype)
    named = {"q": torch.randn(batch, HQ, 1, D, generator=g).to(device, dtype)}
    # the body holds whole key groups behind the window; the side store the sink and the rest
    window = max(cfg.residual_length, 1)
    body_end = max(cfg.sink_tokens, (length - window) // key_group * key_group)
    side_pos = list(range(cfg.sink_tokens)) + list(range(body_end, length))
    n_side = len(side_pos)
    named["k"] = _operand(k, torch.randn(batch, HKV, n_side, D, generator=g).to(device), spec.key, scale_dtype, dtype)
    named["v"] = _operand(v, torch.randn(batch, HKV, n_side, D, generator=g).to(device), spec.value, scale_dtype, dtype)
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
def check(args, device, dtype, emit) -> None:
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
            args = (x, format_ints(spec.bits, axis, spec.group_size), getattr(torch, cfg.scale_dtype), codebook, lo, hi, slots)
            got, want = torch.ops.kvq.triton_quantize(*args), reference.quantize(*args)
            fields = ("codes", "scale", "zero", "out_val", "out_idx", "clamped")
        differing += [f"{name}.{f}" for f, a, b in zip(fields, got, want) if not torch.equal(a, b)]
    return differing


def attention(args, device, dtype, gbs: float, nominal: float | None, emit) -> None:
    for n in [int(x) for x in args.lengths.split(",")]:
        g = torch.Generator(device="cpu").manual_seed(0)
        q = torch.randn(1, HQ, 1, D, generator=g).to(device, torch.bfloat16)
        k = torch.randn(1, HKV, n, D, generator=g).to(device, torch.bfloat16)
        v = torch.randn(1, HKV, n, D, generator=g).to(device, torch.bfloat16)
        with sdpa_context(device):
            once = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
            sdpa = median_ms(once, device, args.repeats)
        rows = [("sdpa-bf16", sdpa, k.nbytes + v.nbytes)]
        k = v = None
        for preset in args.presets.split(","):
            named = layer_arguments(preset, 1, n, n, device, dtype)
            ms = median_ms(lambda: torch.ops.kvq.triton_decode_attention(**op_args(named)), device, args.repeats)
            rows.append((preset, ms, bytes_read(named)))
            named = None
        for fmt, ms, nbytes in rows:
            achieved = nbytes / (ms / 1000) / 1e9
            emit(dict(section="attention", format=fmt, tokens=n, ms=ms, mib_read=nbytes / 2**20, gbs=achieved,
                      of_copy_bw=achieved / gbs, of_nominal_bw=achieved / nominal if nominal else None,
                      vs_sdpa=sdpa / ms))  # fmt: skip


def smollm2_shaped(layers: int, device, dtype):
    """A Llama model of SmolLM2-135M's shape (or fewer layers) with random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, max_position_embeddings=8192,
                      rope_theta=100000.0, tie_word_embeddings=True)  # fmt: skip
    return LlamaForCausalLM(cfg).to(device, dtype).eval()


def filled_cache(model, preset: str, n: int, steps: int, device, dtype):
    """A cache holding n random tokens in every layer (room for `steps` more)."""
    from transformers import DynamicCache

    from kvq_ao import KVQuantConfig, make_cache, quantize_kv_

    g = torch.Generator(device="cpu").manual_seed(0)
    if preset == "fp":
        cache = DynamicCache(config=model.config)
    else:
        quantize_kv_(model, KVQuantConfig.preset(preset))
        cache = make_cache(model, model.kvq_config, reserve=n + steps)
    chunk = 4096
    for i in range(model.config.num_hidden_layers):
        for s in range(0, n, chunk):
            size = min(chunk, n - s)
            k = torch.randn(1, HKV, size, D, generator=g).to(device, dtype)
            v = torch.randn(1, HKV, size, D, generator=g).to(device, dtype)
            if preset == "fp":
                cache.update(k, v, i)
            else:
                cache.layers[i].update(k, v)
    return cache


def step(args, device, dtype, emit) -> None:
    from kvq_ao.api import ATTN_NAME

    model = smollm2_shaped(args.layers, device, dtype)
    token = torch.tensor([[17]], device=device)
    for n in [int(x) for x in args.step_lengths.split(",")]:
        base = None
        for preset in ["fp", *args.step_presets.split(",")]:
            if preset == "fp" and model.config._attn_implementation == ATTN_NAME:
                model.set_attn_implementation(model._kvq_previous_attn)
            cache = filled_cache(model, preset, n, args.steps + 1, device, dtype)
            position = torch.tensor([[n]], device=device)
            once = timer(device)
            with torch.no_grad():
                model(token, cache=cache, position_ids=position)  # warm-up
                times = []
                for i in range(args.steps):
                    times.append(once(lambda: model(token, cache=cache, position_ids=position + 1 + i)))
            ms = statistics.median(times)
            base = ms if preset == "fp" else base
            emit(dict(section="step", format=preset, tokens=n, layers=args.layers, ms=ms,
                      vs_fp=base / ms if base else None))  # fmt: skip
            cache = None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU tensors in Triton's interpreter, tiny shapes (for CI)")
    p.add_argument("--presets", default="kivi-4,kivi-2,kvquant-3-1pct,kvquant-2-1pct")
    p.add_argument("--lengths", default="8192,32768,131072")
    p.add_argument("--step-lengths", default="8192,32768,131072")
    p.add_argument("--step-presets", default="kivi-4,kivi-2")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--check-length", type=int, default=4133)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--sections", default="check,attention,step")
    p.add_argument("--out", default="results/gpu.json")
    args = p.parse_args()
    from kvq_ao.kernels import gpu

    if args.dry_run:
        args.lengths, args.step_lengths, args.check_length = "400", "200", 300
        args.layers, args.steps, args.repeats = 2, 2, 2
        device, context, copy_mib = torch.device("cpu"), gpu.on_cpu(), 64
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run to check the script on CPU (Triton's interpreter)")
    else:
        if not gpu.load():
            raise SystemExit("triton is not installed: pip install 'kvq_ao[gpu]'")
        device, context, copy_mib = torch.device("cuda"), contextlib.nullcontext(), 2048
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    nominal = next((bw for key, bw in NOMINAL_GBS.items() if key in name), None)
    rows: list[dict] = []
    with context:
        gbs = copy_gbs(device, copy_mib)
        header = stamp(device=name, dry_run=args.dry_run, torch=torch.__version__, copy_gbs=gbs, nominal_gbs=nominal,
                       command=" ".join(["benchmarks/gpu.py", *sys.argv[1:]]))  # fmt: skip
        print(f"{name}: copy bandwidth {gbs:.0f} GB/s" + (f", nominal {nominal:.0f} GB/s" if nominal else ""), flush=True)

        def emit(row: dict) -> None:
            rows.append(row)
            print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
            save_json(args.out, {**header, "rows": rows})

        sections = args.sections.split(",")
        if "check" in sections:
            check(args, device, torch.bfloat16 if device.type == "cuda" else torch.float32, emit)
        if "attention" in sections:
            attention(args, device, torch.bfloat16 if device.type == "cuda" else torch.float32, gbs, nominal, emit)
        if "step" in sections:
            step(args, device, torch.bfloat16 if device.type == "cuda" else torch.float32, emit)
    save_json(args.out, {**header, "rows": rows})


if __name__ == "__main__":
    main()
