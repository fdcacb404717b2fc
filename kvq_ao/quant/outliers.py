"""Per-vector dense-and-sparse decomposition (KVQuant): a few outlier entries kept exact.

Two ways to judge which entries are outliers, as in KVQuant:
* by channel (`split_outliers`, KVQuant's keys): calibration gives each channel a range [lo, hi]
  (percentiles of its calibration activations); an entry outside its channel's range is an
  outlier.
* by vector (`split_vector_outliers`, KVQuant's values, whose thresholds are computed online per
  token): the k entries of each vector furthest from the vector's mean, with no calibration.

Each vector (one token of one head, D entries) keeps at most `k` outliers exactly, in a sparse
side structure of fixed size (values [..., k] in the cache dtype, channel indices [..., k]
uint8), so static caches and exported programs hold it as plain fixed-shape tensors. The dense
part is clamped into the channel range (by vector: the range of the rest of its group) before it
is quantized, so a handful of extreme entries no longer stretch the range every other entry is
quantized in.

A vector with more than `k` outliers keeps the `k` that stick out furthest (relative to the
channel range) and the rest stay clamped: bounded memory, no crash, and `split_outliers`
reports how many entries were clamped that way.
"""

from __future__ import annotations

import math

import torch

from kvq_ao.format import MAX_OUTLIER_HEAD_DIM


def outlier_slots(fraction: float, head_dim: int) -> int:
    """Outlier entries kept per vector: ceil(fraction * head_dim), 0 when fraction is 0."""
    if fraction <= 0:
        return 0
    if head_dim > MAX_OUTLIER_HEAD_DIM:
        raise ValueError(f"outliers need head_dim <= {MAX_OUTLIER_HEAD_DIM} (uint8 channel indices), got {head_dim}")
    return min(head_dim, math.ceil(fraction * head_dim - 1e-9))


def split_outliers(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k: int):
    """x [B, H, T, D], channel ranges lo/hi [H, D] -> (dense, values, indices, clamped).

    dense: x clamped into [lo, hi]; values/indices [B, H, T, k]: k exact entries per vector (value
    and channel), its outliers by decreasing excess, then (slots its outliers leave free) its
    lowest-numbered other channels, as every kernel picks them (the largest excess, the lower
    channel on a tie); clamped: int64 count of outlier entries that did not fit in their vector's k
    slots.
    """
    lo4, hi4 = lo.float()[None, :, None, :], hi.float()[None, :, None, :]
    xf = x.float()
    width = torch.clamp(hi4 - lo4, min=torch.finfo(torch.float32).tiny)
    excess = (torch.relu(xf - hi4) + torch.relu(lo4 - xf)) / width
    dense = torch.minimum(torch.maximum(xf, lo4), hi4)
    n_outliers = (excess > 0).sum(-1)
    picks, left = [], excess
    for _ in range(k):  # max returns the first (lowest) channel among equal values, as the kernels do
        pick = left.argmax(-1, keepdim=True)
        picks.append(pick)
        left = left.scatter(-1, pick, -1.0)
    idx = torch.cat(picks, -1) if picks else excess.new_zeros((*excess.shape[:-1], 0), dtype=torch.int64)
    clamped = (n_outliers - k).clamp(min=0).sum()
    return dense, x.gather(-1, idx), idx.to(torch.uint8), clamped


def apply_outliers(dense: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Put the kept outliers back into dense [..., D] (pointwise: one select per slot)."""
    if values.shape[-1] == 0:
        return dense
    channels = torch.arange(dense.shape[-1], device=dense.device)
    idx = indices.long()
    vals = values.to(dense.dtype)
    for j in range(values.shape[-1]):
        dense = torch.where(channels == idx[..., j : j + 1], vals[..., j : j + 1], dense)
    return dense


def split_vector_outliers(x: torch.Tensor, k: int, group: int):
    """x [..., D] -> (dense, values, indices, is_outlier): each vector's k entries furthest from its
    mean kept exact (most distant first, the lower channel on a tie), judged online (no
    calibration), for per-token groups of `group` channels.

    dense: each outlier entry clamped into the range of the other entries of its channel group,
    so it no longer sets that group's quantization range (a group made only of outliers keeps
    its own range). values/indices [..., k] as in `split_outliers`; no entry is ever left over.
    """
    d = x.shape[-1]
    if not 0 < k <= d or d % group:
        raise ValueError(f"per-vector outliers need 0 < k <= head_dim and group | head_dim; got k={k}, group={group}, head_dim={d}")
    xf = x.float()
    # the k furthest, the lower channel first on a tie, as every kernel picks them: k argmax passes
    # (argmax returns the first maximum; topk's order among equal entries is unspecified, and a
    # group of equal entries once came out as 12 before 0; a stable sort does not export to ONNX)
    far = (xf - xf.mean(-1, keepdim=True)).abs()
    channels = torch.arange(d, device=x.device)
    picks = []
    for _ in range(k):
        pick = far.argmax(-1, keepdim=True)
        picks.append(pick)
        far = torch.where(channels == pick, -1.0, far)  # distances are >= 0: a taken channel is never picked again
    idx = torch.cat(picks, dim=-1)
    is_outlier = torch.zeros_like(xf, dtype=torch.bool)
    for j in range(k):  # pointwise (no scatter), as `apply_outliers`
        is_outlier = is_outlier | (channels == idx[..., j : j + 1])
    g = xf.reshape(*xf.shape[:-1], d // group, group)
    m = is_outlier.reshape(g.shape)
    big = torch.finfo(torch.float32).max
    all_out = m.all(-1, keepdim=True)
    lo = torch.where(all_out, g.amin(-1, keepdim=True), torch.where(m, big, g).amin(-1, keepdim=True))
    hi = torch.where(all_out, g.amax(-1, keepdim=True), torch.where(m, -big, g).amax(-1, keepdim=True))
    dense = torch.minimum(torch.maximum(g, lo), hi).reshape(xf.shape)
    return dense, x.gather(-1, idx), idx.to(torch.uint8), is_outlier


__all__ = ["apply_outliers", "outlier_slots", "split_outliers", "split_vector_outliers"]
