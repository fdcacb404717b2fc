"""Quantized KV caches on transformers' Cache API (5.x): dynamic and static, per-layer specs.

Each layer keeps
* a **body**: every position of its capacity as packed codes (or plain floats for "none"),
  written once when a position falls behind the full-precision window, never re-quantized;
* a **side** store in full precision: `sink_tokens` first positions (attention sinks) and a ring
  of the most recent `residual_length + block` positions (KIVI's residual window; `block` is the
  per-channel key group, since a channel group can only be quantized once all its tokens exist).

Positions [sink, body_end) are read from the body and the rest from the side, where
body_end = floor((length - residual) / block) * block. `update()` returns the layer's keys and
values as `QuantizedKV` views of this storage; attention reads them through
the kvq attention ops, so the quantized cache is what the model really attends to. For a chunk of
several tokens each query gets its own body end (the one decoding at its position would see) and
the chunk's keys/values in full precision, so a prompt prefilled in chunks of any size, or in one
pass, or token by token, is attended to identically.

Two update paths produce identical storage (tested against each other):
* `_append_eager` (any number of tokens, Python ints; dynamic caches and any prefill),
* `_append_one_static` (one token, tensor positions only, no data-dependent Python control
  flow: what `torch.compile` and `torch.export` trace for a decode step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, StaticCache

from kvq_ao.config import KVQuantConfig, LayerKV, QuantSpec
from kvq_ao.finite import NATIVE_NON_FINITE, refuse_non_finite
from kvq_ao.kernels import cpu as cpu_kernels
from kvq_ao.kernels import gpu as gpu_kernels
from kvq_ao.quant.codebook import check_codebook, nf_codebook
from kvq_ao.quant.packing import packed_size
from kvq_ao.quant import rotation
from kvq_ao.quant.rope import unrotate
from kvq_ao.format import FLOAT_QUERY, encode, format_ints, is_meta8, range_levels
from kvq_ao.quant.uniform import fixed_range
from kvq_ao.tensor import QuantizedKV

_GROWTH_STEP = 256  # a dynamic cache's capacity is a multiple of this many tokens (and of its block)
_GROWTH_FACTOR = 1.5  # ...and grows at least this much at a time, so appending n tokens copies O(n) bytes
# A static cache's capacity is a multiple of this many tokens (and of its block), so generations
# whose prompt + max_new_tokens differ by a little share one compiled graph (one per capacity).
_STATIC_STEP = 16


def _native_writers(x: torch.Tensor) -> bool:
    """Whether x's quantize ops run the native CPU kernels (which refuse NaN/Inf themselves)."""
    return x.device.type == "cpu" and cpu_kernels.is_loaded() and not gpu_kernels.serves(x.device)


def _op_format(spec: QuantSpec) -> tuple[int, int, int, int, int]:
    return encode(spec.bits, spec.axis_id, spec.group_size, query_bits=spec.query_bits, meta=spec.meta)


@dataclass
class TensorCalibration:
    """What calibration gives one tensor (keys or values) of one layer."""

    codebook: torch.Tensor | None = None  # levels in [0, 1] for "nuq"
    lo: torch.Tensor | None = None  # [kv_heads, head_dim] outlier thresholds
    hi: torch.Tensor | None = None


@dataclass
class _Checkpoint:
    """A layer's state before the first append since its last crop: the length, and the side store
    with everything it held (later appends overwrite the ring's slots). The body needs no copy:
    positions below the boundary at `length` are never rewritten, and blocks past it are rewritten
    from full precision when they fall behind the window again."""

    length: int
    side_k: torch.Tensor
    side_v: torch.Tensor
    side_pos: torch.Tensor
    clamped: tuple[int, int]


def _codebook_for(spec: QuantSpec, calib: TensorCalibration | None) -> torch.Tensor:
    if not spec.is_quantized or spec.dtype == "int":
        return torch.zeros(0)
    if spec.dtype == "nf":
        return nf_codebook(spec.bits)
    if calib is None or calib.codebook is None:
        raise ValueError(f"{spec.label()} needs a calibrated codebook: pass a calibration (kvq calibrate)")
    check_codebook(calib.codebook, spec.bits)
    return calib.codebook.float()


class _BodyStore:
    """The packed body of one tensor (keys or values) of one layer."""

    def __init__(self, spec: QuantSpec, lead: tuple[int, int], head_dim: int, capacity: int,
                 dtype: torch.dtype, scale_dtype: torch.dtype, device: torch.device,
                 calib: TensorCalibration | None = None):  # fmt: skip
        self.spec, self.scale_dtype = spec, scale_dtype
        b, h = lead
        self.codebook = _codebook_for(spec, calib).to(device)
        self.n_outliers = spec.outlier_slots(head_dim)
        self.lo = self.hi = torch.zeros(0, device=device)
        # "vector" outliers are judged online: lo/hi stay empty
        if spec.calibrated_ranges or (self.n_outliers and spec.outlier_rule == "channel"):
            if calib is None or calib.lo is None or calib.hi is None:
                what = "channel ranges" if spec.calibrated_ranges else "outlier thresholds"
                raise ValueError(f"{spec.label()} needs calibrated {what}: pass a calibration (kvq calibrate)")
            if tuple(calib.lo.shape) != (h, head_dim) or tuple(calib.hi.shape) != (h, head_dim):
                raise ValueError(f"outlier thresholds must be [{h}, {head_dim}], got {list(calib.lo.shape)}")
            self.lo, self.hi = calib.lo.float().to(device), calib.hi.float().to(device)
        self.out_val = torch.zeros(b, h, capacity, self.n_outliers, dtype=spec.outlier_values_dtype(dtype), device=device)
        self.out_idx = torch.zeros(b, h, capacity, self.n_outliers, dtype=torch.uint8, device=device)
        self.clamped = 0  # outlier entries clamped because their vector's slots were full (eager writes)
        if spec.calibrated_ranges:  # one fixed scale/zero row per head, read for every position
            self.codes = torch.zeros(b, h, capacity, packed_size(head_dim, spec.bits), dtype=torch.uint8, device=device)
            levels = range_levels(spec.bits, self.codebook.numel() > 0)  # codebook levels span [0, 1] of the range
            self.fixed_zero, self.fixed_scale = fixed_range(self.lo, self.hi, levels, scale_dtype)
            self.zero = self.fixed_zero[None, :, None, :].repeat(b, 1, 1, 1)
            self.scale = self.fixed_scale[None, :, None, :].repeat(b, 1, 1, 1)
        elif spec.is_quantized:
            self.codes = torch.zeros(b, h, capacity, packed_size(head_dim, spec.bits), dtype=torch.uint8, device=device)
            meta = (b, h, capacity, head_dim // spec.group_size) if spec.axis == "token" else (b, h, capacity // spec.group_size, head_dim)
            stored = torch.uint8 if is_meta8(spec.meta) else scale_dtype  # 8-bit metadata: one code each
            self.scale = torch.zeros(meta, dtype=stored, device=device)
            self.zero = torch.zeros(meta, dtype=stored, device=device)
        else:
            self.codes = torch.zeros(b, h, capacity, head_dim, dtype=dtype, device=device)
            self.scale = torch.zeros(0, dtype=scale_dtype, device=device)
            self.zero = torch.zeros(0, dtype=scale_dtype, device=device)

    @property
    def meta_per_row(self) -> int:
        """Tokens covered by one row of scale/zero along the token axis."""
        return self.spec.group_size if self.spec.is_quantized and self.spec.axis == "channel" else 1

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.codes, self.scale, self.zero

    def op_format(self) -> tuple[int, int, int, int, int]:
        """(bits, axis, group, query_bits, meta) the kvq ops read this body with: calibrated ranges are the per-channel
        format with one scale/zero row for all positions (`kvq_ao.format.ONE_ROW`, whatever the capacity, so a
        growing cache keeps one format and a compiled step its graph)."""
        return encode(self.spec.bits, self.spec.axis_id, self.spec.group_size, calibrated_rows=self.spec.calibrated_ranges,
                      query_bits=self.spec.query_bits, meta=self.spec.meta)  # fmt: skip

    def clear(self) -> None:
        """Forget every stored token (fixed calibrated ranges stay)."""
        fixed = self.spec.calibrated_ranges
        for t in (self.codes, *(() if fixed else (self.scale, self.zero)), *self.sparse()):
            t.zero_()

    def sparse(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.out_val, self.out_idx

    def operand_fields(self) -> dict:
        """The body's fields of a `QuantizedKV` (every operand field but the side store)."""
        bits, axis, group, query_bits, meta = self.op_format()
        return dict(codes=self.codes, scale=self.scale, zero=self.zero, codebook=self.codebook, out_val=self.out_val,
                    out_idx=self.out_idx, bits=bits, axis=axis, group=group, query_bits=query_bits, meta=meta)  # fmt: skip

    def grow(self, capacity: int) -> None:
        def pad(t: torch.Tensor, rows: int) -> torch.Tensor:
            extra = torch.zeros(*t.shape[:2], rows - t.shape[2], *t.shape[3:], dtype=t.dtype, device=t.device)
            return torch.cat([t, extra], dim=2)

        self.codes = pad(self.codes, capacity)
        self.out_val = pad(self.out_val, capacity)
        self.out_idx = pad(self.out_idx, capacity)
        if self.spec.is_quantized and not self.spec.calibrated_ranges:
            self.scale = pad(self.scale, capacity // self.meta_per_row)
            self.zero = pad(self.zero, capacity // self.meta_per_row)

    def _encode(self, x: torch.Tensor):
        if not self.spec.is_quantized:
            return x.to(self.codes.dtype), None, None, None, None, None
        bits, axis, group, _, meta = _op_format(self.spec)
        if self.spec.calibrated_ranges:
            codes, out_val, out_idx, clamped = gpu_kernels.quantize_fixed_op(x)(
                x, bits, self.fixed_zero, self.fixed_scale, self.codebook, self.lo, self.hi, self.n_outliers)  # fmt: skip
            return codes, None, None, out_val.to(self.out_val.dtype), out_idx, clamped
        op = gpu_kernels.quantize_op(x, axis, group, self.scale_dtype)
        codes, scale, zero, out_val, out_idx, clamped = op(x, format_ints(bits, axis, group, FLOAT_QUERY, meta), self.scale_dtype, self.codebook,
                                                           self.lo, self.hi, self.n_outliers)  # fmt: skip
        return codes, scale, zero, out_val.to(self.out_val.dtype), out_idx, clamped

    def write(self, start: int, x: torch.Tensor, encoded: tuple | None = None) -> None:
        """Quantize x [B, H, n, D] into positions [start, start + n) (block-aligned); `encoded`: its
        `_encode` already computed."""
        codes, scale, zero, out_val, out_idx, clamped = self._encode(x) if encoded is None else encoded
        n = x.shape[2]
        self.codes[:, :, start : start + n] = codes
        if self.n_outliers:
            self.out_val[:, :, start : start + n] = out_val
            self.out_idx[:, :, start : start + n] = out_idx
            self.clamped += int(clamped)
        if scale is not None:
            r = self.meta_per_row
            self.scale[:, :, start // r : (start + n) // r] = scale
            self.zero[:, :, start // r : (start + n) // r] = zero

    def write_block_if(self, start: torch.Tensor, x: torch.Tensor, enable: torch.Tensor, encoded: tuple | None = None) -> None:
        """Tensor-only write of one block x [B, H, block, D] at `start` when `enable` (0-dim bool)."""
        codes, scale, zero, out_val, out_idx, clamped = self._encode(x) if encoded is None else encoded
        rows = start + torch.arange(x.shape[2], device=x.device)

        def blend_into(buf: torch.Tensor, idx: torch.Tensor, new: torch.Tensor) -> None:
            buf.index_copy_(2, idx, torch.where(enable, new, buf.index_select(2, idx)))

        blend_into(self.codes, rows, codes)
        if self.n_outliers:
            blend_into(self.out_val, rows, out_val)
            blend_into(self.out_idx, rows, out_idx)
            if not torch.compiler.is_compiling():
                self.clamped += int(torch.where(enable, clamped, 0))
        if scale is not None:
            r = self.meta_per_row
            meta_rows = torch.div(start, r, rounding_mode="floor") + torch.arange(x.shape[2] // r, device=x.device)
            blend_into(self.scale, meta_rows, scale)
            blend_into(self.zero, meta_rows, zero)

    def nbytes(self) -> int:
        held = (*self.tensors(), *self.sparse(), self.codebook)
        return sum(t.numel() * t.element_size() for t in held)


class QuantizedLayer(CacheLayerMixin):
    """One attention layer's quantized cache.

    `max_cache_len` fixes its capacity (appending past it is an error). Otherwise it starts with
    room for `reserve` tokens (`generate()` reserves the prompt plus max_new_tokens: allocated,
    and zeroed, once) and grows geometrically past that: a growth copies the body once, so the
    copying is amortized O(1) per token, never quadratic in the length.
    """

    # whether the bodies' writers see the whole block (then the native ones check it themselves;
    # a context-parallel layer's bodies code only their own segments)
    writers_refuse_non_finite = True

    is_compileable = False
    is_croppable = True  # crop() restores exactly what a layer without the dropped tokens would hold
    is_sliding = False

    def __init__(self, spec: LayerKV, sink_tokens: int = 0, residual_length: int = 0,
                 scale_dtype: str = "float16", max_cache_len: int | None = None,
                 calibration: tuple[TensorCalibration | None, TensorCalibration | None] = (None, None),
                 rope: tuple[torch.Tensor, float] | None = None, reserve: int | None = None,
                 side_dtype: str = "model"):  # fmt: skip
        super().__init__()
        self.spec = spec
        self.side_dtype_name = side_dtype
        self.calibration = calibration
        # pre-RoPE keys: (inv_freq, attention_scaling) of the model's rotary embedding
        self.rope_inv_freq = rope[0].float() if rope is not None else torch.zeros(0)
        self.rope_scale = float(rope[1]) if rope is not None else 1.0
        self.sink = sink_tokens
        self.residual = residual_length
        self.block = spec.token_block
        self.ring = residual_length + self.block  # see _append_one_static for why not "- 1"
        self.scale_dtype = getattr(torch, scale_dtype)
        # A static layer holds at most `max_cache_len` tokens (what the caller asked for, and what
        # get_max_length() reports); its storage is that rounded up to `static_capacity`.
        self.static_capacity = None
        if max_cache_len is not None:
            if max_cache_len <= 0:
                raise ValueError(f"max_cache_len must be positive, got {max_cache_len}")
            step = math.lcm(_STATIC_STEP, self.block)
            self.static_capacity = math.ceil(max_cache_len / step) * step
        self.max_cache_len = max_cache_len
        if reserve is not None and reserve < 0:
            raise ValueError(f"reserve must be >= 0 tokens, got {reserve}")
        self.reserve = reserve or 0
        self.layer_idx: int | None = None  # set by QuantizedKVCache (error messages name the layer)
        self.cumulative_length: int | torch.Tensor = 0
        self.capacity = 0
        self._record_past = False
        self._checkpoint: _Checkpoint | None = None  # the layer before the first append since the last crop
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # what was appended since, as appended

    # ------------------------------------------------------------------ storage
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        dv = value_states.shape[-1]
        self.spec.key.check_head_dim(d)
        self.spec.value.check_head_dim(dv)
        self.device, self.dtype = key_states.device, key_states.dtype
        self.capacity = self.static_capacity or 0
        if self.rope_inv_freq.numel() not in (0, d // 2):
            raise ValueError(f"rotary inv_freq has {self.rope_inv_freq.numel()} entries, expected head_dim/2 = {d // 2}")
        self.rope_inv_freq = self.rope_inv_freq.to(self.device)
        kc, vc = self.calibration
        self.k_body = _BodyStore(self.spec.key, (b, h), d, self.capacity, self.dtype, self.scale_dtype, self.device, kc)
        self.v_body = _BodyStore(self.spec.value, (b, h), dv, self.capacity, self.dtype, self.scale_dtype, self.device, vc)
        n_side = self.sink + self.ring
        side_dtype = self.dtype if self.side_dtype_name == "model" else getattr(torch, self.side_dtype_name)
        self.side_k = torch.zeros(b, h, n_side, d, dtype=side_dtype, device=self.device)
        self.side_v = torch.zeros(b, h, n_side, dv, dtype=side_dtype, device=self.device)
        self.side_pos = torch.full((n_side,), -1, dtype=torch.int64, device=self.device)
        self.body_end = torch.zeros((), dtype=torch.int64, device=self.device)
        # rotated formats: keys and values are stored x R (`kvq_ao.quant.rotation`); empty: not rotated
        none = torch.zeros(0, 0, device=self.device)
        self.k_rot = rotation.rotation_matrix(d, self.device) if self.spec.key.rotated else none
        self.v_rot = rotation.rotation_matrix(dv, self.device) if self.spec.value.rotated else none
        self.is_initialized = True

    def _boundary(self, length: int) -> int:
        return max(length - self.residual, 0) // self.block * self.block

    def _slot(self, positions: torch.Tensor) -> torch.Tensor:
        ring_slot = self.sink + torch.remainder(positions - self.sink, self.ring)
        return torch.where(positions < self.sink, positions, ring_slot)

    def _capacity_for(self, length: int) -> int:
        if self.static_capacity is not None:
            return self.static_capacity
        if length <= self.capacity:
            return self.capacity
        step = math.lcm(_GROWTH_STEP, self.block)
        want = max(length, self.reserve) if self.capacity == 0 else max(length, self.capacity * _GROWTH_FACTOR)
        return math.ceil(want / step) * step

    def _without_sink(self, x: torch.Tensor, first_pos) -> torch.Tensor:
        """Hide sink tokens from per-channel group ranges by standing in their block's last token."""
        if self.sink == 0 or self.block == 1:
            return x
        b, h, n, d = x.shape
        positions = first_pos + torch.arange(n, device=x.device)
        blocks = x.reshape(b, h, n // self.block, self.block, d)
        stand_in = blocks[:, :, :, -1:, :].expand_as(blocks).reshape(b, h, n, d)
        return torch.where((positions < self.sink).view(1, 1, n, 1), stand_in, x)

    # ------------------------------------------------------------------ update
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.rope_inv_freq.numel():
            key_states = self._unrotate(key_states)
        if self.k_rot.numel():
            key_states = rotation.rotate(key_states, self.k_rot)
        if self.v_rot.numel():
            value_states = rotation.rotate(value_states, self.v_rot)
        if self.side_k.dtype != key_states.dtype:  # what a side store of its dtype would give back, on every path
            key_states = key_states.to(self.side_k.dtype).to(key_states.dtype)
            value_states = value_states.to(self.side_v.dtype).to(value_states.dtype)
        if self._record_past:
            self._record(key_states, value_states)
        if key_states.shape[2] == 1 and isinstance(self.cumulative_length, torch.Tensor):
            self._append_one_static(key_states, value_states)
            return self.keys_values()
        if key_states.shape[2] == 1:  # a decode step reads the cache as it is after the append
            self._append_eager(key_states, value_states)
            return self.keys_values()
        old = int(self.cumulative_length)
        held = self._held_in_full(old)
        self._append_eager(key_states, value_states)
        return self._chunk_views(held, key_states, value_states, old)

    def _held_in_full(self, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys, values, positions) the side store reads in full precision at `length`: the sink
        and the positions not yet quantized, [boundary(length), length)."""
        start = min(max(self._boundary(length), self.sink), length)
        positions = torch.cat([torch.arange(min(self.sink, length)), torch.arange(start, length)])
        positions = positions.to(self.device)
        slots = self._slot(positions)
        return (self.side_k.index_select(2, slots).to(self.dtype), self.side_v.index_select(2, slots).to(self.dtype),
                positions)  # fmt: skip

    def _chunk_views(self, held, k: torch.Tensor, v: torch.Tensor, old: int) -> tuple[QuantizedKV, QuantizedKV]:
        """The views a chunk of queries at positions [old, old + n) attends: each query reads the
        cache as decoding at its own position would, so prefill gives the same result whatever its
        chunking. Query i reads the body below its own boundary(i + 1) and every later key in full
        precision: the chunk's own keys/values and the side entries held before it was appended
        (the window a query looks back on reaches into them)."""
        held_k, held_v, held_pos = held
        new = old + k.shape[2]
        side_k, side_v = torch.cat([held_k, k], dim=2), torch.cat([held_v, v], dim=2)
        side_pos = torch.cat([held_pos, torch.arange(old, new, device=self.device)])
        ends = torch.clamp(torch.arange(old + 1, new + 1, device=self.device) - self.residual, min=0)
        body_end = torch.div(ends, self.block, rounding_mode="floor") * self.block
        return self.keys_values(side=(side_k, side_v, side_pos, body_end))

    def _unrotate(self, k: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE keys from the model's post-RoPE keys, at the positions they will occupy.

        The rotation is undone at the cache position and redone there by attention, so the net
        effect is exact even where the model's position ids differ from cache positions.
        """
        positions = self.cumulative_length + torch.arange(k.shape[2], device=k.device)
        return unrotate(k.float(), positions, self.rope_inv_freq, self.rope_scale).to(k.dtype)

    def ensure_capacity(self, length: int, exact: bool = False) -> None:
        """Make the body hold at least `length` tokens: grown geometrically, or to `length` rounded
        up to the growth step when `exact` (to allocate once ahead of a known length)."""
        if not self.is_initialized:
            raise RuntimeError("ensure_capacity needs an initialized layer (after its first update)")
        step = math.lcm(_GROWTH_STEP, self.block)
        capacity = math.ceil(length / step) * step if exact else self._capacity_for(length)
        if capacity > self.capacity:
            if self.static_capacity is not None:
                raise ValueError(f"static KV cache overflow: {length} tokens requested but the cache was built with "
                                 f"max_cache_len={self.max_cache_len}")  # fmt: skip
            self.k_body.grow(capacity)
            self.v_body.grow(capacity)
            self.capacity = capacity

    def _append_eager(self, k: torch.Tensor, v: torch.Tensor) -> None:
        old = int(self.cumulative_length)
        new = old + k.shape[2]
        if self.max_cache_len is not None and new > self.max_cache_len:
            raise ValueError(
                f"static KV cache overflow: {new} tokens requested but the cache was built with max_cache_len={self.max_cache_len}"
            )
        self.ensure_capacity(new)
        b_old, b_new = self._boundary(old), self._boundary(new)
        if b_new > b_old:
            # positions [b_old, b_new): the oldest held ones from the side store, then new ones (only
            # those rows are read: a decode step takes one row, not the whole window)
            from_side = min(old, b_new) - b_old
            xk, xv = k[:, :, : b_new - old], v[:, :, : b_new - old]
            if from_side > 0:
                slots = self._slot(torch.arange(b_old, b_old + from_side, device=self.device))
                held_k, held_v = self.side_k.index_select(2, slots).to(k.dtype), self.side_v.index_select(2, slots).to(v.dtype)
                xk, xv = (held_k, held_v) if b_new <= old else (torch.cat([held_k, xk], dim=2), torch.cat([held_v, xv], dim=2))
            if self.spec.key.token_block > 1:
                xk = self._without_sink(xk, b_old)
            if self.spec.value.token_block > 1:
                xv = self._without_sink(xv, b_old)
            encoded_k, encoded_v = self._encode_finite(xk, xv, b_old)
            self.k_body.write(b_old, xk, encoded_k)
            self.v_body.write(b_old, xv, encoded_v)
        if new == old + 1 and (old < self.sink or old >= b_new):
            # One token kept in full precision (each decode step of a layer with a recent window):
            # its side slot in Python arithmetic, three row copies, no index tensors.
            slot = old if old < self.sink else self.sink + (old - self.sink) % self.ring
            self.side_k[:, :, slot].copy_(k[:, :, 0])
            self.side_v[:, :, slot].copy_(v[:, :, 0])
            self.side_pos[slot] = old
        else:
            self._keep_in_side(k, v, old, new, b_new)
        self.body_end.fill_(b_new)
        if isinstance(self.cumulative_length, torch.Tensor):
            self.cumulative_length.fill_(new)
        else:
            self.cumulative_length = new

    def _encode_finite(self, xk: torch.Tensor, xv: torch.Tensor, first_pos: int) -> tuple[tuple, tuple]:
        """Both kinds of a block going into the body at first_pos, encoded, NaN/Inf refused before
        either is written (`kvq_ao.finite`). Where the native CPU writers serve (they refuse NaN/Inf
        input in their own pass) nothing else is checked: their refusal is turned into the named
        NonFiniteKVError; elsewhere `refuse_non_finite` checks first. A refused entry in a row
        attention reads from the side store (the sink's, coded by per-token formats) is no error,
        as `_quantized` says: those rows are coded as zeros then."""
        if torch.compiler.is_compiling() or not (self.writers_refuse_non_finite and _native_writers(xk)):
            refuse_non_finite(self._quantized(xk, xv, first_pos), first_pos, self.layer_idx)
            return self.k_body._encode(xk), self.v_body._encode(xv)
        try:
            return self.k_body._encode(xk), self.v_body._encode(xv)
        except ValueError as error:
            if not str(error).startswith(NATIVE_NON_FINITE):
                raise
        blocks = self._quantized(xk, xv, first_pos)
        refuse_non_finite(blocks, first_pos, self.layer_idx)  # names the entry (raises unless it sits in the sink's rows)
        return self.k_body._encode(blocks.get("key", xk)), self.v_body._encode(blocks.get("value", xv))

    def _quantized(self, xk: torch.Tensor, xv: torch.Tensor, first_pos) -> dict[str, torch.Tensor]:
        """Of a block going into the body at first_pos, what is stored quantized and read from there
        (what must be finite): not an unquantized kind, and not the sink's rows, which a per-token
        format codes too but attention reads from the side store (per-channel blocks had them
        replaced already, `_without_sink`)."""
        out = {}
        for kind, x, spec in (("key", xk, self.spec.key), ("value", xv, self.spec.value)):
            if not spec.is_quantized:
                continue
            if self.sink and spec.token_block == 1:
                positions = first_pos + torch.arange(x.shape[2], device=x.device)
                x = torch.where((positions < self.sink).view(1, 1, -1, 1), torch.zeros_like(x), x)
            out[kind] = x
        return out

    def _keep_in_side(self, k: torch.Tensor, v: torch.Tensor, old: int, new: int, b_new: int) -> None:
        """Writes the tokens of positions [old, new) that stay in full precision (the sink, and
        those at or past the body's new end) into their side store slots."""
        positions = torch.arange(old, new, device=self.device)
        keep = (positions < self.sink) | (positions >= b_new)
        kept = positions[keep]
        slots = self._slot(kept)
        self.side_k.index_copy_(2, slots, k[:, :, keep].to(self.side_k.dtype))
        self.side_v.index_copy_(2, slots, v[:, :, keep].to(self.side_v.dtype))
        self.side_pos.index_copy_(0, slots, kept)

    def _append_one_static(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append one token with tensor arithmetic only (compile/export friendly).

        The token is written to the side store first; if that completes a block behind the
        window, the block [end - block, end) is gathered back from the side store and quantized.
        The ring holds residual + block positions, so the block's oldest token is still there
        after this token's write (with residual + block - 1 it would just have been evicted).
        """
        if not torch.compiler.is_compiling() and self.max_cache_len is not None:  # (the requested length: no guard on it)
            if int(self.cumulative_length) >= self.max_cache_len:
                raise ValueError(
                    f"static KV cache overflow: {int(self.cumulative_length) + 1} tokens requested but the cache "
                    f"was built with max_cache_len={self.max_cache_len}"
                )
        pos = self.cumulative_length.reshape(1)
        slot = self._slot(pos)
        self.side_k.index_copy_(2, slot, k.to(self.side_k.dtype))
        self.side_v.index_copy_(2, slot, v.to(self.side_v.dtype))
        self.side_pos.index_copy_(0, slot, pos)
        length = pos + 1
        behind = length - self.residual
        complete = (behind > 0) & (torch.remainder(behind, self.block) == 0)
        if self.static_capacity is not None:
            complete = complete & (behind <= self.static_capacity)
        start = torch.clamp(behind - self.block, min=0)
        block_pos = start + torch.arange(self.block, device=self.device)
        block_slots = self._slot(block_pos)
        xk = self.side_k.index_select(2, block_slots).to(k.dtype)
        xv = self.side_v.index_select(2, block_slots).to(v.dtype)
        if self.spec.key.token_block > 1:
            xk = self._without_sink(xk, start)
        if self.spec.value.token_block > 1:
            xv = self._without_sink(xv, start)
        enable = complete.reshape(())
        if torch.compiler.is_compiling():
            self.k_body.write_block_if(start, xk, enable)
            self.v_body.write_block_if(start, xv, enable)
        elif bool(enable):  # eager: a block that is not kept is neither quantized nor checked
            encoded_k, encoded_v = self._encode_finite(xk, xv, int(start))
            self.k_body.write_block_if(start, xk, enable, encoded_k)
            self.v_body.write_block_if(start, xv, enable, encoded_v)
        end = torch.div(torch.clamp(behind, min=0), self.block, rounding_mode="floor") * self.block
        self.body_end.copy_(end.reshape(()))
        self.cumulative_length.add_(1)

    # ------------------------------------------------------------------ crop (assisted decoding)
    @property
    def record_past(self) -> bool:
        """Whether appends are recorded so that `crop()` can take back any of them (transformers turns
        it on for assisted decoding and off when it hands the cache back)."""
        return self._record_past

    @record_past.setter
    def record_past(self, on: bool) -> None:
        self._record_past = bool(on)
        if not on:
            self._forget_past()

    def activate_past_recording(self) -> None:
        self.record_past = True

    def _forget_past(self) -> None:
        self._checkpoint, self._pending = None, []

    def _record(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._checkpoint is None:
            self._checkpoint = _Checkpoint(int(self.cumulative_length), self.side_k.clone(), self.side_v.clone(),
                                           self.side_pos.clone(), self.clamped_by_kind)  # fmt: skip
        self._pending.append((k, v))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens (transformers' convention: a count <= 0).

        The layer is left exactly as if the dropped tokens had never been appended, so appending
        them again gives bit-identical storage and attention. Positions the drop pulls back behind
        the full-precision window come from the side store if it still holds them (no work but
        moving the length), else from what was recorded since the last crop (`activate_past_recording()`; assisted decoding turns it
        on): the state at that point is restored and the kept appends replayed (re-quantizing
        their full-precision values, never already packed codes). A crop neither can serve raises.
        Every crop ends a recording period: `crop(0)` keeps everything and forgets the record.
        """
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative count of tokens to remove (transformers' "
                             "Cache.crop convention), e.g. crop(-3) drops the last 3")  # fmt: skip
        drop = -int(tokens_to_remove)
        if drop and self.is_initialized:
            length = int(self.cumulative_length)
            if drop > length:
                raise ValueError(f"cannot crop {drop} tokens from a layer that holds {length}")
            if not (self._restore_from_side(length - drop) or self._restore_from_record(length - drop)):
                start = self._checkpoint.length if self._checkpoint is not None else None
                raise ValueError(
                    f"cannot crop the layer back to {length - drop} of its {length} tokens: positions "
                    f"[{self._boundary(length - drop)}, {length - drop}) would return to full precision, but they are "
                    "held only as packed codes"
                    + (f" and the record since the last crop starts at {start} tokens" if start is not None else
                       "; call cache.activate_past_recording() before appending tokens you may crop")
                )  # fmt: skip
        self._forget_past()

    def _set_length(self, length: int) -> None:
        if isinstance(self.cumulative_length, torch.Tensor):
            self.cumulative_length.fill_(length)
        else:
            self.cumulative_length = length
        self.body_end.fill_(self._boundary(length))

    def _restore_from_record(self, target: int) -> bool:
        """Back to the checkpoint, then replay the recorded appends up to `target` tokens."""
        ckpt = self._checkpoint
        if ckpt is None or target < ckpt.length:
            return False
        self.side_k.copy_(ckpt.side_k)
        self.side_v.copy_(ckpt.side_v)
        self.side_pos.copy_(ckpt.side_pos)
        self.k_body.clamped, self.v_body.clamped = ckpt.clamped
        self._set_length(ckpt.length)
        replay = target - ckpt.length
        if replay:
            k = torch.cat([k for k, _ in self._pending], dim=2)[:, :, :replay]
            v = torch.cat([v for _, v in self._pending], dim=2)[:, :, :replay]
            self._append_eager(k, v)
        return True

    def _restore_from_side(self, target: int) -> bool:
        """Without a record: possible when the side store still holds every position the layer at
        `target` tokens reads in full precision, [boundary(target), target)."""
        needed = torch.arange(min(max(self._boundary(target), self.sink), target), target, device=self.device)
        if not bool((self.side_pos.index_select(0, self._slot(needed)) == needed).all()):
            return False
        self.side_pos.masked_fill_(self.side_pos >= target, -1)
        self._set_length(target)
        return True

    # ------------------------------------------------------------------ float view (transformers' keys/values)
    @property
    def keys(self) -> torch.Tensor | None:
        """The cached keys as a float [batch, kv_heads, tokens, head_dim] tensor (post-RoPE), computed
        on access from the quantized storage: what attention reads, not a copy the cache keeps.
        A static layer gives all `max_cache_len` positions (zeros past its length), like StaticLayer."""
        return self._dense(0)

    @keys.setter
    def keys(self, value) -> None:
        self._refuse_assignment("keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        """The cached values as a float tensor, computed on access (see `keys`)."""
        return self._dense(1)

    @values.setter
    def values(self, value) -> None:
        self._refuse_assignment("values", value)

    @staticmethod
    def _refuse_assignment(name: str, value) -> None:
        if value is not None:  # CacheLayerMixin.__init__ assigns None
            raise AttributeError(f"a quantized layer's {name} are computed from its packed storage and cannot be "
                                 "assigned: append through update()")  # fmt: skip

    def _dense(self, which: int) -> torch.Tensor | None:
        if not self.is_initialized:
            return None
        length = self.max_cache_len if self.max_cache_len is not None else int(self.cumulative_length)
        return self.keys_values()[which].dequantize()[:, :, :length]

    # ------------------------------------------------------------------ views
    def keys_values(self, side=None) -> tuple[QuantizedKV, QuantizedKV]:
        """The layer's keys and values as `QuantizedKV` views of its storage; `side` = (keys,
        values, positions, body_end) replaces the side store and body end (see `_chunk_views`)."""
        k, v = self.k_body, self.v_body
        side_k, side_v, side_pos, body_end = side or (self.side_k, self.side_v, self.side_pos, self.body_end)
        shared = dict(side_pos=side_pos, body_end=body_end, body_start=self.sink, logical_dtype=self.dtype)
        keys = QuantizedKV(**k.operand_fields(), side=side_k, rope_inv_freq=self.rope_inv_freq, rope_scale=self.rope_scale,
                           rotation=self.k_rot, **shared)  # fmt: skip
        values = QuantizedKV(**v.operand_fields(), side=side_v, rope_inv_freq=self.rope_inv_freq[:0], rope_scale=1.0,
                             rotation=self.v_rot, **shared)  # fmt: skip
        return keys, values

    @property
    def clamped_by_kind(self) -> tuple[int, int]:
        """(key, value) outlier entries clamped (not kept exact) because their vector's slots were full."""
        return (self.k_body.clamped, self.v_body.clamped) if self.is_initialized else (0, 0)

    @property
    def clamped_outliers(self) -> int:
        return sum(self.clamped_by_kind)

    # ------------------------------------------------------------------ transformers contract
    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.static_capacity is not None:
            return self.static_capacity, 0
        return self._capacity_for(int(self.cumulative_length) + query_length), 0

    def get_seq_length(self) -> int:
        return self.cumulative_length if self.is_initialized else 0

    def get_max_length(self) -> int:
        return self.max_cache_len if self.max_cache_len is not None else -1

    def reset(self) -> None:
        self._forget_past()
        if not self.is_initialized:
            return
        self.k_body.clear()
        self.v_body.clear()
        for t in (self.side_k, self.side_v, self.body_end):
            t.zero_()
        self.side_pos.fill_(-1)
        if isinstance(self.cumulative_length, torch.Tensor):
            self.cumulative_length.zero_()
        else:
            self.cumulative_length = 0

    def _batch_tensors(self) -> list[tuple[object, str]]:
        """(owner, attribute) of every tensor with a batch axis: both bodies and the side store.

        Positions (`side_pos`, `body_end`, the length) are shared by the whole batch: every row
        of a batch has the same length, so beams reorder their contents, never their layout."""
        owners = [(body, name) for body in (self.k_body, self.v_body) for name in ("codes", "scale", "zero", "out_val", "out_idx")]
        # 4-D [batch, heads, positions, ...]; a float body's scale/zero are empty 1-D placeholders
        return [(o, n) for o, n in [*owners, (self, "side_k"), (self, "side_v")] if getattr(o, n).dim() == 4]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i of the batch becomes row beam_idx[i] (in place, so a static
        layer's buffers keep their addresses)."""
        self._forget_past()  # a record of the old batch rows cannot restore the new ones
        if not self.is_initialized:
            return
        for owner, name in self._batch_tensors():
            t = getattr(owner, name)
            t.copy_(t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._forget_past()
        if self.is_initialized:
            for owner, name in self._batch_tensors():
                setattr(owner, name, getattr(owner, name).repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._forget_past()
        if self.is_initialized:
            for owner, name in self._batch_tensors():
                setattr(owner, name, getattr(owner, name)[indices, ...])

    # ------------------------------------------------------------------ memory
    def tensor_bytes(self) -> int:
        """Bytes of every tensor this layer actually holds."""
        if not self.is_initialized:
            return 0
        side = sum(t.numel() * t.element_size() for t in (self.side_k, self.side_v, self.side_pos, self.body_end))
        return self.k_body.nbytes() + self.v_body.nbytes() + side


class QuantizedStaticLayer(QuantizedLayer):
    """Preallocated layer for compiled and exported decoding: fixed shapes, tensor length."""

    is_compileable = True

    def __init__(self, spec: LayerKV, max_cache_len: int, **kwargs):
        super().__init__(spec, max_cache_len=max_cache_len, **kwargs)
        self.cumulative_length = torch.zeros((), dtype=torch.int64)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not torch.compiler.is_compiling():
            for t in (*self.k_body.tensors(), *self.v_body.tensors(), *self.k_body.sparse(), *self.v_body.sparse(),
                      self.side_k, self.side_v, self.side_pos, self.body_end, self.cumulative_length):  # fmt: skip
                torch._dynamo.mark_static_address(t)


class QuantizedKVCache(Cache):
    """A transformers `Cache` whose layers store K/V as `config` says, one spec per layer.

    Pass `max_cache_len` for the static (preallocated, compileable) variant; a dynamic cache
    reserves room for `reserve` tokens up front and grows geometrically past it. The object built
    is a `QuantizedStaticCache` (also a transformers `StaticCache`) or a `QuantizedDynamicCache`
    (also a `DynamicCache`), so code that checks a cache's kind with isinstance sees the kind it
    asked for; both stay `QuantizedKVCache`s.
    """

    def __new__(cls, *args, **kwargs):
        if cls is QuantizedKVCache:  # the public constructor picks the kind; subclasses keep their own
            max_cache_len = kwargs.get("max_cache_len", args[2] if len(args) > 2 else None)
            cls = QuantizedDynamicCache if max_cache_len is None else QuantizedStaticCache
        return super().__new__(cls)

    def __init__(self, config: KVQuantConfig, num_layers: int, max_cache_len: int | None = None,
                 calibration=None, rope=None, reserve: int | None = None):  # fmt: skip
        """rope: for pre-RoPE keys, (inv_freq, attention_scaling) of the model's rotary embedding, or
        a list of one per layer (models that rotate layer types differently, `model_info.rotary_of`)."""
        specs = config.resolve(num_layers)
        if config.needs_calibration and calibration is None:
            raise ValueError(f"config {config.name!r} uses calibrated datatypes or outliers: pass calibration= "
                             "(kvq_ao.calibration / kvq calibrate), or build the cache with kvq_ao.make_cache(model)")  # fmt: skip
        if config.pre_rope_keys and rope is None:
            raise ValueError(f"config {config.name!r} stores pre-RoPE keys: pass rope=(inv_freq, attention_scaling)")
        if calibration is not None:
            calibration.check(config, num_layers)
        common = dict(sink_tokens=config.sink_tokens, residual_length=config.residual_length, scale_dtype=config.scale_dtype,
                      side_dtype=config.side_dtype)  # fmt: skip
        ropes = [None] * num_layers
        if config.pre_rope_keys:
            ropes = list(rope) if isinstance(rope, list) else [rope] * num_layers
            if len(ropes) != num_layers:
                raise ValueError(f"rope lists {len(ropes)} rotary embeddings for a model of {num_layers} layers")

        def layer_calib(i: int):
            return calibration.layer(i) if calibration is not None else (None, None)

        if max_cache_len is None:
            layers = [self._dynamic_layer(s, calibration=layer_calib(i), reserve=reserve, rope=ropes[i], **common)
                      for i, s in enumerate(specs)]  # fmt: skip
        else:
            layers = [QuantizedStaticLayer(s, max_cache_len=max_cache_len, calibration=layer_calib(i), rope=ropes[i], **common)
                      for i, s in enumerate(specs)]  # fmt: skip
        for i, layer in enumerate(layers):
            layer.layer_idx = i
        Cache.__init__(self, layers=layers)  # not the Static/DynamicCache constructors: they build float layers
        self.config = config

    def _dynamic_layer(self, spec: LayerKV, **kwargs) -> QuantizedLayer:
        """One layer of the dynamic cache (subclasses store it differently: `kvq_ao.parallel`)."""
        return QuantizedLayer(spec, **kwargs)

    @property
    def is_static(self) -> bool:
        return isinstance(self.layers[0], QuantizedStaticLayer)

    def tensor_bytes(self) -> int:
        return sum(layer.tensor_bytes() for layer in self.layers)

    @property
    def clamped_by_kind(self) -> tuple[int, int]:
        """(key, value) outlier entries clamped because their vector's slots were full, all layers."""
        kinds = [layer.clamped_by_kind for layer in self.layers]
        return sum(k for k, _ in kinds), sum(v for _, v in kinds)

    @property
    def clamped_outliers(self) -> int:
        return sum(self.clamped_by_kind)

    def memory_report(self):
        from kvq_ao.memory import memory_report

        return memory_report(self)


class QuantizedDynamicCache(QuantizedKVCache, DynamicCache):
    """A dynamic `QuantizedKVCache` (what `QuantizedKVCache(config, n)` builds): grows as tokens arrive."""


class QuantizedStaticCache(QuantizedKVCache, StaticCache):
    """A static `QuantizedKVCache` (what `QuantizedKVCache(config, n, max_cache_len=...)` builds):
    preallocated, compileable and exportable."""


__all__ = ["QuantizedDynamicCache", "QuantizedKVCache", "QuantizedLayer", "QuantizedStaticCache", "QuantizedStaticLayer",
           "TensorCalibration"]  # fmt: skip
