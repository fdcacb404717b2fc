"""Exact merging of attention computed over shards of the token axis, in a process and across ranks.

Softmax attention over keys split into shards S_1..S_n is recovered exactly from each shard's
output o_i (softmax-weighted values over S_i alone) and log-sum-exp l_i of its scaled scores:

    out = sum_i exp(l_i - L) o_i,   L = log sum_i exp(l_i)

(flash-decoding's split-softmax merge, done across shards instead of across a kernel's threads).
`kvq::decode_attention_partial` and `kvq::chunk_attention_partial` give (o_i, l_i) for a shard
whose body index 0 is sequence position `position_offset`, so pre-RoPE keys are rotated at their
true positions. A shard that saw nothing for a query has l_i = -inf and weighs nothing; a query
no shard saw gets zeros, as the unsplit ops give it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def merge_partials(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge shards' (out [..., Tq, Dv], lse [..., Tq]) into the attention over all of them.

    Returns (out float32, lse float32); the lse of the merge lets merges nest (shards within a
    process, then processes)."""
    if len(outs) != len(lses) or not outs:
        raise ValueError(f"merge_partials needs one lse per output and at least one shard, got {len(outs)} and {len(lses)}")
    lse = torch.stack([x.float() for x in lses])
    top = lse.amax(0)
    base = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(lse - base)  # exp(-inf) = 0: an empty shard weighs nothing
    total = weights.sum(0)
    out = sum(w.unsqueeze(-1) * o.float() for w, o in zip(weights, outs))
    out = out / torch.where(total > 0, total, torch.ones_like(total)).unsqueeze(-1)
    return out, torch.where(total > 0, base + torch.log(total), torch.full_like(total, float("-inf")))


class ContextParallelError(RuntimeError):
    """A collective of the context-parallel cache failed: a rank died, hung past the process group's
    timeout, or stopped calling the model in step with the others."""


def gather_merge(out: torch.Tensor, lse: torch.Tensor, group=None) -> torch.Tensor:
    """Merge every rank's (out, lse) of one attention call; each rank gets the same result.

    One collective (an all-gather of out and lse packed together: B x Hq x Tq x (Dv + 1) floats
    per rank, 2.3 KB for a SmolLM2 decode step) rather than two all-reduces: decode steps are
    latency-bound, and every rank merging the same gathered list in rank order gives
    bit-identical results on every rank, so their caches never drift apart."""
    import torch.distributed as dist

    packed = torch.cat([out.float(), lse.float().unsqueeze(-1)], dim=-1).contiguous()
    gathered = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(gathered, packed, group=group)
    except (RuntimeError, dist.DistError) as e:  # a peer died (connection closed) or the group's timeout passed
        raise ContextParallelError(f"rank {dist.get_rank()}: merging attention across {len(gathered)} context-parallel "
                                   f"ranks failed, so a rank has died, hung or left: {e}") from e  # fmt: skip
    merged, _ = merge_partials([g[..., :-1] for g in gathered], [g[..., -1] for g in gathered])
    return merged


__all__ = ["ContextParallelError", "gather_merge", "merge_partials"]
