"""The kvq kernel library for the ExecuTorch runtime, built from the same C++ as the PyTorch op.

`executorch_ops.cpp` registers `kvq::decode_attention.out`, `kvq::quantize.out` and
`kvq::quantize_fixed.out` in ExecuTorch's kernel registry; the arithmetic is `attention_core.h` and
`quantize_core.h`, which the PyTorch CPU ops (`decode_attention.cpp`, `quantize.cpp`,
`quantize_fixed.cpp`) also run. A `.pte` exported with native kvq kernels
calls those ops, so the library must be loaded into the
process before the program's method is loaded: `ExecuTorchRunner` does it, others call `load()`.

It is compiled with g++ against the headers and `libexecutorch.so` that the executorch wheel
ships (the runtime's one kernel registry lives there), once per machine and executorch version,
into the user cache (~5 s). A library built for another executorch version must not be loaded
(the registry's layout may differ), hence the version in the cache key.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from kvq_ao.kernels.cpu import CFLAGS, HEADERS, _cpu_identity, enabled, generated_header, write_generated_header

SOURCE = "executorch_ops.cpp"
LIBRARY = "libkvq_executorch.so"
OP = "kvq::decode_attention.out"
_state: dict = {"loaded": None, "failed": None}


class KernelLibraryError(RuntimeError):
    """The kvq ExecuTorch kernel library cannot be built or loaded here."""


def _executorch_root() -> Path:
    import executorch

    return Path(next(iter(executorch.__path__)))


def _executorch_version() -> str:
    from importlib.metadata import version

    return version("executorch")


def build_key() -> str:
    """Sources, executorch version, flags and CPU: what the built library depends on."""
    digest = hashlib.sha256()
    here = Path(__file__).parent
    for name in (SOURCE, *HEADERS):
        digest.update((here / name).read_bytes())
    digest.update(generated_header().encode())
    digest.update(" ".join((_executorch_version(), *CFLAGS, _cpu_identity())).encode())
    return digest.hexdigest()[:16]


def library_path() -> Path:
    from kvq_ao.models import cache_dir

    return cache_dir() / "kernels" / f"executorch-{build_key()}" / LIBRARY


def build(verbose: bool = False) -> Path:
    """The library's path, compiling it first if this machine has not yet (KernelLibraryError if it cannot)."""
    path = library_path()
    if path.exists():
        return path
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise KernelLibraryError("no C++ compiler (g++) on PATH to build the kvq ExecuTorch kernel library")
    root = _executorch_root()
    include, lib = root / "include", root / "lib"
    if not (include / "executorch" / "runtime" / "kernel" / "operator_registry.h").exists() or not (lib / "libexecutorch.so").exists():
        raise KernelLibraryError(f"the executorch wheel at {root} ships no kernel headers or libexecutorch.so (needed to build custom kernels)")
    write_generated_header(path.parent)
    partial = path.with_name(f"{LIBRARY}.{os.getpid()}.partial")  # one per builder: concurrent builds do not clobber
    command = [
        compiler, *CFLAGS, "-std=c++17", "-fPIC", "-shared",
        f"-I{include}", f"-I{include / 'executorch/runtime/core/portable_type/c10'}", f"-I{path.parent}",
        "-DC10_USING_CUSTOM_GENERATED_MACROS", "-DET_EVENT_TRACER_ENABLED",
        str(Path(__file__).parent / SOURCE), f"-L{lib}", "-lexecutorch", f"-Wl,-rpath,{lib}", "-o", str(partial),
    ]  # fmt: skip
    print(f"kvq_ao: building the kvq ExecuTorch kernel library once for this machine into {path.parent} ...", file=sys.stderr, flush=True)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if verbose or done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
    if done.returncode != 0:
        raise KernelLibraryError(f"g++ failed to build the kvq ExecuTorch kernel library: {done.stderr.strip()[-600:]}")
    partial.replace(path)  # atomic: a concurrent loader sees the whole library or none
    return path


def load(build_if_missing: bool = True) -> bool:
    """Register kvq's kernels with the ExecuTorch runtime of this process; whether they are in.

    Loading twice is a no-op. A failure is remembered (see `failure()`), not raised: callers
    choose between the portable export and a clear error.
    """
    if _state["loaded"] is not None:
        return True
    if _state["failed"] is not None:
        return False
    if not enabled():
        _state["failed"] = KernelLibraryError("native kernels are turned off (KVQ_AO_NATIVE=0)")
        return False
    try:
        path = build() if build_if_missing else library_path()
        if not path.exists():
            return False
        import executorch.runtime  # noqa: F401  (libexecutorch.so first: the library registers into it)

        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except (KernelLibraryError, OSError, ImportError) as error:
        _state["failed"] = error
        return False
    _state["loaded"] = path
    return True


def is_loaded() -> bool:
    return _state["loaded"] is not None


def failure() -> Exception | None:
    """Why the library could not be built or loaded in this process (None if it was not tried or it worked)."""
    return _state["failed"]


__all__ = ["KernelLibraryError", "OP", "build", "build_key", "failure", "is_loaded", "library_path", "load"]
