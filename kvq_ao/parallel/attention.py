"""Attention of a query over a context-parallel layer: partials over this rank's segments (the native
partial kernels), rank 0's partial over the side store, one exact merge across ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvq_ao import masks
from kvq_ao.format import Operand
from kvq_ao.kernels import reference
from kvq_ao.ops import attention_arguments
from kvq_ao.parallel.merge import gather_merge, merge_partials
from kvq_ao.quant import rotation
from kvq_ao.quant.rope import rotate


@dataclass
class ShardedKV:
    """What a context-parallel layer's `update()` returns for keys (or values): the layer (its
    segmented bodies) and the side store the query reads, with the body end of each query."""

    layer: object
    side: torch.Tensor
    side_pos: torch.Tensor
    body_end: torch.Tensor  # 0-dim, or one per query of a chunk


def _operand(body, side: torch.Tensor, local: int, length: int) -> Operand:
    """Positions [local, local + length) of a segmented body as an attention operand (with `side`)."""
    whole = Operand(**body.operand_fields(), side=side)
    sliced = reference.body_slice(whole, local, local + length)
    present = lambda t: t if t.numel() else None  # noqa: E731
    slots = sliced.out_val.shape[-1] > 0
    return sliced.replace(scale=present(sliced.scale), zero=present(sliced.zero), codebook=present(sliced.codebook),
                          out_val=sliced.out_val if slots else None, out_idx=sliced.out_idx if slots else None)  # fmt: skip


def _side_partial(query, key: ShardedKV, value: ShardedKV, mask, scaling: float, softcap: float):
    """(out, lse) over the side entries each query reads: the sink and the positions at or past its
    body end, where its mask allows (as the attention ops read the side store)."""
    layer, pos = key.layer, key.side_pos
    read = (pos >= 0) & ((pos < layer.sink) | (pos >= key.body_end.reshape(-1, 1)))  # [1 or Tq, S]
    allowed = masks.allowed(mask, pos) if masks.is_bounds(mask) else mask.index_select(-1, pos.clamp(min=0))
    sk = key.side.float()
    if layer.rope_inv_freq.numel():
        sk = rotate(sk, pos.clamp(min=0), layer.rope_inv_freq, layer.rope_scale)
    n = query.shape[1] // sk.shape[1]
    return reference.block_attention(query.float(), sk.repeat_interleave(n, 1), value.side.float().repeat_interleave(n, 1),
                                      allowed & read, scaling, softcap)  # fmt: skip


def sharded_attention(query: torch.Tensor, key: ShardedKV, value: ShardedKV, mask: torch.Tensor, scaling: float,
                      softcap: float = 0.0) -> torch.Tensor:  # fmt: skip
    """Attention of query [B, Hq, Tq, D] over a context-parallel layer -> [B, Hq, Tq, Dv] in query's
    dtype, the same on every rank (a collective: every rank of the layer's group must call it)."""
    layer = key.layer
    if layer.k_rot.numel():  # rotated formats (kvq_ao.quant.rotation): the query as the keys are stored
        query = rotation.rotate(query, layer.k_rot)
    plan = layer.plan
    ends = key.body_end
    decode = query.shape[2] == 1
    op = torch.ops.kvq.decode_attention_partial if decode else torch.ops.kvq.chunk_attention_partial
    b, hkv, d = query.shape[0], layer.side_k.shape[1], layer.side_k.shape[-1]
    no_side_k, no_side_v = layer.side_k.new_zeros(b, hkv, 1, d), layer.side_v.new_zeros(b, hkv, 1, layer.side_v.shape[-1])
    no_side_pos = torch.full((1,), -1, dtype=torch.int64, device=query.device)
    rope = layer.rope_inv_freq if layer.rope_inv_freq.numel() else None
    outs, lses = [], []
    for offset, local in plan.segments(layer.sink, int(ends.max())):
        length = min(plan.segment, layer.capacity - offset)
        start = min(max(layer.sink - offset, 0), length)
        shard_mask = (mask - offset).clamp(0, length) if masks.is_bounds(mask) else mask[..., offset : offset + length]
        named = attention_arguments(
            query, _operand(layer.k_body, no_side_k, local, length), _operand(layer.v_body, no_side_v, local, length),
            side_pos=no_side_pos, body_end=(ends - offset).clamp(start, length), mask=shard_mask, rope_inv_freq=rope,
            body_start=start, scaling=float(scaling), rope_scale=float(layer.rope_scale), softcap=float(softcap),
        )  # fmt: skip
        out, lse = op(**named, position_offset=offset)
        outs.append(out)
        lses.append(lse)
    if plan.rank == 0:
        out, lse = _side_partial(query, key, value, mask, scaling, softcap)
        outs.append(out)
        lses.append(lse)
    if not outs:  # this rank holds nothing the queries read yet
        outs.append(query.new_zeros(*query.shape[:-1], layer.side_v.shape[-1], dtype=torch.float32))
        lses.append(query.new_full(query.shape[:-1], float("-inf"), dtype=torch.float32))
    out, lse = merge_partials(outs, lses)
    if plan.world > 1:
        out = gather_merge(out, lse, plan.group)
    out = out.to(query.dtype)
    return rotation.unrotate(out, layer.v_rot) if layer.v_rot.numel() else out


__all__ = ["ShardedKV", "sharded_attention"]
