"""A quantized cache split along the token axis over the ranks of a torch.distributed process group.

Every rank runs the whole model on the same tokens (weights replicated), so every rank computes
the same keys and values and keeps the same small full-precision side store (sink and window).
Only the packed body is split: it is cut into segments of `segment` positions dealt round-robin
to the ranks (segment j on rank j mod world). Why round-robin segments rather than one contiguous
range per rank:
* load balance at every length: the ranks' shares of a cache of any length differ by at most
  one segment, so a decode step (bound by the busiest rank) costs ~1/world of the whole at every
  length, not only once the cache is full; nothing is ever moved to rebalance;
* where new tokens land: a block falling behind the window is quantized and stored by its
  segment's owner alone, so appending costs one rank the quantization and the others nothing;
* each segment is contiguous, so the kernels stream it as they stream a whole cache, with
  `position_offset` = its first position (RoPE of pre-RoPE keys at their true positions).
Attention over the layer is each rank's partial result over its segments (and rank 0's over the
side store), merged exactly by their log-sum-exp (`kvq_ao.parallel.merge`).

The layer is dynamic (grows as tokens arrive) and eager: `torch.compile` and export keep the
single-process caches.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

import torch

from kvq_ao.cache import QuantizedKVCache, QuantizedLayer, _BodyStore


@dataclass(frozen=True, eq=False)
class ShardPlan:
    """Which body positions this rank holds: segments j with j % world == rank."""

    rank: int
    world: int
    segment: int
    group: object = None  # the torch.distributed process group (None: the default group)

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world}")
        if self.segment < 1:
            raise ValueError(f"segment must be a positive number of tokens, got {self.segment}")

    def owns(self, position: int) -> bool:
        return (position // self.segment) % self.world == self.rank

    def local(self, position: int) -> int:
        """Where an owned position sits in this rank's store (its segments back to back)."""
        j = position // self.segment
        return (j // self.world) * self.segment + position % self.segment

    def local_capacity(self, capacity: int) -> int:
        segments = math.ceil(capacity / self.segment)
        return max(0, math.ceil((segments - self.rank) / self.world)) * self.segment

    def segments(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """(first position, first local index) of this rank's segments that overlap [lo, hi)."""
        first = lo // self.segment
        return [(j * self.segment, (j // self.world) * self.segment)
                for j in range(first + (self.rank - first) % self.world, math.ceil(hi / self.segment), self.world)]  # fmt: skip


class SegmentedBody:
    """A `_BodyStore` holding only this rank's segments, addressed by global positions."""

    def __init__(self, store: _BodyStore, plan: ShardPlan):
        self.store, self.plan, self.spec = store, plan, store.spec

    @property
    def codebook(self) -> torch.Tensor:
        return self.store.codebook

    @property
    def clamped(self) -> int:
        return self.store.clamped

    @clamped.setter
    def clamped(self, count: int) -> None:  # a crop restores the count with the rest
        self.store.clamped = count

    def op_format(self) -> tuple[int, int, int, int, int]:
        return self.store.op_format()

    def tensors(self):
        return self.store.tensors()

    def operand_fields(self) -> dict:
        """The local store's operand fields (`_BodyStore.operand_fields`), indexed locally."""
        return self.store.operand_fields()

    def sparse(self):
        return self.store.sparse()

    def clear(self) -> None:
        self.store.clear()

    def nbytes(self) -> int:
        return self.store.nbytes()

    def grow(self, capacity: int) -> None:
        local = self.plan.local_capacity(capacity)
        if local > self.store.codes.shape[2]:
            self.store.grow(local)

    def _encode(self, x: torch.Tensor) -> None:
        """Nothing ahead of `write`, which codes only the owned parts."""
        return None

    def write(self, start: int, x: torch.Tensor, encoded: None = None) -> None:
        """Quantize and keep the owned parts of x [B, H, n, D] at positions [start, start + n)."""
        end, pos = start + x.shape[2], start
        while pos < end:
            stop = min((pos // self.plan.segment + 1) * self.plan.segment, end)
            if self.plan.owns(pos):
                self.store.write(self.plan.local(pos), x[:, :, pos - start : stop - start])
            pos = stop

    def write_block_if(self, *args, **kwargs) -> None:
        raise NotImplementedError("a context-parallel cache is dynamic: the static (compiled) decode step is single-process")


class ContextParallelLayer(QuantizedLayer):
    """One layer's cache with its body split over the ranks of `plan` (see the module docstring).

    `update()` returns `ShardedKV` views that the "kvq" attention function hands to
    `kvq_ao.parallel.attention.sharded_attention`."""

    writers_refuse_non_finite = False  # its bodies code only their own segments: the Python check sees the whole block

    def __init__(self, spec, plan: ShardPlan, **kwargs):
        if kwargs.get("max_cache_len") is not None:
            raise ValueError("a context-parallel cache is dynamic: pass reserve=, not max_cache_len=")
        super().__init__(spec, **kwargs)
        if plan.segment % self.block:
            raise ValueError(f"segment ({plan.segment} tokens) must be a multiple of the layer's {self.block}-token "
                             "quantization block")  # fmt: skip
        self.plan = plan

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.k_body = SegmentedBody(self.k_body, self.plan)
        self.v_body = SegmentedBody(self.v_body, self.plan)

    def keys_values(self, side=None):
        from kvq_ao.parallel.attention import ShardedKV

        side_k, side_v, side_pos, body_end = side or (self.side_k, self.side_v, self.side_pos, self.body_end)
        return ShardedKV(self, side_k, side_pos, body_end), ShardedKV(self, side_v, side_pos, body_end)

    def _dense(self, which: int):
        raise NotImplementedError("a context-parallel layer's keys/values live on several ranks: no float view of "
                                  "them exists on one (attention merges the ranks' partial results instead)")  # fmt: skip

    def _batch_tensors(self):
        owners = [(body.store, name) for body in (self.k_body, self.v_body) for name in ("codes", "scale", "zero", "out_val", "out_idx")]
        return [(o, n) for o, n in [*owners, (self, "side_k"), (self, "side_v")] if getattr(o, n).dim() == 4]


def _plan(group, segment: int) -> ShardPlan:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialized")
        return ShardPlan(0, 1, segment)
    return ShardPlan(dist.get_rank(group), dist.get_world_size(group), segment, group)


def _fingerprint(config, num_layers: int, segment: int, calibration) -> str:
    digest = hashlib.sha256(json.dumps([config.to_dict(), num_layers, segment], sort_keys=True).encode())
    if calibration is not None:
        for name in sorted(calibration.tensors):
            digest.update(name.encode())
            digest.update(calibration.tensors[name].float().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


class ContextParallelCache(QuantizedKVCache):
    """A `QuantizedKVCache` whose bodies are split over the ranks of a process group (default: the
    default group; none initialized: world size 1, the ordinary single-process cache in this form).

    Building it is a collective: every rank must build it, with the same config, calibration,
    layer count and segment, or every rank gets a ValueError naming the ranks that differ."""

    def __init__(self, config, num_layers: int, group=None, segment: int = 32768, calibration=None, rope=None,
                 reserve: int | None = None):  # fmt: skip
        self.plan = _plan(group, segment)
        _check_same_on_every_rank(self.plan, _fingerprint(config, num_layers, segment, calibration))
        super().__init__(config, num_layers, calibration=calibration, rope=rope, reserve=reserve)

    def _dynamic_layer(self, spec, **kwargs) -> ContextParallelLayer:
        return ContextParallelLayer(spec, self.plan, **kwargs)


def _check_same_on_every_rank(plan: ShardPlan, fingerprint: str) -> None:
    if plan.world == 1:
        return
    import torch.distributed as dist

    everyone: list = [None] * plan.world
    dist.all_gather_object(everyone, fingerprint, group=plan.group)
    differ = [r for r, f in enumerate(everyone) if f != everyone[0]]
    if differ:
        raise ValueError(f"context-parallel ranks disagree: rank(s) {differ} built the cache with a different config, "
                         f"calibration, layer count or segment than rank 0 (fingerprints {everyone}); every rank must "
                         "build the same cache")  # fmt: skip


def make_context_parallel_cache(model, group=None, segment: int = 32768, reserve: int | None = None) -> ContextParallelCache:
    """A fresh context-parallel cache for a `quantize_kv_`'d model (call on every rank)."""
    from kvq_ao.api import calibration_for, rope_for
    from kvq_ao.model_info import check_model, model_dims

    config = getattr(model, "kvq_config", None)
    if config is None:
        raise ValueError("call quantize_kv_(model, config) first")
    check_model(model, config)
    return ContextParallelCache(config, model_dims(model)[0], group=group, segment=segment, reserve=reserve,
                                calibration=calibration_for(model, config), rope=rope_for(model, config))  # fmt: skip


__all__ = ["ContextParallelCache", "ContextParallelLayer", "SegmentedBody", "ShardPlan", "make_context_parallel_cache"]
