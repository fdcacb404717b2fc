"""`kvq`: evaluate, generate with, and demonstrate quantized KV caches from a shell.

    kvq calibrate --model smollm2                 (KVQuant presets' codebooks and thresholds)
    kvq eval --model smollm2 --preset kivi-4 --json
    kvq generate --model smollm2 --preset kivi-2 --prompt "Why is the sky blue?"
    kvq export --format executorch --preset kivi-4 --prompt "Hi!"
    kvq talk smollm2-kivi-4.pte --prompt "What is Python?"
    kvq presets
    kvq demo
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from kvq_ao.config import SIDE_DTYPES
from kvq_ao.demo import DEFAULT_BUDGET, DEFAULT_CONFIGS
from kvq_ao.export import EXECUTORCH_BACKENDS, KVQ_KERNELS
from kvq_ao.models import CALIBRATION_SAMPLES, CALIBRATION_SEQ_LEN
from kvq_ao.tuning.profile import TUNE_DTYPES


def _add_model_only_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="'smollm2' (packaged), a transformers folder, or a .gguf file")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """--model and --threads, plus the config to use (--preset or --config) and its calibration."""
    _add_model_only_args(p)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--preset", default=None, help="a preset name (see `kvq presets`)")
    group.add_argument("--config", default=None, help="a config JSON file (KVQuantConfig.save)")
    p.add_argument("--calibration", default=None, metavar="PATH",
                   help="calibration artifact (.json) for nuq/outlier configs; default: the model's in the user cache")


def _config(args, default: str = "kivi-4"):
    import dataclasses

    from kvq_ao.config import KVQuantConfig

    config = KVQuantConfig.load(args.config) if args.config else KVQuantConfig.preset(args.preset or default)
    if getattr(args, "calibration", None):
        config = dataclasses.replace(config, calibration=args.calibration)
    return config


def _log(msg: str) -> None:
    print(msg, file=sys.stderr)


def _load(args):
    import torch

    from kvq_ao.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    return load_model(args.model, log=_log)


def _eval_text(args) -> str:
    from kvq_ao.models import pydoc_text

    if args.text_file:
        try:
            return Path(args.text_file).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise SystemExit(f"kvq: {args.text_file} is not UTF-8 text ({e})") from None
    return pydoc_text("eval")


def cmd_eval(args) -> int:
    from kvq_ao.eval import evaluate, print_results
    from kvq_ao.models import text_windows

    config = _config(args)
    model, tokenizer = _load(args)
    windows = text_windows(tokenizer, _eval_text(args), args.windows, args.window_len)
    result = evaluate(model, windows, config, chunk=args.chunk, progress=not args.no_progress)
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        print_results([result])
    return 0


def cmd_calibrate(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvq_ao.calibration import calibrate, collect, default_path
    from kvq_ao.config import KVQuantConfig
    from kvq_ao.models import pydoc_text, text_windows

    if args.preset or args.config:
        configs = [_config(args)]
    else:
        configs = [KVQuantConfig.preset(n) for n in KVQuantConfig.preset_names() if KVQuantConfig.preset(n).needs_calibration]
    if args.out and len(configs) > 1:
        raise ValueError("--out needs a single --preset or --config")
    model, tokenizer = _load(args)
    text = Path(args.text_file).read_text(encoding="utf-8") if args.text_file else pydoc_text("calib")
    ids = text_windows(tokenizer, text, args.samples, args.seq_len)
    _log(f"calibrating {len(configs)} config(s) on {ids.numel()} tokens of {'your' if args.text_file else 'pydoc calibration'} text")
    activations = {}
    table = Table(title="calibrations written")
    for col in ("config", "codebooks", "threshold sets", "path"):
        table.add_column(col)
    for config in configs:
        if not config.needs_calibration:
            raise ValueError(f"config {config.name!r} uses no calibrated datatype or outliers: nothing to calibrate")
        if config.pre_rope_keys not in activations:
            activations[config.pre_rope_keys] = collect(model, ids, config.pre_rope_keys)
        calib = calibrate(model, None, config, activations=activations[config.pre_rope_keys],
                          fisher=not args.unweighted, use_qnorm=args.qnorm)  # fmt: skip
        path = calib.save(args.out or default_path(model, config))
        n_cb = sum(k.endswith(".codebook") for k in calib.tensors)
        n_th = sum(k.endswith(".lo") for k in calib.tensors)
        table.add_row(config.name, str(n_cb), str(n_th), str(path))
    Console(width=max(Console().width, 160)).print(table)
    return 0


def _widths(text: str) -> tuple[int, ...]:
    from kvq_ao.tuning.pareto import candidate_pairs

    try:
        widths = tuple(int(w) for w in text.split(","))
        candidate_pairs(widths)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--widths {text!r}: {e}") from None
    return widths


def cmd_tune(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvq_ao.calibration import Calibration
    from kvq_ao.models import pydoc_text, text_windows
    from kvq_ao.tuning.profile import base_config
    from kvq_ao.tuning.tuner import default_profile_path, summary_rows, tune, write_front

    model, tokenizer = _load(args)
    ids = text_windows(tokenizer, pydoc_text("calib"), args.samples, args.seq_len)
    base = base_config(residual_length=args.residual, group_size=args.group, dtype=args.dtype, pre_rope_keys=args.pre_rope,
                       side_dtype=args.side_dtype, metadata=args.metadata)  # fmt: skip
    profile_path = Path(args.profile) if args.profile else default_profile_path(model, base, ids)
    result = tune(model, ids, args.max_avg_bits, n_groups=args.groups, base=base, profile_path=profile_path,
                  trials=args.trials, log=_log, widths=args.widths)  # fmt: skip
    out = Path(args.out)
    config = dataclasses.replace(result.config, name=out.stem)  # tables and evals label it by its file
    if config.calibration:  # the calibration assembled for it, kept beside the config
        calib_path = Calibration.load(config.calibration).save(out.with_suffix(".calibration.json"))
        config = dataclasses.replace(config, calibration=str(calib_path))
    config.save(out)
    write_front(result, out.with_suffix(".pareto.csv"), out.with_suffix(".pareto.png"))
    console = Console(width=max(Console().width, 120))
    table = Table(title=f"{result.config.name}: {result.chosen.avg_bits:.2f} average bits, calibration KL {result.chosen.loss:.4g} "
                        f"measured, {result.predicted_loss(result.chosen.assignment):.4g} predicted (sum of layer KLs)")  # fmt: skip
    for col in ("layer", "group", "pair", "profiled KL (this layer alone)"):
        table.add_column(col)
    for row in summary_rows(result):
        table.add_row(*row)
    console.print(table)
    uniform = ", ".join(f"K{p[0]}V{p[1]} {loss:.4g}" for p, loss in result.uniform)
    console.print(f"uniform assignments' calibration KL: {uniform}")
    console.print(f"profile {result.profile_seconds:.0f} s ({profile_path}), search {result.search_seconds:.0f} s; "
                  f"wrote {out}, {out.with_suffix('.pareto.csv')}, {out.with_suffix('.pareto.png')}")  # fmt: skip
    return 0


def cmd_generate(args) -> int:
    import torch

    from kvq_ao.api import make_cache, quantize_kv_
    from kvq_ao.eval import greedy

    config = _config(args)
    model, tokenizer = _load(args)
    quantize_kv_(model, config)
    cache = make_cache(model, max_cache_len=args.static) if args.static else None
    with torch.no_grad():
        out = greedy(model, tokenizer, args.prompt, args.max_new_tokens, cache=cache)
    print(tokenizer.decode(out, skip_special_tokens=True))
    return 0


def cmd_presets(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvq_ao.config import KVQuantConfig
    from kvq_ao.memory import estimate

    table = Table(title=f"presets: bits per K/V element at {args.tokens} tokens (SmolLM2 shape, fp32 model)")
    for col in ("preset", "keys", "values", "sink", "fp window", "bits/element", "bytes/token"):
        table.add_column(col)
    for name in KVQuantConfig.preset_names():
        cfg = KVQuantConfig.preset(name)
        rep = estimate(cfg, 30, 3, 64, args.tokens)
        k, v = cfg.default.key, cfg.default.value
        def fmt(s):
            if not s.is_quantized:
                return "fp"
            extra = ("" if s.dtype == "int" else f" {s.dtype}") + (f" +{s.outliers:.0%} outliers" if s.outliers else "")
            extra += f" (<= {s.max_outliers} a vector)" if s.max_outliers else ""
            extra += " rotated" if s.rotated else ""
            grouping = "calibrated ranges" if s.calibrated_ranges else f"g{s.group_size}"
            return f"{s.bits}-bit {s.axis} {grouping}{extra}"

        rope = " (pre-RoPE keys)" if cfg.pre_rope_keys else ""
        keys, values = fmt(k), fmt(v)
        for span in cfg.depth_spans:  # per-layer specs by depth: say where they differ from the default
            where = f"; layers at depth [{span.start:g}, {span.end:g}): "
            keys += where + fmt(span.layer.key) if span.layer.key != k else ""
            values += where + fmt(span.layer.value) if span.layer.value != v else ""
        table.add_row(name + rope, keys, values, str(cfg.sink_tokens), str(cfg.residual_length),
                      f"{rep.bits_per_element:.2f}", f"{rep.bytes_per_token:.0f}")  # fmt: skip
    Console(width=max(Console().width, 120)).print(table)
    return 0


def _runner(path: Path):
    if path.suffix == ".pte":
        from kvq_ao.export.executorch import ExecuTorchRunner

        return ExecuTorchRunner(path)
    if path.suffix == ".onnx":
        from kvq_ao.export.onnx import OnnxRunner

        return OnnxRunner(path)
    raise ValueError(f"unknown artifact type {path.suffix!r}: expected .pte or .onnx")


def _talk(path: Path, tokenizer, prompt: str, max_new_tokens: int) -> None:
    from kvq_ao.eval import chat_ids

    runner = _runner(path)
    new, _ = runner.generate(chat_ids(tokenizer, prompt), max_new_tokens)
    print(f"[{path.name}] {tokenizer.decode(new, skip_special_tokens=True).strip()}")


def cmd_export(args) -> int:
    from kvq_ao.export import export_executorch, export_onnx

    config = _config(args)
    model, tokenizer = _load(args)
    out = Path(args.out or f"{Path(args.model).stem}-{config.name}.{'pte' if args.format == 'executorch' else 'onnx'}")
    _log(f"exporting {args.model} with {config.name} to {out} (max_seq_len={args.max_seq_len}) ...")
    if args.format == "executorch":
        result = export_executorch(model, config, out, max_seq_len=args.max_seq_len, backend=args.backend, kvq_kernels=args.kvq_kernels)
        _log(f"wrote {out} ({args.backend}, {result.kvq_kernels} kvq kernels): KV cache as {len(result.mutable_buffers)} "
             f"mutable buffers, {result.cache_bytes / 2**20:.2f} MiB")  # fmt: skip
    else:
        export_onnx(model, config, out, max_seq_len=args.max_seq_len)
        _log(f"wrote {out} (+ {out.with_suffix('.cache_init.npz').name}, the empty cache)")
    if args.prompt:
        _talk(out, tokenizer, args.prompt, args.max_new_tokens)
    return 0


def cmd_talk(args) -> int:
    import logging

    from transformers import AutoTokenizer

    if args.verbose:  # the runtime's own log lines (ExecuTorch writes them while loading)
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    from kvq_ao.models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model, log=_log))
    _talk(Path(args.artifact), tokenizer, args.prompt, args.max_new_tokens)
    return 0


def cmd_demo(args) -> int:
    from kvq_ao import demo

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    text = _eval_text(args) if args.text_file else None
    budget = None if args.budget <= 0 else args.budget
    demo.run(args.model, tuple(args.presets.split(",")), budget, args.windows, args.window_len, args.chunk, text,
             args.prompt, args.max_new_tokens, args.json_out)  # fmt: skip
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvq", description="Quantized KV caches for transformers models")
    sub = parser.add_subparsers(dest="command", required=True)

    def text_args(p, windows, window_len):
        p.add_argument("--text-file", default=None, help="evaluate this UTF-8 text instead of pydoc_data's")
        p.add_argument("--windows", type=int, default=windows, help="number of text windows")
        p.add_argument("--window-len", type=int, default=window_len, help="tokens per window (fresh cache each)")
        p.add_argument("--chunk", type=int, default=64, help="tokens per forward pass through the cache")

    p = sub.add_parser("eval", help="perplexity, KL and agreement vs the fp cache, plus memory")
    _add_model_args(p)
    text_args(p, 8, 1024)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("calibrate", help="fit codebooks and outlier thresholds (KVQuant) on calibration text")
    _add_model_args(p)
    p.add_argument("--out", default=None, help="artifact path (.json + .safetensors); default: the user cache")
    p.add_argument("--text-file", default=None, help="calibrate on this UTF-8 text instead of pydoc's calibration half")
    p.add_argument("--samples", type=int, default=CALIBRATION_SAMPLES, help="calibration sequences")
    p.add_argument("--seq-len", type=int, default=CALIBRATION_SEQ_LEN, help="tokens per calibration sequence")
    p.add_argument("--unweighted", action="store_true", help="plain k-means (no Fisher weights), for ablations")
    p.add_argument("--qnorm", action="store_true", help="Q-Norm: match the dequantized mean/std to the original")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("tune", help="KVTuner: per-layer (key, value) bits under an average-bit budget")
    _add_model_only_args(p)
    p.add_argument("--max-avg-bits", type=float, required=True, help="budget: mean of (key + value bits) / 2 over layers")
    p.add_argument("--out", default="tuned.json", help="the chosen config (.json); the Pareto CSV/PNG go beside it")
    p.add_argument("--groups", type=int, default=8, help="layer groups searched over")
    p.add_argument("--trials", type=int, default=96, help="NSGA-II trials when the reduced space is large")
    p.add_argument("--samples", type=int, default=2, help="calibration sequences")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration sequence")
    p.add_argument("--residual", type=int, default=128, help="full-precision window shared by all layers (KIVI's)")
    p.add_argument("--group", type=int, default=32, help="quantization group size")
    p.add_argument("--dtype", choices=list(TUNE_DTYPES), default="int",
                   help="datatype of the 2- and 4-bit candidates (nf: KVQuant's NormalFloat levels; 8-bit ones stay int); "
                        "kvquant: the kvquant-B-1pct presets' datatypes and layout at every width (calibrated levels, "
                        "key ranges and outliers; each width calibrated once; --residual/--group/--pre-rope unused); "
                        "rot: the rotated presets' (rot-k4v3's layout: rotated per-vector keys and values, calibrated levels, "
                        "1-token sink, 112-token float16 window; the same arguments unused)")
    p.add_argument("--metadata", choices=("float", "8-bit"), default="float",
                   help="8-bit: one byte for each scale and zero of a per-token group (the values; rot's keys too), "
                        "half of float16's (QuantSpec.metadata)")
    p.add_argument("--pre-rope", action="store_true", help="store keys before RoPE (KVQuant), rotated inside attention")
    p.add_argument("--side-dtype", choices=SIDE_DTYPES, default="model",
                   help="dtype of the full-precision window (16 bits halves its memory in a float32 model)")
    p.add_argument("--widths", type=_widths, default=(2, 4, 8), metavar="W,W,...",
                   help="bit widths the (key, value) candidate pairs are drawn from: KVTuner's 2,4,8 by default; "
                        "any of 2,3,4,8 (a saved profile is extended with the pairs it lacks)")
    p.add_argument("--profile", default=None, help="layer profile cache (.json); default: the user cache")
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("generate", help="greedy generation with the quantized cache")
    _add_model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--static", type=int, default=None, metavar="MAX_LEN", help="use a static cache of this length")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("export", help="export a one-token decode step with the quantized cache")
    _add_model_args(p)
    p.add_argument("--format", choices=["executorch", "onnx"], required=True)
    p.add_argument("--out", default=None, help="output path (.pte or .onnx)")
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--backend", choices=EXECUTORCH_BACKENDS, default=EXECUTORCH_BACKENDS[0],
                   help="ExecuTorch only: linear layers on XNNPACK (fast) or every op on the portable kernels")  # fmt: skip
    p.add_argument("--kvq-kernels", choices=KVQ_KERNELS, default="auto",
                   help="ExecuTorch only: decode attention in the kvq kernel library (native C++, built on first use), "
                        "decomposed into portable ops (runs anywhere, slowly), or native where it builds (auto)")  # fmt: skip
    p.add_argument("--prompt", default=None, help="after exporting, generate an answer with the artifact")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("talk", help="generate with an exported .pte (ExecuTorch) or .onnx (onnxruntime)")
    p.add_argument("artifact")
    p.add_argument("--model", default="smollm2", help="where the tokenizer comes from")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--verbose", action="store_true", help="also print the runtime's own log lines")
    p.set_defaults(func=cmd_talk)

    p = sub.add_parser("presets", help="list presets and their memory")
    p.add_argument("--tokens", type=int, default=4096)
    p.set_defaults(func=cmd_presets)

    p = sub.add_parser("demo", help="KIVI, KVQuant and KVTuner side by side: quality, memory and an answer each")
    _add_model_only_args(p)
    text_args(p, 4, 1024)
    p.add_argument("--presets", default=",".join(DEFAULT_CONFIGS), help="presets evaluated beside the tuned config")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                   help="KVTuner budget (average bits) of the tuned config; 0 leaves it out")
    p.add_argument("--prompt", default=None)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--json-out", default=None, help="also write the results as JSON")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import kvq_ao._torchao  # noqa: F401  (imports torchao quietly before transformers would, loudly)

    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvq: error: {e}", file=sys.stderr)
        return 2


__all__ = ["build_parser", "main"]


if __name__ == "__main__":
    raise SystemExit(main())
