"""Native CPU kernels of the kvq ops, built from C++ on first use.

`decode_attention.cpp` implements `kvq::decode_attention` for the CPU dispatch key: one query
token attending straight from the packed cache, vectorized and parallel over token chunks with a
split-softmax merge. `quantize_fixed.cpp` implements `kvq::quantize_fixed`, the one-token key append
of calibrated key ranges, in one pass per vector (its reference is a dozen ATen ops per call);
`quantize.cpp` implements `kvq::quantize`, the append of every other quantized format (ranges per
group, codebooks, outliers by either rule), likewise. `load()` compiles it with torch's C++ extension tools (g++ and ninja,
`-O3 -march=native`, OpenMP as ATen uses it) into the user cache, keyed by the sources, torch's
version, the compiler flags and this CPU, so it is built once per machine (~30-60 s) and loaded
in milliseconds afterwards. Once loaded, every CPU call of these ops runs them: eager calls, and
compiled graphs for decode attention (its decomposition then declines); compiled graphs fuse the
two writers' reference code instead (`kvq_ao.ops.decompositions`).

Without a working compiler, `load()` warns once and the reference kernels serve CPU as well
(correct, several times slower at long contexts). `KVQ_AO_NATIVE=0` turns the native kernels off.
"""

from __future__ import annotations

import hashlib
import os
import platform
import warnings
from pathlib import Path

import torch

SOURCES = ("decode_attention.cpp", "quantize_fixed.cpp", "quantize.cpp")
HEADERS = ("attention_core.h", "quantize_core.h")  # the arithmetic, free of ATen (shared with ExecuTorch and the portable runner)
GENERATED_HEADER = "kvq_format.h"  # operand field indices and format constants, from kvq_ao/format.py
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno")
_state: dict = {"loaded": False, "failed": None}


def enabled() -> bool:
    """False when the user turned the native kernels off with KVQ_AO_NATIVE=0."""
    return os.environ.get("KVQ_AO_NATIVE", "1") not in ("0", "false", "no", "off")


def is_loaded() -> bool:
    """Whether the native CPU kernels are registered in this process."""
    return _state["loaded"]


def _cpu_identity() -> str:
    """The CPU model and feature flags (-march=native code runs only where they match)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [line for line in lines if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return "\n".join(sorted(set(keep)))
    except OSError:
        return platform.processor() or platform.machine()


def generated_header() -> str:
    """The C++ header generated from the operand definition (`kvq_ao.format.c_header`)."""
    from kvq_ao.format import c_header

    return c_header()


def write_generated_header(directory: Path) -> None:
    """Write `GENERATED_HEADER` into a build directory (its include path)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / GENERATED_HEADER).write_text(generated_header())


def build_key() -> str:
    """What the built library depends on: its sources, the generated header, torch, the flags and the CPU."""
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update((Path(__file__).parent / name).read_bytes())
    digest.update(generated_header().encode())
    digest.update(" ".join((torch.__version__, *CFLAGS, _cpu_identity())).encode())
    return digest.hexdigest()[:16]


def build_directory() -> Path:
    from kvq_ao.models import cache_dir

    return cache_dir() / "kernels" / f"cpu-{build_key()}"


def load(build: bool = True, verbose: bool = False) -> bool:
    """Register the native CPU kernels; returns whether they are in use.

    Loads the library built earlier on this machine, or (with `build`) compiles it first. A
    failed build warns once, naming the cause, and leaves the reference kernels in place.
    """
    if _state["loaded"]:
        return True
    if not enabled() or _state["failed"] is not None:
        return False
    import kvq_ao.ops  # noqa: F401  (defines the ops this library implements)

    directory = build_directory()
    built = sorted(directory.glob("kvq_cpu*.so")) if directory.exists() else []
    try:
        if built:
            torch.ops.load_library(str(built[0]))
        elif build:
            _compile(directory, verbose)
        else:
            return False
    except Exception as error:  # a compiler missing or failing must not stop inference
        _state["failed"] = error
        warnings.warn(
            f"kvq_ao: could not build the native CPU kernels ({type(error).__name__}: {str(error).strip()[:400]}); "
            "decode attention runs the reference kernels instead, several times slower at long contexts. "
            "Install g++ and ninja (and Python headers) to get them, or set KVQ_AO_NATIVE=0 to silence this.",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    _state["loaded"] = True
    return True


def _compile(directory: Path, verbose: bool) -> None:
    import sys

    from torch.utils import cpp_extension

    write_generated_header(directory)
    print(f"kvq_ao: building the native CPU kernels once for this machine into {directory} ...", file=sys.stderr, flush=True)
    cpp_extension.load(
        name="kvq_cpu",
        sources=[str(Path(__file__).parent / name) for name in SOURCES],
        extra_cflags=list(CFLAGS),
        extra_include_paths=[str(directory)],
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=False,
        verbose=verbose,
    )


__all__ = ["GENERATED_HEADER", "build_directory", "build_key", "generated_header", "write_generated_header", "enabled", "is_loaded", "load", "SOURCES"]
