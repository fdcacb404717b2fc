"""ExecuTorch export of a model with a quantized KV cache, and a runner for the `.pte`.

The cache lives in the program as mutable buffers: packed uint8 codes, fp16 scales/zero points,
the fp side store and int64 positions, updated in place by each `forward` call and kept between
calls by the runtime. `max_seq_len` is stored as the constant method `get_max_seq_len`.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from kvq_ao.config import KVQuantConfig
from kvq_ao.files import atomic_write, record_checksum, verify_checksum
from kvq_ao.format import FORMAT_VERSION
from kvq_ao.export import EXECUTORCH_BACKENDS, KVQ_KERNELS
from kvq_ao.export.decoder import INITIALIZED, LAYER_TENSORS, DecodeStep, export_decode_step, greedy_generate


@dataclass
class ExportedPte:
    path: Path
    mutable_buffers: dict[str, tuple[torch.dtype, int]]  # name -> (dtype, bytes), as lowered
    delegate_calls: int = 0  # calls into a backend delegate (XNNPACK) in the lowered program
    kvq_kernels: str = "portable"  # "native": the program calls the kvq ops' out variants (attention, append)

    @property
    def cache_bytes(self) -> int:
        return sum(nbytes for _, nbytes in self.mutable_buffers.values())


def _mutable_buffers(program) -> dict[str, tuple[torch.dtype, int]]:
    """The program's mutated buffers with dtype and size, read from the lowered graph."""
    sig = program.graph_signature
    mutated = set(sig.buffers_to_mutate.values())
    out = {}
    for node in program.graph.nodes:
        name = sig.inputs_to_buffers.get(node.name) if node.op == "placeholder" else None
        if name in mutated:
            val = node.meta["val"]
            out[name] = (val.dtype, val.numel() * val.element_size())
    return out


def _partitioners(backend: str) -> list:
    """What runs outside ExecuTorch's portable kernels.

    "xnnpack" delegates the model's linear layers (the GEMMs, most of a decode step's work at these
    lengths) to XNNPACK and leaves the cache ops, attention and the rest on the portable kernels.
    Only linears: XNNPACK's default configs also take the many small pointwise ops around the
    cache, which split SmolLM2's graph into 484 delegate calls and took 1025 s to lower (linears
    only: 408 s) for 86 vs 107 ms per token at capacity 128 (the latter measured while a test job
    shared the CPU): not worth 2.5x the lowering time.
    """
    if backend not in EXECUTORCH_BACKENDS:
        raise ValueError(f"ExecuTorch backend must be one of {EXECUTORCH_BACKENDS}, got {backend!r}")
    if backend == "portable":
        return []
    from executorch.backends.xnnpack.partition.config.gemm_configs import LinearConfig
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return [XnnpackPartitioner(configs=[LinearConfig])]


def _native_kvq_kernels(kvq_kernels: str) -> bool:
    """Whether the program should call the kvq kernel library (see KVQ_KERNELS)."""
    from kvq_ao.kernels.cpu import executorch_library

    if kvq_kernels not in KVQ_KERNELS:
        raise ValueError(f"kvq_kernels must be one of {KVQ_KERNELS}, got {kvq_kernels!r}")
    if kvq_kernels == "portable":
        return False
    if executorch_library.load():
        return True
    why = executorch_library.failure()
    if kvq_kernels == "native":
        raise executorch_library.KernelLibraryError(f"kvq_kernels='native' needs the kvq ExecuTorch kernel library: {why}")
    warnings.warn(
        f"kvq_ao: the kvq ExecuTorch kernel library is not available here ({why}); the .pte runs the decode "
        "attention on ExecuTorch's portable kernels instead (correct, many times slower at long contexts)",
        RuntimeWarning,
        stacklevel=3,
    )
    return False


def export_executorch(model, config: KVQuantConfig, path: str | Path, max_seq_len: int = 256,
                      backend: str = "xnnpack", kvq_kernels: str = "auto",
                      prefix_ids: list[int] | None = None) -> ExportedPte:  # fmt: skip
    """Write `path` (.pte): a one-token decode step whose KV cache is packed mutable buffers.

    backend: "xnnpack" (linear layers delegated to XNNPACK, the fast default) or "portable"
    (every op on ExecuTorch's portable kernels: slow, but no delegate in the program).
    kvq_kernels: "native" (the decode attention calls `kvq::decode_attention.out` and the append's
    quantizers `kvq::quantize.out` and, for calibrated key ranges, `kvq::quantize_fixed.out`: the C++
    kernels of the kvq ExecuTorch kernel library, which the runner must load), "portable" (all
    decomposed into portable ops: runs anywhere, slowly), or "auto" (native if the library
    builds on this machine, else portable with a warning).
    prefix_ids: tokens whose cache the program starts with (a fixed system prompt, or a long
    context to measure at): the cache buffers are stored filled, and generation continues at
    position len(prefix_ids). Such a program generates once per load (a second generation would
    find the prefix's recent tokens overwritten in the side store).
    """
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.delegate import executorch_call_delegate
    from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass

    partitioners = _partitioners(backend)
    native = _native_kvq_kernels(kvq_kernels)
    step = DecodeStep(model, config, max_seq_len)
    if prefix_ids:
        step.fill(list(prefix_ids))
    program = export_decode_step(step, native_attention=native)
    constants = {"get_max_seq_len": max_seq_len, "get_prefix_len": step.prefix_len,
                 "get_kvq_format_version": FORMAT_VERSION, "get_kvq_config": config.fingerprint()}
    edge = to_edge_transform_and_lower(program, partitioner=partitioners or None, constant_methods=constants)
    initialized = list(LAYER_TENSORS) if prefix_ids else list(INITIALIZED)  # a prefix: every cache buffer keeps its value
    # The cache's index writes become index_put on its buffers; without reinplacing, each step copies
    # every written buffer whole (its capacity) into a new tensor and back: 34 ms of SmolLM2's step at
    # 8k tokens. Reinplaced, they write in place.
    et = edge.to_executorch(ExecutorchBackendConfig(passes=[InitializedMutableBufferPass(initialized)], run_reinplace_pass=True))
    path = Path(path)
    atomic_write(path, et.buffer)
    record_checksum(path)  # <path>.sha256: the runner checks it (a flipped byte in a weight would load silently)
    lowered = et.exported_program()
    delegates = sum(1 for n in lowered.graph.nodes if n.target is executorch_call_delegate)
    return ExportedPte(path, _mutable_buffers(lowered), delegates, "native" if native else "portable")


@contextmanager
def native_log_to(logger: logging.Logger):
    """Route what native code writes to the process's stdout/stderr (ExecuTorch's runtime logs
    lines such as "[cpuinfo_utils.cpp:87] Failed to open midr file ..." while it loads) to
    `logger` at INFO, one record per line. If the block raises, the lines go to stderr as they
    were, since they then explain the error."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    failed = False
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 1)
        os.dup2(captured.fileno(), 2)
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            captured.seek(0)
            text = captured.read().decode(errors="replace")
            if failed:
                sys.stderr.write(text)
            else:
                for line in filter(str.strip, text.splitlines()):
                    logger.info(line)


LOG = logging.getLogger("kvq_ao.executorch")


def program_operators(path: str | Path) -> set[str]:
    """The operators a `.pte`'s methods call, as "namespace::name.overload"."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    pte = deserialize_pte_binary(Path(path).read_bytes())
    program = getattr(pte, "program", pte)
    return {f"{op.name}.{op.overload}" if op.overload else op.name for plan in program.execution_plan for op in plan.operators}


class ExecuTorchRunner:
    """Greedy generation with an exported `.pte` in the ExecuTorch python runtime.

    The runtime's own log lines while loading go to the `kvq_ao.executorch` logger (INFO), not
    the terminal: `logging.basicConfig(level=logging.INFO)` or `kvq talk --verbose` shows them."""

    def __init__(self, path: str | Path, load_kvq_kernels: bool = True, config: KVQuantConfig | None = None,
                 verify: bool = True):  # fmt: skip
        """load_kvq_kernels: load (building on first use) the kvq ExecuTorch kernel library that
        `.pte` files exported with native kvq kernels call; False only to see the error a
        runtime without it gives. config: refuse a program exported with another config.
        A program of another kvq_ao format version, or a file that is not a whole program, is
        refused with the reason; so is one that differs from the checksum recorded beside it at
        export (`<file>.sha256`), unless verify=False."""
        from executorch.runtime import Runtime

        from kvq_ao.kernels.cpu import executorch_library

        if load_kvq_kernels:
            executorch_library.load()
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no ExecuTorch program at {path}")
        if verify:
            verify_checksum(path)
        try:
            with native_log_to(LOG):
                self.program = Runtime.get().load_program(path)
                names = set(self.program.method_names) if hasattr(self.program, "method_names") else set()
        except Exception as e:  # the runtime's own error types
            raise ValueError(f"{path}: not a loadable ExecuTorch program (truncated or damaged?): {e}") from None
        self._check_versions(path, names, config)
        if not executorch_library.is_loaded() and executorch_library.OP in program_operators(path):
            why = executorch_library.failure()
            raise RuntimeError(
                f"{path} calls {executorch_library.OP}, which the kvq ExecuTorch kernel library implements, and that "
                "library is not loaded in this process. Load it first with "
                "`kvq_ao.kernels.cpu.executorch_library.load()` (ExecuTorchRunner does unless load_kvq_kernels=False)"
                + (f"; here it could not be built: {why}" if why else "")
                + ", or re-export with kvq_kernels='portable' (`kvq export --kvq-kernels portable`)."
            )
        with native_log_to(LOG):
            self.method = self.program.load_method("forward")
            self.max_seq_len = self._constant("get_max_seq_len")
            self.prefix_len = self._constant("get_prefix_len") if "get_prefix_len" in names else 0
        self._generated = False

    def _constant(self, name: str) -> int:
        return int(self.program.load_method(name).execute([])[0])

    def _check_versions(self, path: Path, names: set, config: KVQuantConfig | None) -> None:
        if "get_kvq_format_version" not in names:
            raise ValueError(f"{path}: records no kvq_ao format version (exported by an older kvq_ao, or not by kvq_ao); "
                             f"export it again with this version (format {FORMAT_VERSION})")  # fmt: skip
        with native_log_to(LOG):
            version, fingerprint = self._constant("get_kvq_format_version"), self._constant("get_kvq_config")
        if version != FORMAT_VERSION:
            raise ValueError(f"{path}: exported for kvq_ao cache format {version}, this kvq_ao reads format {FORMAT_VERSION}; "
                             "export it again")  # fmt: skip
        if config is not None and fingerprint != config.fingerprint():
            raise ValueError(f"{path}: exported with another config than {config.name!r} (fingerprint {fingerprint:012x}, "
                             f"this config's {config.fingerprint():012x})")  # fmt: skip
        self.config_fingerprint = fingerprint

    def step(self, token: int, position: int) -> torch.Tensor:
        if position >= self.max_seq_len:
            raise ValueError(f"position {position} is past the exported max_seq_len={self.max_seq_len}")
        out = self.method.execute([torch.tensor([[token]], dtype=torch.long), torch.tensor([position], dtype=torch.long)])
        return out[0][0, -1]

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
        """(new token ids, logits of every step: prompt tokens then generated ones), after the
        program's prefix if it was exported with one."""
        if self.prefix_len and self._generated:
            raise RuntimeError("this .pte was exported with a prefix: it generates once per load (load it again)")
        self._generated = True
        return greedy_generate(self.step, prompt_ids, max_new_tokens, self.max_seq_len, start=self.prefix_len)


__all__ = ["ExecuTorchRunner", "ExportedPte", "export_executorch", "native_log_to", "program_operators"]
