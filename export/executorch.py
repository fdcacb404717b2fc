"""ExecuTorch export of a model with a quantized KV cache, and a runner for the `.pte`.

The cache lives in the program as mutable buffers: packed uint8 codes, fp16 scales/zero points,
the fp side store and int64 positions, updated in place by each `forward` call and kept between
calls by the runtime. `max_seq_len` is stored as the constant method `get_max_seq_len`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvq_ao.config import KVQuantConfig
from kvq_ao.export.decoder import INITIALIZED, DecodeStep, greedy_generate, export_decode_step


@dataclass
class ExportedPte:
    path: Path
    mutable_buffers: dict[str, tuple[torch.dtype, int]]  # name -> (dtype, bytes), as lowered

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


def export_executorch(model, config: KVQuantConfig, path: str | Path, max_seq_len: int = 256) -> ExportedPte:
    """Write `path` (.pte): a one-token decode step whose KV cache is packed mutable buffers."""
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass

    step = DecodeStep(model, config, max_seq_len)
    program = export_decode_step(step)
    edge = to_edge_transform_and_lower(program, constant_methods={"get_max_seq_len": max_seq_len})
    et = edge.to_executorch(ExecutorchBackendConfig(passes=[InitializedMutableBufferPass(list(INITIALIZED))]))
    path = Path(path)
    path.write_bytes(et.buffer)
    return ExportedPte(path, _mutable_buffers(et.exported_program()))


class ExecuTorchRunner:
    """Greedy generation with an exported `.pte` in the ExecuTorch python runtime."""

    def __init__(self, path: str | Path):
        from executorch.runtime import Runtime

        self.program = Runtime.get().load_program(Path(path))
        self.method = self.program.load_method("forward")
        self.max_seq_len = int(self.program.load_method("get_max_seq_len").execute([])[0])

    def step(self, token: int, position: int) -> torch.Tensor:
        if position >= self.max_seq_len:
            raise ValueError(f"position {position} is past the exported max_seq_len={self.max_seq_len}")
        out = self.method.execute([torch.tensor([[token]], dtype=torch.long), torch.tensor([position], dtype=torch.long)])
        return out[0][0, -1]

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
        """(new token ids, logits of every step: prompt tokens then generated ones)."""
        return greedy_generate(self.step, prompt_ids, max_new_tokens, self.max_seq_len)
