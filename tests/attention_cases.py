"""Random cases of the kvq attention ops (named arguments) and their float64 reference, shared by
the op, native-kernel, compile and KVQuant tests."""

import torch

from kvq_ao.ops import ATTENTION_FIELDS, reference_arguments
from kvq_ao.quant.codebook import nf_codebook
from kvq_ao.quant.uniform import AXIS_CHANNEL, AXIS_TOKEN


def attend(named: dict) -> torch.Tensor:
    """The attention op for the case's query length, called with the case's named arguments."""
    op = torch.ops.kvq.decode_attention if named["q"].shape[2] == 1 else torch.ops.kvq.chunk_attention
    return op(**named)


def positional(named: dict) -> tuple:
    """The arguments in schema order (for opcheck and torch.compile'd lambdas)."""
    return tuple(named[n] for n in ATTENTION_FIELDS)


def _quantized(x, bits, axis, group, codebook=None, outliers=0, g=None):
    """(codes, scale, zero, codebook, out_val, out_idx) of x in one format (bits 0: float)."""
    empty = torch.zeros(0)
    if bits == 0:
        return x.clone(), None, None, None, None, None
    cb = empty if codebook is None else codebook
    lo = hi = empty
    if outliers:  # thresholds that make a few entries per vector outliers
        lo = -1.5 * torch.ones(x.shape[1], x.shape[-1])
        hi = 1.5 * torch.ones(x.shape[1], x.shape[-1])
    codes, scale, zero, out_val, out_idx, _ = torch.ops.kvq.quantize(x, bits, axis, group, torch.float16, cb, lo, hi, outliers)
    if not outliers:
        out_val = out_idx = None
    return codes, scale, zero, codebook, out_val, out_idx


def attention_case(seed, tq, bits_k=4, bits_v=4, k_axis=AXIS_CHANNEL, v_axis=AXIS_TOKEN, hq=6, hkv=2, t=64, d=32, n_side=5,
          body_start=1, body_end=40, head_mask=False, codebook=False, outliers=0, pre_rope=False, softcap=0.0):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hq, tq, d, generator=g)
    k = torch.randn(2, hkv, t, d, generator=g) * 2
    v = torch.randn(2, hkv, t, d, generator=g)
    cb_k = nf_codebook(bits_k) if codebook and bits_k in (2, 3, 4) else None
    cb_v = nf_codebook(bits_v) if codebook and bits_v in (2, 3, 4) else None
    kq = _quantized(k, bits_k, k_axis, 16, cb_k, outliers)
    vq = _quantized(v, bits_v, v_axis, 16, cb_v, outliers)
    side_k = torch.randn(2, hkv, n_side, d, generator=g)
    side_v = torch.randn(2, hkv, n_side, d, generator=g)
    # sink at position 0, window positions 40..42, one empty slot
    side_pos = torch.tensor([0, 40, 41, 42, -1])
    total = 43
    q_pos = torch.arange(total - tq, total)
    mask = (torch.arange(t)[None, :] <= q_pos[:, None]).expand(2, hq if head_mask else 1, tq, t).clone()
    if head_mask:
        mask[:, 1, :, 5:9] = False
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)) if pre_rope else None
    named = dict(q=q, side_k=side_k, side_v=side_v, side_pos=side_pos, body_end=torch.tensor(body_end), mask=mask,
                 rope_inv_freq=inv_freq, body_start=body_start, scaling=d**-0.5, rope_scale=1.25 if pre_rope else 1.0,
                 k_bits=bits_k, k_axis=k_axis, k_group=16, v_bits=bits_v, v_axis=v_axis, v_group=16, softcap=softcap)  # fmt: skip
    for prefix, parts in (("k", kq), ("v", vq)):
        for name, tensor in zip(("codes", "scale", "zero", "codebook", "out_val", "out_idx"), parts):
            named[f"{prefix}_{name}"] = tensor
    return named


def _rotate64(x, positions, inv_freq, scale):
    """RoPE in float64, written out as the rotation of channel pairs (i, i + D/2)."""
    half = x.shape[-1] // 2
    ang = positions.double()[:, None] * inv_freq.double()[None, :]
    c, s = torch.cos(ang) * scale, torch.sin(ang) * scale
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def reference_attention(named):
    """float64: build logical K/V (body in [start, end), side elsewhere) and do softmax attention."""
    a = reference_arguments(named)
    k = torch.ops.kvq.dequantize(a["k_codes"], a["k_scale"], a["k_zero"], a["k_codebook"], a["k_out_val"],
                                 a["k_out_idx"], a["k_bits"], a["k_axis"], a["k_group"], torch.float64)  # fmt: skip
    v = torch.ops.kvq.dequantize(a["v_codes"], a["v_scale"], a["v_zero"], a["v_codebook"], a["v_out_val"],
                                 a["v_out_idx"], a["v_bits"], a["v_axis"], a["v_group"], torch.float64)  # fmt: skip
    side_k, side_v, side_pos = a["side_k"].double(), a["side_v"].double(), a["side_pos"]
    t = k.shape[2]
    if a["rope_inv_freq"].numel():  # keys stored pre-RoPE: rotate every key at its own position
        k = _rotate64(k, torch.arange(t), a["rope_inv_freq"], a["rope_scale"])
        side_k = _rotate64(side_k, side_pos.clamp(min=0), a["rope_inv_freq"], a["rope_scale"])
    body_start, body_end, q = a["body_start"], int(a["body_end"]), a["q"]
    valid = torch.zeros(t, dtype=torch.bool)
    valid[body_start:body_end] = True
    for i, p in enumerate(side_pos.tolist()):
        if p >= 0 and not (body_start <= p < body_end):
            k[:, :, p], v[:, :, p] = side_k[:, :, i], side_v[:, :, i]
            valid[p] = True
    n = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n, 1), v.repeat_interleave(n, 1)
    scores = (q.double() @ k.transpose(-1, -2)) * a["scaling"]
    if a["softcap"]:  # Gemma-2's attention logit soft-capping
        scores = a["softcap"] * torch.tanh(scores / a["softcap"])
    scores = scores.masked_fill(~(a["mask"] & valid), float("-inf"))
    return torch.softmax(scores, -1).nan_to_num(0.0) @ v  # a query that sees nothing gets zeros
