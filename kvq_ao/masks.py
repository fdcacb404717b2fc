"""Attention masks as key-position bounds: what a query may read, without a [queries, length] tensor.

transformers builds a dense bool mask [batch, 1, q_len, kv_len] per layer type. For a chunk of
512 queries over a 1M-token cache that is 512 MB per call, more than the quantized cache it
guards. Causal, sliding-window and left-padding masks are intervals: query i of batch row b may
read key positions lo <= p < hi. `bounds` ([batch, 1, q_len, 2] int64, lo and hi) is that form
(4-D like the dense mask, so transformers passes a prepared one through as it is);
the attention ops take either it or the dense bool mask, and apply bounds blockwise inside.

`interval_bounds` derives the bounds from the arguments transformers hands a mask function
and returns None for anything it cannot prove is an interval (a mask function it does not
know, padding with holes); the caller then builds the dense mask, which is correct, only larger.
"""

from __future__ import annotations

from typing import Callable

import torch


def is_bounds(mask: torch.Tensor) -> bool:
    """Whether `mask` is key-position bounds [batch, 1, q_len, 2] int64 rather than a dense bool mask."""
    return mask.dtype == torch.int64


def allowed(bounds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """bounds [B, 1, Tq, 2] and key positions [L] -> bool [B, 1, Tq, L]: which query may read which key."""
    return (positions >= bounds[..., 0:1]) & (positions < bounds[..., 1:2])


def dense(bounds: torch.Tensor, kv_length: int) -> torch.Tensor:
    """The dense bool mask [B, 1, Tq, kv_length] the bounds stand for."""
    return allowed(bounds, torch.arange(kv_length, device=bounds.device))


def _left_padding(attention_mask: torch.Tensor | None, batch_size: int, end: int, device) -> torch.Tensor | None:
    """Per-row count of leading padding positions of a 2D mask, or None if a row has holes after
    its first real token (not left padding: no interval describes it)."""
    if attention_mask is None:
        return torch.zeros(batch_size, dtype=torch.int64, device=device)
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch_size:
        return None
    real = attention_mask[:, :end].bool()
    if real.shape[-1] < end:  # positions past the 2D mask's end are real (transformers pads them with ones)
        real = torch.nn.functional.pad(real, (0, end - real.shape[-1]), value=True)
    pad = (~real).cumprod(-1).sum(-1)  # leading False count
    if bool((real.sum(-1) != end - pad).any()):
        return None
    return pad.to(device=device, dtype=torch.int64)


def interval_bounds(batch_size: int, q_length: int, q_offset, kv_offset: int, mask_function: Callable,
                    attention_mask: torch.Tensor | None, local_size: int | None, device) -> torch.Tensor | None:  # fmt: skip
    """Bounds [B, 1, q_len, 2] for a causal (or, with local_size, sliding-window causal) mask over
    left-padded rows, or None when that is not what `mask_function` computes.

    The guess is checked against `mask_function` itself at each query's first and last readable
    key and their outer neighbours (4 columns per query, not q_len x kv_len): a chunked, bidirectional
    or custom mask disagrees there and gets None.
    """
    if kv_offset != 0:
        return None
    q_pos = torch.arange(q_length, device=device) + q_offset
    end = int(q_pos[-1]) + 1
    pad = _left_padding(attention_mask, batch_size, end, device)
    if pad is None:
        return None
    lo = torch.maximum(pad.view(-1, 1), q_pos.view(1, -1) - local_size + 1 if local_size else torch.zeros_like(q_pos).view(1, -1))
    hi = (q_pos + 1).view(1, -1).expand(batch_size, -1)
    lo = torch.minimum(lo, hi)  # a fully padded query reads nothing: lo == hi
    bounds = torch.stack([lo, hi], dim=-1).unsqueeze(1)
    # check: the mask function (and the padding) must allow exactly [lo, hi) at its edges
    cols = torch.stack([lo - 1, lo, hi - 1, hi], dim=-1)  # [B, Tq, 4]
    expect = torch.stack([torch.zeros_like(lo, dtype=torch.bool), lo < hi, lo < hi, torch.zeros_like(lo, dtype=torch.bool)], -1)
    b_idx = torch.arange(batch_size, device=device).view(-1, 1, 1)
    real = torch.ones(batch_size, end, dtype=torch.bool, device=device)
    if attention_mask is not None:
        n = min(attention_mask.shape[-1], end)
        real[:, :n] = attention_mask[:, :n].bool()
    in_range = (cols >= 0) & (cols < end)  # columns outside [0, end) are never readable
    safe = cols.clamp(0, end - 1)
    got = mask_function(b_idx, 0, q_pos.view(1, -1, 1), safe) & real[b_idx, safe] & in_range
    return bounds if bool((got == expect).all()) else None


__all__ = ["allowed", "dense", "interval_bounds", "is_bounds"]
