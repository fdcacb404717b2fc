"""GPU kernels of the kvq ops, in Triton.

`triton_decode.py` holds one-token decode attention (flash-decoding over the packed cache, split over
tokens, read in wide loads with scales once per group, GQA heads as tensor-core matrix rows, merged
with the side store); `triton_attention.py` multi-token chunk attention (tiles of queries x the query
heads of a kv head, streaming the body block by block with an online softmax, masks as key-position
bounds or dense). `triton_ops.py` registers them as
`kvq::triton_decode_attention` and `kvq::triton_chunk_attention`, `torch.library.triton_op`s with
exactly the arguments of `kvq::decode_attention` / `kvq::chunk_attention`, so that torch.compile
traces into the kernel launches instead of calling an opaque op.

Which op serves a call is decided per device by `kvq_ao.tensor.attention`: CUDA tensors go to the
Triton ops once they are loaded (`load()`, done by `quantize_kv_` on a machine with CUDA and triton),
everything else to the kvq ops (the native C++ decode kernel on CPU, the reference elsewhere).
Triton is an optional dependency (`pip install kvq_ao[gpu]`); without it CUDA runs the reference.

The kernels are also run on CPU tensors, in Triton's interpreter: that is how they are tested on
machines without a GPU (`on_cpu()` routes CPU calls to them; slow, for tests and dry runs only).
`triton_quantize.py` is the append path: `kvq::triton_quantize`, bit-identical to `kvq::quantize`
(outliers, group ranges, codes and packing in one pass), and `kvq::triton_quantize_fixed`, bit-
identical to `kvq::quantize_fixed` (keys coded against calibrated ranges), for power-of-two head_dim
and group sizes (other shapes run the reference ops).
"""

from __future__ import annotations

import contextlib
import importlib.util

import torch

_STATE: dict = {"loaded": False, "cpu": False, "quantize_supported": None, "quantize_fixed_supported": None,
                "blocks_supported": None}


def available() -> bool:
    """Whether triton is installed (the GPU kernels' one extra dependency)."""
    return importlib.util.find_spec("triton") is not None


def load() -> bool:
    """Register the Triton ops (imports triton); False when triton is not installed."""
    if not _STATE["loaded"] and available():
        from kvq_ao.kernels.gpu import triton_ops  # registers the kvq::triton_* ops

        from kvq_ao.kernels.gpu import triton_blocks

        _STATE.update(loaded=True, quantize_supported=triton_ops.quantize_supported,
                      quantize_fixed_supported=triton_ops.quantize_fixed_supported, blocks_supported=triton_blocks.supported)  # fmt: skip
    return _STATE["loaded"]


def serves(device: torch.device) -> bool:
    """Whether the Triton attention ops serve tensors on `device`."""
    return _STATE["loaded"] and (device.type == "cuda" or (device.type == "cpu" and _STATE["cpu"]))


def attention_op(query: torch.Tensor, key, value):
    """The op for `query` [B, Hq, Tq, D] over quantized `key` and `value` (QuantizedKV): the Triton
    decode (Tq = 1) or chunk op where the Triton kernels serve the device and their block tiles take
    the shapes (power-of-two head_dim >= 32 and groups), else `kvq.decode_attention` /
    `kvq.chunk_attention`."""
    decode = query.shape[2] == 1
    if serves(query.device):
        if _STATE["blocks_supported"](query.shape[-1], key, value):
            return torch.ops.kvq.triton_decode_attention if decode else torch.ops.kvq.triton_chunk_attention
    return torch.ops.kvq.decode_attention if decode else torch.ops.kvq.chunk_attention


def quantize_op(x: torch.Tensor, axis: int, group: int, scale_dtype: torch.dtype):
    """The op that quantizes x into the cache: `kvq.triton_quantize` where the Triton kernels serve x's
    device and the format (power-of-two head_dim and group), else `kvq.quantize`."""
    if serves(x.device) and _STATE["quantize_supported"](x, axis, group, scale_dtype):
        return torch.ops.kvq.triton_quantize
    return torch.ops.kvq.quantize


def quantize_fixed_op(x: torch.Tensor):
    """The op that codes x against calibrated key ranges: `kvq.triton_quantize_fixed` where the Triton
    kernels serve x's device (power-of-two head_dim), else `kvq.quantize_fixed`."""
    if serves(x.device) and _STATE["quantize_fixed_supported"](x):
        return torch.ops.kvq.triton_quantize_fixed
    return torch.ops.kvq.quantize_fixed


@contextlib.contextmanager
def on_cpu():
    """Within the block, CPU tensors are served by the Triton kernels in Triton's interpreter
    (tests and dry runs on machines without a GPU: correct, and far slower than any other path)."""
    if not load():
        raise RuntimeError("kvq_ao's GPU kernels need triton: pip install 'kvq_ao[gpu]' (or pip install triton)")
    before = _STATE["cpu"]
    _STATE["cpu"] = True
    try:
        yield
    finally:
        _STATE["cpu"] = before


__all__ = ["attention_op", "available", "load", "on_cpu", "quantize_fixed_op", "quantize_op", "serves"]
