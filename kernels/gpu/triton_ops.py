"""`kvq::triton_decode_attention`: the Triton decode attention as a `torch.library.triton_op`.

A triton_op (not a custom_op with an opaque CUDA kernel) because torch.compile then traces into
it: AOTAutograd replaces the op by its Triton kernel launches, so inductor schedules them with the
rest of the graph and CUDA graphs capture them. It takes exactly the arguments of
`kvq::decode_attention` (the schema is inferred from the signature below and checked against
`kvq_ao.ops.ATTENTION_SCHEMA` by the tests), validates them with the same shared checks, and on CPU
tensors runs the same kernels in Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
from torch.library import triton_op, wrap_triton

from kvq_ao.kernels.gpu import triton_attention as kernels
from kvq_ao.ops import _check_attention

BLOCK_T = 64  # body tokens per step of a split program
BLOCK_S = 32  # side entries per step of the merge program
SPLITS_PER_SM = 4  # split programs per streaming multiprocessor (flash-decoding's occupancy rule)
INTERPRETER_SPLITS = 3  # on CPU: enough splits that the merge is exercised, few enough to be quick


def _launcher(name: str, like: torch.Tensor):
    """Kernel `name` as torch.compile sees it (traced, CUDA) or, for real CPU tensors, interpreted."""
    from torch._subclasses.fake_tensor import is_fake

    if like.device.type == "cpu" and not is_fake(like):
        return kernels.interpreted(name)
    return wrap_triton(getattr(kernels, name))


def _splits(q: torch.Tensor, rows: int, capacity: int) -> int:
    blocks = max(1, triton.cdiv(capacity, BLOCK_T))
    if q.device.type != "cuda":
        return min(INTERPRETER_SPLITS, blocks)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return max(1, min(blocks, SPLITS_PER_SM * sms // rows))


def _format(named: dict, prefix: str, dummy: torch.Tensor) -> tuple[list[torch.Tensor], dict]:
    """One operand's tensors (absent ones replaced by a dummy pointer the kernel never reads) and its
    compile-time format."""
    tensors = [named[f"{prefix}_{f}"] for f in ("codes", "scale", "zero", "codebook", "out_val", "out_idx")]
    tensors = [dummy if t is None else t.contiguous() for t in tensors]
    if named[f"{prefix}_codebook"] is not None:
        tensors[3] = tensors[3].float()
    out_val = named[f"{prefix}_out_val"]
    fmt = dict(BITS=named[f"{prefix}_bits"], AXIS=named[f"{prefix}_axis"], GROUP=named[f"{prefix}_group"],
               CODEBOOK=named[f"{prefix}_codebook"] is not None, OUT=0 if out_val is None else out_val.shape[-1])  # fmt: skip
    return tensors, {f"{prefix.upper()}_{k}": v for k, v in fmt.items()}


@triton_op("kvq::triton_decode_attention", mutates_args=())
def triton_decode_attention(
    q: torch.Tensor,
    k_codes: torch.Tensor, k_scale: torch.Tensor | None, k_zero: torch.Tensor | None, k_codebook: torch.Tensor | None,
    k_out_val: torch.Tensor | None, k_out_idx: torch.Tensor | None,
    v_codes: torch.Tensor, v_scale: torch.Tensor | None, v_zero: torch.Tensor | None, v_codebook: torch.Tensor | None,
    v_out_val: torch.Tensor | None, v_out_idx: torch.Tensor | None,
    side_k: torch.Tensor, side_v: torch.Tensor, side_pos: torch.Tensor, body_end: torch.Tensor, mask: torch.Tensor,
    rope_inv_freq: torch.Tensor | None, body_start: int, scaling: float, rope_scale: float,
    k_bits: int, k_axis: int, k_group: int, v_bits: int, v_axis: int, v_group: int, softcap: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """`kvq::decode_attention` (same arguments, same result) in Triton: q [B, Hq, 1, D] over one
    layer's packed cache -> [B, Hq, 1, Dv] in q's dtype."""
    named = dict(locals())
    _check_attention(named, decode=True)
    b, hq, _, d = q.shape
    hkv, t = k_codes.shape[1], k_codes.shape[2]
    n, dv, s = hq // hkv, side_v.shape[-1], side_pos.shape[0]
    q = q.contiguous()
    k_tensors, k_fmt = _format(named, "k", q)
    v_tensors, v_fmt = _format(named, "v", q)
    mask_u8 = mask.contiguous().view(torch.uint8)
    inv_freq = q if rope_inv_freq is None else rope_inv_freq.float().contiguous()
    np_, dh, bdv = triton.next_power_of_2(n), triton.next_power_of_2(d // 2), triton.next_power_of_2(dv)
    splits = _splits(q, b * hkv, t)
    part_m = q.new_empty((b * hkv, splits, np_), dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    part_acc = q.new_empty((b * hkv, splits, np_, bdv), dtype=torch.float32)
    out = q.new_empty((b, hq, 1, dv))
    shape = dict(N=n, NP=np_, D=d, HALF=d // 2, DH=dh, DV=dv, BDV=bdv, MASK_HEADS=mask.shape[1],
                 PRE_ROPE=rope_inv_freq is not None, SOFTCAP=softcap > 0)  # fmt: skip
    _launcher("_decode_split", q)[(b * hkv, splits)](
        q, *k_tensors, *v_tensors, mask_u8, inv_freq, body_end, part_m, part_l, part_acc,
        body_start, t, hkv, hq, splits, scaling, rope_scale, softcap, **shape, **k_fmt, **v_fmt, BLOCK_T=BLOCK_T,
    )  # fmt: skip
    _launcher("_decode_merge", q)[(b * hkv,)](
        q, side_k.contiguous(), side_v.contiguous(), side_pos.contiguous(), mask_u8, inv_freq, body_end,
        part_m, part_l, part_acc, out, body_start, t, s, hkv, hq, splits, scaling, rope_scale, softcap, **shape,
        BLOCK_S=BLOCK_S,
    )  # fmt: skip
    return out


__all__ = ["triton_decode_attention"]
