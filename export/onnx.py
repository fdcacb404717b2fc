"""ONNX export of a model with a quantized KV cache, and an onnxruntime runner.

ONNX has no mutable buffers (torch's exporter silently drops in-place buffer writes), so the
cache crosses the graph boundary: inputs `past.<name>` and outputs `present.<name>` for every
packed tensor of every layer (uint8 codes, fp16 scales/zero points, fp side store, int64
positions). The runner feeds each step's `present` back as the next step's `past`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from kvq_ao.config import KVQuantConfig
from kvq_ao.export.decoder import DecodeStep, greedy_generate
from kvq_ao.files import record_checksum, replacing, verify_checksum
from kvq_ao.format import FORMAT_VERSION
from kvq_ao.ops import decompositions


class _PastPresentStep(torch.nn.Module):
    """forward(input_ids, cache_position, *past) -> (logits, *present)."""

    def __init__(self, step: DecodeStep):
        super().__init__()
        self.step = step

    def forward(self, input_ids, cache_position, *past):
        self.step.load_cache_tensors([t.clone() for t in past])
        logits = self.step(input_ids, cache_position)
        return (logits, *self.step.cache_tensors())


def export_onnx(model, config: KVQuantConfig, path: str | Path, max_seq_len: int = 256) -> Path:
    """Write `path` (.onnx): a one-token decode step with the packed cache as past/present tensors."""
    step = DecodeStep(model, config, max_seq_len)
    initial = [t.clone() for t in step.cache_tensors()]
    names = step.cache_names()
    wrapper = _PastPresentStep(step).eval()
    example = (torch.tensor([[0]], dtype=torch.long), torch.tensor([0], dtype=torch.long), *initial)
    with torch.no_grad():
        program = torch.export.export(wrapper, example, strict=True).run_decompositions(decompositions("export"))
        onnx_program = torch.onnx.export(
            program,
            input_names=["input_ids", "cache_position", *[f"past.{n}" for n in names]],
            output_names=["logits", *[f"present.{n}" for n in names]],
            dynamo=True,
            verbose=False,  # its progress lines went to stdout, mixed into `kvq export --prompt`'s answer
        )
    meta = {"max_seq_len": str(max_seq_len), "kvq_config": json.dumps(config.to_dict()), "kvq_format_version": str(FORMAT_VERSION)}
    onnx_program.model.metadata_props.update(meta)
    path = Path(path)
    with replacing(path) as tmp:  # atomically (kvq_ao.files): a reader never loads half a program
        onnx_program.save(str(tmp))
    with replacing(path.with_suffix(".cache_init.npz")) as tmp, open(tmp, "wb") as f:
        np.savez(f, **{n: t.numpy() for n, t in zip(names, initial)})
    for written in (path, path.with_suffix(".cache_init.npz")):
        record_checksum(written)  # <file>.sha256: the runner checks it (a flipped byte in a weight would load silently)
    return path


class OnnxRunner:
    """Greedy generation with an exported `.onnx` in onnxruntime."""

    def __init__(self, path: str | Path, config: KVQuantConfig | None = None, verify: bool = True):
        """config: refuse a model exported with another config. A model of another kvq_ao format
        version, or a file that is not a whole model, is refused with the reason; so is one whose
        file or initial cache differs from the checksum recorded beside it at export
        (`<file>.sha256`), unless verify=False."""
        import onnx
        import onnxruntime

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no ONNX model at {path}")
        if verify:
            for exported in (path, path.with_suffix(".cache_init.npz")):
                verify_checksum(exported)
        try:
            meta = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
        except Exception as e:  # protobuf's DecodeError and onnx's own
            raise ValueError(f"{path}: not a loadable ONNX model (truncated or damaged?): {e}") from None
        if "kvq_format_version" not in meta:
            raise ValueError(f"{path}: records no kvq_ao format version (exported by an older kvq_ao, or not by kvq_ao); "
                             f"export it again with this version (format {FORMAT_VERSION})")  # fmt: skip
        if meta["kvq_format_version"] != str(FORMAT_VERSION):
            raise ValueError(f"{path}: exported for kvq_ao cache format {meta['kvq_format_version']}, this kvq_ao reads "
                             f"format {FORMAT_VERSION}; export it again")  # fmt: skip
        self.config = KVQuantConfig.from_dict(json.loads(meta["kvq_config"]))
        if config is not None and self.config.to_json_key() != config.to_json_key():
            raise ValueError(f"{path}: exported with config {self.config.name!r}, not with {config.name!r}")
        self.max_seq_len = int(meta["max_seq_len"])
        self.session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        init = np.load(path.with_suffix(".cache_init.npz"))
        self.names = [i.name.removeprefix("past.") for i in self.session.get_inputs()[2:]]
        self.initial = {n: init[n] for n in self.names}
        self.reset()

    def reset(self) -> None:
        self.past = dict(self.initial)

    def step(self, token: int, position: int) -> torch.Tensor:
        if position >= self.max_seq_len:
            raise ValueError(f"position {position} is past the exported max_seq_len={self.max_seq_len}")
        feed = {"input_ids": np.array([[token]], dtype=np.int64), "cache_position": np.array([position], dtype=np.int64)}
        feed.update({f"past.{n}": v for n, v in self.past.items()})
        out = self.session.run(None, feed)
        self.past = dict(zip(self.names, out[1:]))
        return torch.from_numpy(out[0][0, -1])

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
        """(new token ids, logits of every step: prompt tokens then generated ones)."""
        self.reset()
        return greedy_generate(self.step, prompt_ids, max_new_tokens, self.max_seq_len)


__all__ = ["OnnxRunner", "export_onnx"]
