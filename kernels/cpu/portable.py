"""The decode kernel's C++ built for other CPUs than this one, and run on conformance cases.

The PyTorch extension (`kvq_ao.kernels.cpu`) and the ExecuTorch kernel library are built on the
user's machine with `-march=native`, so on a developer's x86 box only its AVX path is ever run.
This module builds the same arithmetic (attention_core.h, quantize_core.h) into a standalone runner
(conformance_main.cpp, no ATen, no ExecuTorch) for

* `generic`: this machine's compiler with no `-march` (x86-64's baseline: none of the AVX paths,
  the GCC vector extensions lowered to SSE2), run natively: the fallback any other CPU gets;
* `avx2`: `-march=x86-64-v3`, the AVX2 + FMA paths (a Zen 3's build), run natively on a CPU that
  has them (an AVX-512 machine's own build never runs them);
* `aarch64`: Debian's cross compiler (`aarch64-linux-gnu-g++`, ARMv8.2-A with the dot-product
  extension, NEON), statically linked and run under `qemu-aarch64` (correctness, not speed);

and writes the conformance cases for it (`write_case`, `write_quantize_case`) and reads back its
outputs. tests/kernels/test_portable_builds.py runs the conformance suite's decode cases and
quantize_fixed cases through both. `compile_only` cross-compiles the PyTorch extension and ExecuTorch library
sources to objects (their aarch64 runtimes are not on an x86 machine, so nothing is linked).
"""

from __future__ import annotations

import platform
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from kvq_ao.format import format_of
from kvq_ao.kernels.cpu import GENERATED_HEADER, HEADERS, generated_header

HERE = Path(__file__).parent
RUNNER_SOURCE = "conformance_main.cpp"
CASE_VERSION = 1
_DTYPE_CODES = {torch.uint8: 0, torch.int64: 4, torch.float16: 5, torch.float32: 6, torch.float64: 7, torch.bool: 11,
                torch.bfloat16: 15}  # fmt: skip  (c10's ScalarType numbering, which ExecuTorch shares)


@dataclass(frozen=True)
class Target:
    name: str
    compiler: str
    flags: tuple[str, ...]
    emulator: tuple[str, ...] = ()  # how to run its binaries here (empty: natively)
    package_hint: str = ""
    cpu_flags: tuple[str, ...] = ()  # what this machine's CPU must have to run its binaries natively

    def unavailable(self) -> str | None:
        """Why this target cannot be built and run here, or None."""
        lacking = [f for f in self.cpu_flags if f not in _cpu_flags()]
        if lacking:
            return f"this CPU lacks {', '.join(lacking)}"
        missing = [tool for tool in (self.compiler, *self.emulator[:1]) if shutil.which(tool) is None]
        if missing:
            return f"{' and '.join(missing)} not on PATH{f' (Debian: apt-get install {self.package_hint})' if self.package_hint else ''}"
        return None


COMMON_FLAGS = ("-O2", "-std=c++17", "-fno-math-errno")
# This machine's baseline: x86-64 without AVX on x86; elsewhere the compiler's default target.
BASELINE = ("-march=x86-64", "-mtune=generic") if platform.machine() in ("x86_64", "AMD64") else ()


def _cpu_flags() -> set[str]:
    """The feature flags /proc/cpuinfo lists for this CPU (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


TARGETS = {
    "generic": Target("generic", "g++", (*COMMON_FLAGS, *BASELINE)),
    # x86-64-v3 (AVX2, FMA, F16C, BMI2): the 8-lane AVX2 paths an AVX-512 machine's own build never
    # runs, built and run natively where the CPU has them
    "avx2": Target("avx2", "g++", (*COMMON_FLAGS, "-march=x86-64-v3"), cpu_flags=("avx2", "fma", "f16c", "bmi2", "movbe")),
    "aarch64": Target("aarch64", "aarch64-linux-gnu-g++", (*COMMON_FLAGS, "-march=armv8.2-a+dotprod", "-static"),
                      ("qemu-aarch64",), "g++-aarch64-linux-gnu qemu-user"),
}


def build_runner(target: Target, directory: Path, header_dir: Path = HERE) -> Path:
    """Compile the conformance runner for `target` into `directory` (the headers from `header_dir`,
    so a test can build a deliberately broken copy; headers it lacks are copied in); returns the binary."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / GENERATED_HEADER).write_text(generated_header())
    binary = directory / f"kvq_conformance-{target.name}"
    source = Path(header_dir) / RUNNER_SOURCE  # beside its headers: `#include "..."` looks there first
    for name in (RUNNER_SOURCE, *HEADERS):  # what the caller did not replace
        if not (Path(header_dir) / name).exists():
            shutil.copyfile(HERE / name, Path(header_dir) / name)
    command = [target.compiler, *target.flags, f"-I{directory}", str(source), "-o", str(binary)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{target.name}: {' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return binary


def run(target: Target, binary: Path, pairs: list[tuple[Path, Path]]) -> None:
    """Run the runner on (case, output) file pairs, under the target's emulator if it has one."""
    command = [*target.emulator, str(binary), *(str(p) for pair in pairs for p in pair)]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{target.name}: the runner failed ({done.returncode}): {done.stderr.strip()[-2000:]}")


def _tensor(t: torch.Tensor | None) -> bytes:
    if t is None:
        return struct.pack("<i", 0)
    if t.dtype not in _DTYPE_CODES:
        raise ValueError(f"the case format has no dtype {t.dtype}")
    t = t.contiguous()
    head = struct.pack(f"<iii{t.dim()}q", 1, _DTYPE_CODES[t.dtype], t.dim(), *t.shape)
    if t.numel() == 0:
        return head
    raw = t.to(torch.uint8) if t.dtype == torch.bool else t.reshape(-1).view(torch.uint8)
    return head + raw.numpy().tobytes()


def write_case(args: dict, path: Path, tasks: int = 3) -> None:
    """The decode op's named arguments (`kvq_ao.ops.attention_arguments` form) as a case file; q is
    passed as float32, as the PyTorch and ExecuTorch layers pass it to the kernel."""
    out = [b"KVQC", struct.pack("<i", CASE_VERSION), _tensor(args["q"].float())]
    for side in ("k", "v"):
        out += [struct.pack("<i", len(args[side])), *(_tensor(t) for t in args[side])]
        ints = args[f"{side}_format"]
        out.append(struct.pack(f"<i{len(ints)}q", len(ints), *ints))
    out += [_tensor(args["side_pos"]), _tensor(args["body_end"]), _tensor(args["mask"]), _tensor(args["rope_inv_freq"])]
    out.append(struct.pack("<qdddi", args["body_start"], args["scaling"], args["rope_scale"], args["softcap"], tasks))
    path.write_bytes(b"".join(out))


def write_quantize_case(x: torch.Tensor, bits: int, zero: torch.Tensor, scale: torch.Tensor, codebook: torch.Tensor,
                        lo: torch.Tensor, hi: torch.Tensor, n_outliers: int, path: Path) -> None:
    """`kvq.quantize_fixed`'s arguments (float32 x) as a case file. The codebook goes as its
    midpoints, computed as the PyTorch layer computes them (float32)."""
    if x.dtype != torch.float32:
        raise ValueError(f"the portable runner codes float32 keys, got {x.dtype}")
    cb = codebook.float()
    mids = (cb[1:] + cb[:-1]) * 0.5 if cb.numel() else torch.zeros(0)
    parts = [b"KVQF", struct.pack("<i", CASE_VERSION), _tensor(x), struct.pack("<q", bits)]
    parts += [_tensor(t.float().contiguous()) for t in (zero, scale, mids, lo, hi)]
    parts.append(struct.pack("<q", n_outliers))
    path.write_bytes(b"".join(parts))


def _read_blobs(path: Path, count: int) -> tuple[int, list[bytearray]]:
    """An append output file: (int64 clamped, the `count` blobs that follow, each int64 size + data)."""
    data = path.read_bytes()
    (clamped,) = struct.unpack_from("<q", data)
    blobs, at = [], 8
    for _ in range(count):
        (size,) = struct.unpack_from("<q", data, at)
        blobs.append(bytearray(data[at + 8 : at + 8 + size]))
        at += 8 + size
    return clamped, blobs


def read_quantize_output(path: Path, x_shape, n_outliers: int) -> tuple:
    """(codes, out_val, out_idx, clamped) as the op returns them, from the runner's output file."""
    clamped, blobs = _read_blobs(path, 3)
    rows = list(x_shape[:-1])
    codes = torch.frombuffer(blobs[0], dtype=torch.uint8).reshape(*rows, -1) if blobs[0] else torch.zeros(*rows, 0, dtype=torch.uint8)
    out_val = torch.frombuffer(blobs[1], dtype=torch.float32).reshape(*rows, n_outliers) if blobs[1] else torch.zeros(*rows, 0)
    out_idx = torch.frombuffer(blobs[2], dtype=torch.uint8).reshape(*rows, n_outliers) if blobs[2] else torch.zeros(*rows, 0, dtype=torch.uint8)
    return codes, out_val, out_idx, torch.tensor(clamped)


SCALE_TYPES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}  # quantize_core.h's ScaleType


def write_groups_case(x: torch.Tensor, format: list[int], scale_dtype: torch.dtype, codebook: torch.Tensor, lo: torch.Tensor,
                      hi: torch.Tensor, n_outliers: int, path: Path) -> None:  # fmt: skip
    """`kvq.quantize`'s arguments (float32 x [B, H, T, D]) as a case file; the codebook as its
    float32 midpoints, lo/hi empty for per-vector outliers."""
    if x.dtype != torch.float32 or x.dim() != 4:
        raise ValueError(f"the portable runner codes float32 x [B, H, T, D], got {x.dtype} {list(x.shape)}")
    cb = codebook.float()
    mids = (cb[1:] + cb[:-1]) * 0.5 if cb.numel() else torch.zeros(0)
    bits, axis, group, _, meta = format_of(format)  # how keys are scored is not the quantizer's concern
    parts = [b"KVQG", struct.pack("<i", CASE_VERSION), _tensor(x), struct.pack("<5q", bits, axis, group, SCALE_TYPES[scale_dtype], meta)]
    parts += [_tensor(t.float().contiguous()) for t in (mids, lo, hi)]
    parts.append(struct.pack("<q", n_outliers))
    path.write_bytes(b"".join(parts))


def read_groups_output(path: Path, x_shape, meta_shape, scale_dtype: torch.dtype, n_outliers: int) -> tuple:
    """(codes, scale, zero, out_val, out_idx, clamped) as `kvq.quantize` returns them, from the runner's
    output (scale_dtype: what scale and zero are stored in, torch.uint8 for 8-bit metadata)."""
    clamped, blobs = _read_blobs(path, 5)
    rows = list(x_shape[:-1])

    def tensor(blob: bytearray, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        return torch.frombuffer(blob, dtype=dtype).reshape(shape) if blob else torch.zeros(shape, dtype=dtype)

    return (tensor(blobs[0], torch.uint8, [*rows, -1] if blobs[0] else [*rows, 0]), tensor(blobs[1], scale_dtype, meta_shape),
            tensor(blobs[2], scale_dtype, meta_shape), tensor(blobs[3], torch.float32, [*rows, n_outliers]),
            tensor(blobs[4], torch.uint8, [*rows, n_outliers]), torch.tensor(clamped))  # fmt: skip


def read_output(path: Path, shape) -> torch.Tensor:
    """The runner's float32 output, in the op's output shape."""
    data = path.read_bytes()
    (count,) = struct.unpack_from("<q", data)
    out = torch.frombuffer(bytearray(data[8:]), dtype=torch.float32)
    if out.numel() != count:
        raise ValueError(f"{path}: {out.numel()} floats, the header says {count}")
    return out.reshape(shape)


def compile_only(target: Target, directory: Path) -> list[Path]:
    """Compile the PyTorch extension's and the ExecuTorch library's sources for `target` to object
    files (no link: their runtimes for that CPU are not here). Returns the objects."""
    from torch.utils import cpp_extension

    from kvq_ao.kernels.cpu import SOURCES, executorch_library

    directory.mkdir(parents=True, exist_ok=True)
    (directory / GENERATED_HEADER).write_text(generated_header())
    flags = [f for f in target.flags if f != "-static"]
    python_include = Path(sys.base_prefix) / "include" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    torch_includes = [f"-I{p}" for p in (*cpp_extension.include_paths(), str(python_include))]
    et_root = executorch_library._executorch_root() / "include"
    jobs = [(name, [*torch_includes, "-DTORCH_EXTENSION_NAME=kvq_cpu", "-D_GLIBCXX_USE_CXX11_ABI=1", "-fopenmp"])
            for name in SOURCES]  # fmt: skip
    jobs.append((executorch_library.SOURCE, [f"-I{et_root}", f"-I{et_root / 'executorch/runtime/core/portable_type/c10'}",
                                             "-DC10_USING_CUSTOM_GENERATED_MACROS", "-fopenmp"]))  # fmt: skip
    objects = []
    for name, extra in jobs:
        obj = directory / f"{Path(name).stem}-{target.name}.o"
        command = [target.compiler, *flags, "-fPIC", "-c", *extra, f"-I{HERE}", f"-I{directory}", str(HERE / name), "-o", str(obj)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{target.name}: compiling {name} failed:\n{done.stderr[-3000:]}")
        objects.append(obj)
    return objects


__all__ = ["TARGETS", "Target", "build_runner", "compile_only", "read_groups_output", "read_output", "read_quantize_output", "run",
           "write_case", "write_groups_case", "write_quantize_case"]
