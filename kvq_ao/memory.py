"""Memory accounting for quantized KV caches, computed from the specs (not from the tensors).

Counted: packed codes, scales and zero points (float, or one byte each with 8-bit metadata), exact outliers (value + uint8 channel index per
slot), codebooks, the full-precision side store (sink tokens and
the recent window, with their int64 positions), and the body's unused capacity. Bits per
element divide all of that by the number of K and V elements the cache stands for, so a
"4-bit" cache with a 128-token fp16 window really reports more than 4 bits at short context.
The test suite checks these formulas against the bytes of the tensors a cache actually holds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from kvq_ao.config import KVQuantConfig, LayerKV, QuantSpec
from kvq_ao.format import is_meta8

_SIDE_POS_BYTES = 8  # int64 positions


def body_bytes(spec: QuantSpec, heads: int, head_dim: int, tokens: int, dtype_bytes: int, scale_bytes: int) -> int:
    """Bytes of one body (K or V) holding `tokens` positions for `heads` heads (batch folded in)."""
    if not spec.is_quantized:
        return heads * tokens * head_dim * dtype_bytes
    codes = heads * tokens * head_dim * spec.bits // 8
    # per-token: T x D/G; per-channel: T/G x D; calibrated ranges: one row of D for all tokens
    meta_rows = head_dim if spec.calibrated_ranges else tokens * head_dim // spec.group_size
    value_bytes = dtype_bytes if spec.outlier_dtype == "model" else 2
    sparse = heads * tokens * spec.outlier_slots(head_dim) * (value_bytes + 1)
    codebook = 4 * 2**spec.bits if spec.dtype != "int" else 0
    meta_bytes = 1 if is_meta8(spec.meta) else scale_bytes  # 8-bit metadata: one byte a scale or zero
    return codes + 2 * heads * meta_rows * meta_bytes + sparse + codebook


def layer_bytes(spec: LayerKV, sink: int, residual: int, heads: int, head_dim: int, tokens: int,
                dtype_bytes: int, scale_bytes: int, capacity: int | None = None, side_bytes: int | None = None) -> int:  # fmt: skip
    """Bytes one layer holds; `capacity` defaults to `tokens` rounded up to whole token blocks;
    `side_bytes` (per side-store element) to the model's `dtype_bytes`."""
    block = spec.token_block
    capacity = capacity if capacity is not None else math.ceil(tokens / block) * block
    side = sink + residual + block
    return (
        body_bytes(spec.key, heads, head_dim, capacity, dtype_bytes, scale_bytes)
        + body_bytes(spec.value, heads, head_dim, capacity, dtype_bytes, scale_bytes)
        + 2 * heads * side * head_dim * (side_bytes or dtype_bytes)
        + side * _SIDE_POS_BYTES
        + 8  # body_end
    )


@dataclass
class MemoryReport:
    tokens: int
    bytes: int
    fp_bytes: int  # what a plain cache of the model's dtype would hold for the same tokens
    bits_per_element: float
    bytes_per_token: float
    compression: float

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return (
            f"{self.tokens} tokens: {self.bytes / 2**20:.2f} MiB ({self.bits_per_element:.2f} bits/element, "
            f"{self.bytes_per_token:.0f} B/token, {self.compression:.2f}x smaller than {self.fp_bytes / 2**20:.2f} MiB fp)"
        )


def estimate(config: KVQuantConfig, num_layers: int, kv_heads: int, head_dim: int, tokens: int,
             batch: int = 1, dtype: torch.dtype = torch.float32, capacity: int | None = None) -> MemoryReport:  # fmt: skip
    """Memory of a cache with `config` holding `tokens` tokens, without building one."""
    dtype_bytes = torch.empty(0, dtype=dtype).element_size()
    scale_bytes = torch.empty(0, dtype=getattr(torch, config.scale_dtype)).element_size()
    total = sum(
        layer_bytes(spec, config.sink_tokens, config.residual_length, batch * kv_heads, head_dim, tokens,
                    dtype_bytes, scale_bytes, capacity, None if config.side_dtype == "model" else 2)  # fmt: skip
        for spec in config.resolve(num_layers)
    )
    elements = 2 * num_layers * batch * kv_heads * head_dim * max(tokens, 1)
    return MemoryReport(
        tokens=tokens,
        bytes=total,
        fp_bytes=elements * dtype_bytes,
        bits_per_element=8 * total / elements,
        bytes_per_token=total / max(tokens, 1),
        compression=elements * dtype_bytes / total,
    )


def memory_report(cache) -> MemoryReport:
    """Report for a live `QuantizedKVCache`, from its specs, length and capacity."""
    layers = [layer for layer in cache.layers if layer.is_initialized]
    if not layers:
        raise ValueError("the cache is empty: run the model with it first")
    first = layers[0]
    batch_heads = first.side_k.shape[0] * first.side_k.shape[1]
    head_dim = first.side_k.shape[-1]
    tokens = int(first.cumulative_length)
    return estimate(
        cache.config, len(cache.layers), batch_heads, head_dim, tokens, dtype=first.dtype, capacity=first.capacity
    )


__all__ = ["MemoryReport", "estimate", "memory_report"]
