"""Composite (core ATen only) implementations of the kvq ops.

These are the reference semantics of every op and what CPU runs today; they are written so
that inductor can fuse them and torch.export / ExecuTorch / ONNX can take them: no bit shifts,
no `torch.tensor` constants, no data-dependent Python control flow.

Cache layout read by `attention` (one layer, one of K or V):
* body: all positions [0, T) of the layer's capacity, as packed codes + scale + zero
  (`bits == 0` means the body is already floating point and scale/zero are empty);
  only positions in [body_start, body_end) are read from it.
* side: full-precision entries (sink tokens and the recent window) with their positions in
  `side_pos` (-1 = empty); an entry is read when its position is outside [body_start, body_end).
"""

from __future__ import annotations

import torch

from kvq_ao.quant.uniform import dequantize_uniform, quantize_uniform


def quantize(x: torch.Tensor, bits: int, axis: int, group: int, scale_dtype: torch.dtype):
    return quantize_uniform(x, bits, axis, group, scale_dtype)


def dequantize(codes, scale, zero, bits: int, axis: int, group: int, dtype: torch.dtype) -> torch.Tensor:
    if bits == 0:
        return codes.to(dtype)
    return dequantize_uniform(codes, scale, zero, bits, axis, group, dtype)


def _masks(mask, side_pos, body_start: int, body_end, t: int):
    """Which body positions and side entries each query may read: ([B,h,Tq,T], [B,h,Tq,S])."""
    positions = torch.arange(t, device=mask.device)
    body_ok = (positions >= body_start) & (positions < body_end)
    side_ok = (side_pos >= 0) & ((side_pos < body_start) | (side_pos >= body_end))
    side_cols = mask.index_select(-1, side_pos.clamp(min=0))
    return mask & body_ok, side_cols & side_ok


def attention(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    k_zero: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    v_zero: torch.Tensor,
    side_k: torch.Tensor,
    side_v: torch.Tensor,
    side_pos: torch.Tensor,
    body_end: torch.Tensor,
    mask: torch.Tensor,
    body_start: int,
    scaling: float,
    k_bits: int,
    k_axis: int,
    k_group: int,
    v_bits: int,
    v_axis: int,
    v_group: int,
) -> torch.Tensor:
    """Attention of q [B, Hq, Tq, D] over a quantized cache -> [B, Hq, Tq, Dv] in q's dtype.

    GQA: Hq must be a multiple of the cache's Hkv. `mask` is bool [B, 1 or Hq, Tq, T] (True =
    may attend) over the body's T positions; side entries use the mask column of their position.
    Queries with nothing to attend to return zeros (left padding).
    """
    b, hq, tq, d = q.shape
    k = dequantize(k_codes, k_scale, k_zero, k_bits, k_axis, k_group, torch.float32)
    v = dequantize(v_codes, v_scale, v_zero, v_bits, v_axis, v_group, torch.float32)
    hkv, t = k.shape[1], k.shape[2]
    n = hq // hkv
    body_mask, side_mask = _masks(mask, side_pos, body_start, body_end, t)
    qf = q.float().reshape(b, hkv, n, tq, d)
    sk, sv = side_k.float(), side_v.float()
    if tq == 1:
        # Pointwise + reductions: inductor fuses unpack, dequantize, scores, softmax and the
        # weighted sum into one loop without a [T, D] float buffer (SDPA would need one).
        qv = qf[:, :, :, 0, :]
        s_body = (qv.unsqueeze(3) * k.unsqueeze(2)).sum(-1) * scaling  # [B, Hkv, n, T]
        s_side = (qv.unsqueeze(3) * sk.unsqueeze(2)).sum(-1) * scaling  # [B, Hkv, n, S]
        # mask heads: 1 (shared) or Hq -> broadcast against [B, Hkv, n, positions]
        heads = (hkv, n) if body_mask.shape[1] > 1 else (1, 1)
        s_body = s_body.masked_fill(~body_mask.reshape(b, *heads, t), float("-inf"))
        s_side = s_side.masked_fill(~side_mask.reshape(b, *heads, side_pos.shape[0]), float("-inf"))
        scores = torch.cat([s_body, s_side], dim=-1)
        top = scores.amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        p = torch.exp(scores - top)
        denom = p.sum(-1, keepdim=True)
        p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
        p_body, p_side = p[..., :t], p[..., t:]
        out = (p_body.unsqueeze(-1) * v.unsqueeze(2)).sum(-2) + (p_side.unsqueeze(-1) * sv.unsqueeze(2)).sum(-2)
        return out.reshape(b, hq, 1, -1).to(q.dtype)
    keys = torch.cat([k, sk], dim=2)
    values = torch.cat([v, sv], dim=2)
    full_mask = torch.cat([body_mask, side_mask], dim=-1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float(), keys, values, attn_mask=full_mask, scale=scaling, enable_gqa=True
    )
    any_key = full_mask.any(-1, keepdim=True)
    out = torch.where(any_key, out, torch.zeros_like(out))
    return out.to(q.dtype)
