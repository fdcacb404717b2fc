"""Ahead-of-time compile of the Triton kernels for real NVIDIA GPUs, on a machine without one.

Triton's interpreter, which runs the kernels on CPU tensors in the tests, accepts code the GPU
compiler refuses: a plain module global inside `@triton.jit` once reached an H200 that way, and
every append to a CUDA cache failed there. `triton.compile` with a `GPUTarget` needs no GPU: it
lowers a kernel to PTX and assembles it with triton's bundled ptxas, whose `-v` report gives the
registers, spills and stack a kernel takes on that architecture.

`recorded_launches()` collects the launches the kvq Triton ops make while they run (or, with
`run=False`, instead of running them) as `Launch`es, each a kernel and one specialization of it
(argument types and compile-time constants); `compile_launch(launch, capability)` compiles one for
sm_<capability> and returns what ptxas reports.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


_POINTER = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.uint8: "u8", torch.int8: "i8",
            torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}  # fmt: skip


@dataclass(frozen=True)
class Launch:
    """One specialization of one kernel: what `triton.compile` needs to build it."""

    module: str
    kernel: str
    signature: tuple[tuple[str, str], ...]  # (argument, triton type or "constexpr"), in order
    constexprs: tuple[tuple[str, object], ...]
    aligned: tuple[str, ...] = ()  # arguments the JIT would specialize as divisible by 16 (pointers, ints)
    options: tuple[tuple[str, object], ...] = ()  # launch options (num_warps, num_stages)

    def label(self) -> str:
        consts = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in self.constexprs)
        pointers = ",".join(t[1:] for _, t in self.signature if t.startswith("*"))
        opts = "".join(f",{k}={v}" for k, v in self.options)
        return f"{self.kernel}[{consts}{opts}|{pointers}]"

    def function(self) -> triton.runtime.jit.JITFunction:
        return getattr(importlib.import_module(self.module), self.kernel)


def _type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _POINTER[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for a launch argument of type {type(value).__name__}")


LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def _aligned(value) -> bool:
    """What Triton's JIT specializes as divisible by 16 (and then vectorizes on): a tensor whose
    address is, an int that is."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def launch_of(fn: triton.runtime.jit.JITFunction, module: str, args: tuple, kwargs: dict) -> Launch:
    """The specialization a call `fn[grid](*args, **kwargs)` asks for, with the divisibility the
    JIT would see (the ahead-of-time compile then vectorizes what a GPU's JIT compile would)."""
    options = tuple((k, kwargs[k]) for k in LAUNCH_OPTIONS if k in kwargs)
    values = dict(zip(fn.arg_names, args)) | {k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS}
    signature, constexprs, aligned = [], [], []
    for param in fn.params:
        if param.is_constexpr:
            value = values[param.name] if param.name in values else param.default
            signature.append((param.name, "constexpr"))
            constexprs.append((param.name, value))
        else:
            signature.append((param.name, _type(values[param.name])))
            if _aligned(values[param.name]):
                aligned.append(param.name)
    return Launch(module, fn.__name__, tuple(signature), tuple(constexprs), tuple(aligned), options)


@contextlib.contextmanager
def recorded_launches(run: bool = True):
    """Within the block, every launch the kvq Triton ops make is appended to the yielded list
    (and still runs, in the interpreter for CPU tensors, unless `run` is False)."""
    from kvq_ao.kernels.gpu import triton_ops  # (here: compiling with another triton needs no torch.library op)

    launches: list[Launch] = []
    real = triton_ops._launcher

    def recording(module, name, like):
        kernel = real(module, name, like)
        fn = getattr(module, name)

        class Grid:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    launches.append(launch_of(fn, module.__name__, args, kwargs))
                    if run:
                        kernel[grid](*args, **kwargs)

                return launch

        return Grid()

    triton_ops._launcher = recording
    try:
        yield launches
    finally:
        triton_ops._launcher = real


@dataclass(frozen=True)
class KernelReport:
    """What ptxas says of one compiled kernel."""

    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack: int  # bytes of stack frame
    shared: int  # bytes of shared memory (triton's metadata)


def _ptxas() -> str:
    """triton's bundled ptxas that reads the PTX version this triton emits (the newest one shipped)."""
    folder = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in ("ptxas-blackwell", "ptxas"):
        if (folder / name).is_file():
            return str(folder / name)
    raise FileNotFoundError(f"no ptxas in {folder}")


def compiled(launch: Launch, capability: int):
    """`launch` compiled by triton for sm_<capability> (its `.asm["ptx"]`, `.metadata`)."""
    fn = launch.function()
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in launch.aligned}
    source = ASTSource(fn, dict(launch.signature), dict(launch.constexprs), attrs)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=dict(launch.options))


def compile_launch(launch: Launch, capability: int) -> KernelReport:
    """Compile `launch` for sm_<capability> (80: A100, 90: H100/H200); raises what Triton raises."""
    kernel = compiled(launch, capability)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(kernel.asm["ptx"])
        arch = re.search(r"^\.target\s+(sm_\w+)", kernel.asm["ptx"], re.M).group(1)  # sm_90a on Hopper
        done = subprocess.run([_ptxas(), "-v", f"--gpu-name={arch}", str(ptx), "-o", str(Path(tmp) / "k.cubin")],
                              capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"ptxas refused {launch.label()} for {arch}: {done.stderr.strip()[-2000:]}")
    info = done.stderr
    number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, info)) else 0  # noqa: E731
    return KernelReport(registers=number(r"Used (\d+) registers"), spill_stores=number(r"(\d+) bytes spill stores"),
                        spill_loads=number(r"(\d+) bytes spill loads"), stack=number(r"(\d+) bytes stack frame"),
                        shared=int(getattr(kernel.metadata, "shared", 0)))  # fmt: skip


_LOAD = re.compile(r"^\s*(?:@!?%p\d+\s+)?(ld\.global(?:\.nc)?(?:\.v[248])?\.[bfsu]\d+|cp\.async\.c[ag]\.shared\.global)\b.*?(?:,\s*(\d+))?;")


def _load_bytes(instruction: str, size: str | None) -> int:
    if instruction.startswith("cp.async"):
        return int(size or 16)
    vector = re.search(r"\.v(\d)", instruction)
    return (int(vector.group(1)) if vector else 1) * int(re.search(r"(\d+)$", instruction).group(1)) // 8


def _blocks(ptx: str) -> tuple[list[tuple[str, list[str]]], dict[str, set[str]]]:
    """The PTX body's basic blocks [(label, lines)] and their successors (branch targets, fall-through)."""
    blocks: list[tuple[str, list[str]]] = [("entry", [])]
    for line in ptx.splitlines():
        m = re.match(r"^(\$L__\w+):", line)
        if m:
            blocks.append((m.group(1), [line]))
        else:
            blocks[-1][1].append(line)
    successors: dict[str, set[str]] = {}
    for i, (label, lines) in enumerate(blocks):
        code = [line.strip() for line in lines if line.strip() and not line.strip().startswith("//")]
        targets = set(re.findall(r"\bbra(?:\.uni)?\s+(\$L__\w+);", "\n".join(code)))
        last = code[-1] if code else ""
        ends = re.match(r"^(bra(\.uni)?\s|ret;|exit;)", last) is not None  # unconditional
        if not ends and i + 1 < len(blocks):
            targets.add(blocks[i + 1][0])
        successors[label] = targets
    return blocks, successors


def loop_loads(ptx: str) -> dict:
    """The global loads a thread issues in one iteration of a kernel's outermost loop (its body loop,
    whose header LLVM marks `=>This Loop Header: Depth=1`: the blocks reachable from the header that
    reach it again), by instruction, and those outside it:
    {"loop": {instruction: count}, "outside": {...}, "loop_bytes": bytes one thread loads an iteration}."""
    blocks, successors = _blocks(ptx)
    header = next((label for label, lines in blocks if re.search(r"This (Inner )?Loop Header: Depth=1", lines[0])), None)
    inside: set[str] = set()
    if header is not None:
        def reach(start: set[str], edges: dict[str, set[str]]) -> set[str]:
            seen, todo = set(start), list(start)
            while todo:
                for nxt in edges.get(todo.pop(), ()):
                    if nxt not in seen:
                        seen.add(nxt)
                        todo.append(nxt)
            return seen

        predecessors: dict[str, set[str]] = {}
        for label, targets in successors.items():
            for t in targets:
                predecessors.setdefault(t, set()).add(label)
        inside = reach({header}, successors) & reach({header}, predecessors)
    census = {"loop": {}, "outside": {}, "loop_bytes": 0}
    for label, lines in blocks:
        where = "loop" if label in inside else "outside"
        for line in lines:
            m = _LOAD.match(line)
            if m:
                census[where][m.group(1)] = census[where].get(m.group(1), 0) + 1
                if where == "loop":
                    census["loop_bytes"] += _load_bytes(m.group(1), m.group(2))
    return census


def _compile_or_error(job: tuple[Launch, int]) -> KernelReport | str:
    launch, capability = job
    try:
        return compile_launch(launch, capability)
    except Exception as error:  # noqa: BLE001 (reported per launch by compile_all's caller)
        return f"{type(error).__name__}: {str(error)[-1500:]}"


def compile_all(launches: list[Launch], capabilities=(80, 90), workers: int | None = None) -> list[tuple[Launch, int, object]]:
    """(launch, capability, KernelReport or the error's text) for every pair, compiled in `workers`
    processes (default: one a core; each compile is a single-threaded LLVM and ptxas run)."""
    import concurrent.futures
    import multiprocessing
    import os

    jobs = [(launch, capability) for launch in launches for capability in capabilities]
    workers = workers or os.cpu_count() or 1
    if workers == 1:
        return [(*job, _compile_or_error(job)) for job in jobs]
    context = multiprocessing.get_context("spawn")  # no fork of a process holding torch's threads
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        return [(*job, result) for job, result in zip(jobs, pool.map(_compile_or_error, jobs))]


OLDEST_TRITON = "3.6.0"  # the oldest triton the GPU path supports (torch 2.11's); the newest is the installed one


def triton_folder(version: str = OLDEST_TRITON) -> Path:
    """A folder holding triton `version` alone (pip install --target, once, into kvq_ao's cache), to
    compile the kernels with it in a subprocess beside the installed one."""
    import os
    import sys

    folder = Path(os.environ.get("KVQ_AO_CACHE", Path.home() / ".cache" / "kvq_ao")) / f"triton-{version}"
    if not (folder / "triton" / "__init__.py").is_file():
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(folder),
                               f"triton=={version}"], capture_output=True, text=True)  # fmt: skip
        if done.returncode:
            raise RuntimeError(f"could not install triton {version} into {folder}: {done.stderr[-1500:]}")
    return folder


def compile_all_with(folder: Path, launches: list[Launch], capabilities=(80, 90)) -> tuple[str, list]:
    """`compile_all` run by the triton in `folder` (a subprocess with it first on the path):
    (its version, [(launch, capability, KernelReport or error text)])."""
    import os
    import pickle
    import sys

    with tempfile.TemporaryDirectory() as tmp:
        jobs, out = Path(tmp) / "jobs.pkl", Path(tmp) / "out.pkl"
        jobs.write_bytes(pickle.dumps((launches, capabilities)))
        root = Path(__file__).resolve().parents[2]  # the checkout: kvq_ao/ and kernels/
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), str(root), os.environ.get("PYTHONPATH", "")]))
        code = f"from kvq_ao.kernels.gpu.aot import _compile_jobs_file; _compile_jobs_file({str(jobs)!r}, {str(out)!r})"
        done = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"compiling with the triton in {folder} failed: {done.stderr[-3000:]}")
        return pickle.loads(out.read_bytes())


def _compile_jobs_file(jobs: str, out: str) -> None:
    """What compile_all_with's subprocess runs."""
    import pickle

    launches, capabilities = pickle.loads(Path(jobs).read_bytes())
    results = compile_all(launches, capabilities)
    Path(out).write_bytes(pickle.dumps((triton.__version__, results)))


class _TargetOnly:
    """A Triton driver that knows only its target: enough for torch's analysis of a kernel launch
    (which arguments it writes), which lowers the kernel to TTIR for the active driver's target."""

    def __init__(self, capability: int):
        self.target = GPUTarget("cuda", capability, 32)

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0


@contextlib.contextmanager
def traced_as_on_gpu(capability: int = 90):
    """Within the block, torch.compile analyzes Triton launches as on sm_<capability>. Without a GPU
    there is no Triton driver, the analysis fails and torch assumes every input is written, which
    changes the graph (copies back into every input) from the one a GPU gets."""
    config = triton.runtime.driver  # the DriverConfig object
    before = config._active
    config.set_active(_TargetOnly(capability))
    try:
        yield
    finally:
        config._active = before  # (reset_active() would build the default driver, which fails without a GPU)


# SmolLM2's attention shape: 9 query heads over 3 kv heads of head_dim 64 (the presets' target model)
SMOLLM2_HEADS = dict(num_attention_heads=9, num_key_value_heads=3, head_dim=64)


def preset_launches(presets: list[str], dtype: torch.dtype = torch.bfloat16, prompt: int = 300, new_tokens: int = 3,
                    heads: dict | None = None) -> list[Launch]:  # fmt: skip
    """The launches `generate()` makes with each preset, on a one-layer random Llama of SmolLM2's
    attention shape in `dtype` (kernel specializations depend on shapes, formats and dtypes only),
    run on CPU tensors through the Triton kernels in the interpreter: a prompt long enough that
    every preset's body holds packed blocks (chunk attention, quantize) and a few decode steps.
    Presets with calibrated levels or ranges are calibrated on random tokens first."""
    import dataclasses
    import tempfile

    from transformers import LlamaConfig, LlamaForCausalLM

    from kvq_ao import KVQuantConfig, quantize_kv_
    from kvq_ao.calibration import calibrate
    from kvq_ao.kernels import gpu

    shape = heads or SMOLLM2_HEADS
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=shape["num_attention_heads"] * shape["head_dim"], intermediate_size=64,
                         num_hidden_layers=1, max_position_embeddings=4096, **shape)  # fmt: skip
    ids = torch.randint(0, 64, (1, prompt), generator=torch.Generator().manual_seed(0))
    launches: list[Launch] = []
    folder = tempfile.mkdtemp(prefix="kvq-aot-")
    for name in presets:
        model = LlamaForCausalLM(config).eval()
        cfg = KVQuantConfig.preset(name)
        if cfg.needs_calibration:
            calib = calibrate(model, torch.randint(0, 64, (2, 256), generator=torch.Generator().manual_seed(1)), cfg, progress=False)
            cfg = dataclasses.replace(cfg, calibration=str(calib.save(f"{folder}/{name}.json")))
        quantize_kv_(model.to(dtype), cfg)
        with torch.no_grad(), gpu.on_cpu(), recorded_launches() as seen:
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=0)  # fmt: skip
        launches += seen
    return launches


def unique(launches: list[Launch]) -> list[Launch]:
    return list(dict.fromkeys(launches))


__all__ = ["KernelReport", "Launch", "OLDEST_TRITON", "loop_loads", "compiled", "SMOLLM2_HEADS", "compile_all", "compile_all_with", "compile_launch", "triton_folder", "launch_of", "preset_launches", "recorded_launches",
           "traced_as_on_gpu", "unique"]
