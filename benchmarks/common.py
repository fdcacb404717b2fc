"""What the benchmarks share: the real model, its held-out text, and how results are written.

Run every benchmark from the repository root (`python benchmarks/<name>.py`); each writes its
raw rows under results/ with the date and the machine, and prints the table the docs quote.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import platform
from datetime import date
from pathlib import Path

import torch


def preset_config(name: str):
    """A preset by name, or "<preset>/<scores>": the preset with every layer's keys scored as
    `scores` ("float", "int8", "int16"; `QuantSpec.scores`), to time or judge one scoring against another;
    or "<preset>/nf": its calibrated levels ("nuq") replaced by NormalFloat ones, the same kernel
    path with no calibration (to time a layout on a model nothing was calibrated for)."""
    import dataclasses

    from kvq_ao import KVQuantConfig

    preset, _, scores = name.partition("/")
    cfg = KVQuantConfig.preset(preset)
    if not scores:
        return cfg
    if scores == "nf":
        nf = lambda s: dataclasses.replace(s, dtype="nf") if s.dtype == "nuq" else s  # noqa: E731
        layer = lambda kv: dataclasses.replace(kv, key=nf(kv.key), value=nf(kv.value))  # noqa: E731
        cfg = dataclasses.replace(cfg, calibration=None)
    else:
        layer = lambda kv: dataclasses.replace(kv, key=dataclasses.replace(kv.key, scores=scores))  # noqa: E731
    spans = tuple(dataclasses.replace(span, layer=layer(span.layer)) for span in cfg.depth_spans)
    return dataclasses.replace(cfg, default=layer(cfg.default), layers=tuple(map(layer, cfg.layers)), depth_spans=spans, name=name)


def smollm2(threads: int):
    """(SmolLM2-135M-Instruct in float32, its tokenizer), with torch using `threads` threads."""
    from kvq_ao.models import load_model

    torch.set_num_threads(threads)
    return load_model("smollm2")


def eval_windows(tokenizer, windows: int, window_len: int) -> torch.Tensor:
    """[windows, window_len] token ids of the held-out (evaluation) half of pydoc_data's text."""
    from kvq_ao.models import pydoc_text, text_windows

    return text_windows(tokenizer, pydoc_text("eval"), windows, window_len)


def machine() -> str:
    """'<CPU model>, <n> cores' (what the docs' measurement records name)."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def stamp(**fields) -> dict:
    """The header of a results file: today's date, the machine, and `fields`."""
    return dict(date=str(date.today()), machine=machine(), **fields)


def save_json(path: str | Path, payload) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def status_mib(field: str) -> float:
    """A memory field of /proc/self/status (VmRSS: resident now, VmHWM: peak) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status: peak memory needs Linux")


def reset_peak() -> float:
    """Return freed heap to the OS and restart the kernel's high-water mark; the resident MiB now."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return status_mib("VmRSS")
