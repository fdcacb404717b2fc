"""`kvq::triton_decode_attention`: the Triton decode attention as a `torch.library.triton_op`.

A triton_op (not a custom_op with an opaque CUDA kernel) because torch.compile then traces into
it: AOTAutograd replaces the op by its Triton kernel launches, so inductor schedules them with the
rest of the graph and CUDA graphs capture them. It takes exactly the arguments of
`kvq::decode_attention` (the schema is inferred from the signature below and checked against
`kvq_ao.ops.ATTENTION_SCHEMA` by the tests; each operand's tensors reach the kernels by name, from
`kvq_ao.format.Operand`), validates them with the same shared checks, and on CPU
tensors runs the same kernels in Triton's interpreter.
"""

from __future__ import annotations

import contextlib
import sys
import types
from types import ModuleType

import torch
import triton
from torch.library import triton_op, wrap_triton

from kvq_ao.kernels.gpu import triton_attention, triton_blocks, triton_decode
from kvq_ao.kernels.gpu import triton_quantize as triton_quantize_kernels
from kvq_ao import format as fmt
from kvq_ao.format import OPERAND_TENSORS, Operand, midpoints
from kvq_ao.ops import _check_attention, _check_quantize, _check_quantize_fixed, _meta_shapes, named_arguments
from kvq_ao.quant import metadata
from kvq_ao.quant.packing import packed_size

BLOCK_T = 64  # body tokens per step of a chunk-attention program (a quarter for float32 models: FMA products)
BLOCK_S = 32  # side entries per step of a chunk-attention program
MERGE_BLOCK_S = 8  # side entries per step of the decode merge (its [heads, entries, D] products spill past 8 on sm_80)
CHUNK_BLOCK_Q = 16  # queries per chunk-attention program (times the query heads sharing a kv head)
SPLITS_PER_SM = 4  # split programs per streaming multiprocessor: several waves at batch 1
# Launch options. A split program: 8 warps for its [BLOCK_T, D] tiles of K and V; one stage (direct
# 64/128-bit loads into registers; more stages copy asynchronously through shared memory and spill
# on some formats). maxnreg 255 everywhere: without it ptxas trades a few bytes of spills for
# occupancy on some specializations (tests/kernels/test_triton_aot.py allows none).
# benchmarks/gpu.py times the alternatives on a GPU.
DECODE_LAUNCH = {"num_warps": 8, "num_stages": 1, "maxnreg": 255}
MERGE_LAUNCH = {"num_warps": 4, "maxnreg": 255}
CHUNK_LAUNCH = {"num_warps": 8, "maxnreg": 255}  # a chunk program's tiles: 16 queries x the query heads of a kv head
QUANTIZE_LAUNCH = {"maxnreg": 255}
_DECODE_OVERRIDE: list[dict] = []  # launch options `decode_launch` puts in force for a block
INTERPRETER_SPLITS = 3  # on CPU: enough splits that the merge is exercised, few enough to be quick


_INTERPRETED: dict[str, dict] = {}


def interpreted(module: ModuleType, name: str):
    """Kernel `name` of `module` in Triton's interpreter (runs on CPU tensors).

    Built from a copy of the module's globals (and those of the modules its helpers come from) in
    which every jit function is an interpreted function, so kernels call interpreted helpers, while the module's
    JIT functions stay what torch.compile traces and GPUs compile. (Triton decides between the two
    at decoration time from TRITON_INTERPRET, and torch traces only JIT functions.)"""
    from triton.runtime.interpreter import InterpretedFunction

    if module.__name__ not in _INTERPRETED:
        space = dict(vars(module))
        for value in list(space.values()):  # and the globals of the modules its helpers come from
            if isinstance(value, triton.runtime.jit.JITFunction):
                for key, item in vars(sys.modules[value.fn.__module__]).items():
                    space.setdefault(key, item)
        for key, value in list(space.items()):
            if isinstance(value, triton.runtime.jit.JITFunction):
                fn = value.fn
                space[key] = InterpretedFunction(types.FunctionType(fn.__code__, space, fn.__name__, fn.__defaults__, fn.__closure__))
        _INTERPRETED[module.__name__] = space
    return _INTERPRETED[module.__name__][name]


def _launcher(module: ModuleType, name: str, like: torch.Tensor):
    """Kernel `name` as torch.compile sees it (traced, CUDA) or, for real CPU tensors, interpreted."""
    from torch._subclasses.fake_tensor import is_fake

    if like.device.type == "cpu" and not is_fake(like):
        return _Interpreted(interpreted(module, name), like.dtype)
    return wrap_triton(getattr(module, name))


class _Interpreted:
    """An interpreted kernel launched as `kernel[grid](...)`, with the interpreter's one workaround:
    its bfloat16 `tl.dot` is wrong, so kernels that take DOT_F32 compute their products in float32
    for bfloat16 inputs (what a GPU compiles is what the op passes)."""

    def __init__(self, kernel, dtype: torch.dtype):
        self.kernel, self.dtype = kernel, dtype

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if "DOT_F32" in kwargs and self.dtype == torch.bfloat16:
                kwargs = dict(kwargs, DOT_F32=True)
            return self.kernel[grid](*args, **kwargs)

        return launch


@contextlib.contextmanager
def decode_launch(**options):
    """Within the block, split programs launch with `options` (num_warps, num_stages, maxnreg)
    instead of DECODE_LAUNCH: how benchmarks/gpu.py times the alternatives on a GPU. The table
    itself is never changed."""
    _DECODE_OVERRIDE.append(options)
    try:
        yield
    finally:
        _DECODE_OVERRIDE.pop()


def _splits(q: torch.Tensor, rows: int, capacity: int, block: int) -> int:
    """Split programs per kv head: enough for SPLITS_PER_SM on every SM over all rows (b * Hkv), at
    most one per block of the capacity."""
    blocks = max(1, triton.cdiv(capacity, block))
    if q.device.type != "cuda":
        return min(INTERPRETER_SPLITS, blocks)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return max(1, min(blocks, SPLITS_PER_SM * sms // rows))




_SCALE_TABLES: dict[tuple[int, torch.device], torch.Tensor] = {}


def _scale_table(meta: int, like: torch.Tensor) -> torch.Tensor:
    """The 256 scales of 8-bit metadata `meta` on `like`'s device, which the kernels look codes up in.

    Built once per (exponent, device) for real tensors: rebuilt on every decode step it costs about
    20 tiny launches (metadata.scales' selects). Under tracing (`like` a fake or functional tensor)
    it is built in the graph instead, so no tensor of one trace is handed to another."""
    exponent = fmt.meta_exponent(meta)
    if type(like) is not torch.Tensor:
        return metadata.scales(exponent, like.device)
    key = (exponent, like.device)
    if key not in _SCALE_TABLES:
        _SCALE_TABLES[key] = metadata.scales(exponent, like.device)
    return _SCALE_TABLES[key]


def _operand_launch(o: Operand, prefix: str, dummy: torch.Tensor) -> tuple[dict, dict]:
    """One operand as keyword launch arguments: its body tensors under the kernels' parameter names
    (`k_codes`, ...; absent ones replaced by a dummy pointer the kernel never reads) and its
    compile-time format."""
    tensors = {f"{prefix}_{name}": getattr(o, name) for name in OPERAND_TENSORS if name != "side"}
    # 8-bit scale and zero: the kernels decode the codes where they load them, scales from this table
    tensors[f"{prefix}_table"] = _scale_table(o.meta, o.codes) if o.meta8 else None
    tensors = {name: dummy if t is None else t.contiguous() for name, t in tensors.items()}
    if o.codebook is not None:
        tensors[f"{prefix}_codebook"] = tensors[f"{prefix}_codebook"].float()
    form = dict(BITS=o.bits, AXIS=o.axis, GROUP=o.group, CODEBOOK=o.codebook is not None, OUT=o.n_outliers,
                META=triton_blocks.meta_levels(o))
    return tensors, {f"{prefix.upper()}_{k}": v for k, v in form.items()}


def _common(named: dict) -> tuple[dict, dict]:
    """The launch arguments both kernels share: operand tensors (contiguous, by name) and the shapes
    and formats they are compiled for."""
    q, k, v = named["q"], named["k"], named["v"]
    d, hkv, hq, dv = q.shape[-1], k.codes.shape[1], q.shape[1], v.side.shape[-1]
    k_tensors, k_fmt = _operand_launch(k, "k", q)
    v_tensors, v_fmt = _operand_launch(v, "v", q)
    rope = named["rope_inv_freq"]
    shape = dict(N=hq // hkv, D=d, HALF=d // 2, DH=triton.next_power_of_2(d // 2), DV=dv, BDV=triton.next_power_of_2(dv),
                 PRE_ROPE=rope is not None, SOFTCAP=named["softcap"] > 0, **k_fmt, **v_fmt)  # fmt: skip
    inv_freq = q if rope is None else rope.float().contiguous()
    return {**k_tensors, **v_tensors}, dict(shape=shape, inv_freq=inv_freq)


@triton_op("kvq::triton_decode_attention", mutates_args=())
def triton_decode_attention(
    q: torch.Tensor, k: list[torch.Tensor | None], k_format: list[int], v: list[torch.Tensor | None], v_format: list[int],
    side_pos: torch.Tensor, body_end: torch.Tensor, mask: torch.Tensor, rope_inv_freq: torch.Tensor | None,
    body_start: int, scaling: float, rope_scale: float, softcap: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """`kvq::decode_attention` (same arguments, same result) in Triton: q [B, Hq, 1, D] over one
    layer's packed cache -> [B, Hq, 1, Dv] in q's dtype."""
    named = _check_attention(named_arguments((), dict(locals())), decode=True)
    if not triton_blocks.supported(q.shape[-1], named["k"], named["v"]):
        raise ValueError(f"kvq.triton_decode_attention needs a power-of-two head_dim (>= 32) and power-of-two groups (keys "
                         f"scored against an integer query: groups of >= 16 tokens, no outliers); got head_dim {q.shape[-1]}, "
                         f"groups {named['k'].group}/{named['v'].group}, key query_bits {named['k'].query_bits}, key outliers "
                         f"{named['k'].n_outliers} (use kvq.decode_attention)")  # fmt: skip
    b, hq, _, d = q.shape
    ko, vo = named["k"], named["v"]
    hkv, t, dv, s = ko.codes.shape[1], ko.codes.shape[2], vo.side.shape[-1], side_pos.shape[0]
    q = q.contiguous()
    operands, common = _common(dict(named, q=q))
    shape = {k: v for k, v in common["shape"].items() if k not in ("DH", "BDV")}
    np_ = triton.next_power_of_2(shape["N"])
    block = triton_decode.block_tokens(d, float32=q.dtype == torch.float32, pre_rope=named["rope_inv_freq"] is not None)
    mask_arg = mask.contiguous()  # bool: the kernels load it as int1 (a dtype view of a bool tensor fails CUDA lowering)
    splits = _splits(q, b * hkv, t, block)
    part_m = q.new_empty((b * hkv, splits, np_), dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    part_acc = q.new_empty((b * hkv, splits, np_, dv), dtype=torch.float32)
    out = q.new_empty((b, hq, 1, dv))
    _launcher(triton_decode, "_decode_split", q)[(b * hkv, splits)](
        q=q, **operands, mask=mask_arg, inv_freq=common["inv_freq"], body_end=body_end, part_m=part_m, part_l=part_l,
        part_acc=part_acc, body_start=body_start, T=t, HKV=hkv, HQ=hq, n_splits=splits, scaling=scaling,
        rope_scale=rope_scale, softcap=softcap, NP=np_, M=max(16, np_), MASK_HEADS=mask.shape[1], **shape, BLOCK_T=block,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **(_DECODE_OVERRIDE or [DECODE_LAUNCH])[-1],
        DOT_F32=q.dtype == torch.float32,  # float32 models: FMA products (tensor cores take 16-bit inputs)
        K_QUERY=triton_blocks.query_levels(ko),
    )  # fmt: skip
    merge_shape = {k: v for k, v in shape.items() if not k.startswith(("K_", "V_"))}
    _launcher(triton_decode, "_decode_merge", q)[(b * hkv,)](
        q, ko.side.contiguous(), vo.side.contiguous(), side_pos.contiguous(), mask_arg, common["inv_freq"], body_end,
        part_m, part_l, part_acc, out, body_start, t, s, hkv, hq, splits, scaling, rope_scale, softcap, NP=np_,
        MASK_HEADS=mask.shape[1], **merge_shape, BLOCK_S=MERGE_BLOCK_S, **MERGE_LAUNCH,
    )  # fmt: skip
    return out


@triton_op("kvq::triton_chunk_attention", mutates_args=())
def triton_chunk_attention(
    q: torch.Tensor, k: list[torch.Tensor | None], k_format: list[int], v: list[torch.Tensor | None], v_format: list[int],
    side_pos: torch.Tensor, body_end: torch.Tensor, mask: torch.Tensor, rope_inv_freq: torch.Tensor | None,
    body_start: int, scaling: float, rope_scale: float, softcap: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """`kvq::chunk_attention` (same arguments, same result) in Triton: queries q [B, Hq, Tq, D] (a
    prefill chunk, speculative or batched steps) over one layer's packed cache -> [B, Hq, Tq, Dv],
    in tiles of CHUNK_BLOCK_Q queries x all query heads of a kv head, streaming the body block by
    block (no float cache, no [Tq, T] scores)."""
    named = _check_attention(named_arguments((), dict(locals())), decode=False)
    if not triton_blocks.supported(q.shape[-1], named["k"], named["v"]):
        raise ValueError(f"kvq.triton_chunk_attention needs a power-of-two head_dim (>= 32) and power-of-two groups (keys "
                         f"scored against an integer query: groups of >= 16 tokens, no outliers); got head_dim {q.shape[-1]}, "
                         f"groups {named['k'].group}/{named['v'].group}, key query_bits {named['k'].query_bits}, key outliers "
                         f"{named['k'].n_outliers} (use kvq.chunk_attention)")  # fmt: skip
    b, hq, tq, d = q.shape
    ko, vo = named["k"], named["v"]
    hkv, t, dv, s = ko.codes.shape[1], ko.codes.shape[2], vo.side.shape[-1], side_pos.shape[0]
    q = q.contiguous()
    operands, common = _common(dict(named, q=q))
    bounds = mask.dtype == torch.int64
    mask_arg = mask.contiguous()  # int64 bounds or bool (loaded as int1; no dtype view, which CUDA lowering refuses)
    rows = triton.next_power_of_2(common["shape"]["N"] * CHUNK_BLOCK_Q)
    out = q.new_empty((b, hq, tq, dv))
    _launcher(triton_attention, "_chunk_attention", q)[(b * hkv, triton.cdiv(tq, CHUNK_BLOCK_Q))](
        q=q, **operands, side_k=ko.side.contiguous(), side_v=vo.side.contiguous(), side_pos=side_pos.contiguous(),
        mask=mask_arg, inv_freq=common["inv_freq"], body_end=body_end.contiguous(), out=out, body_start=body_start, T=t,
        S=s, TQ=tq, HKV=hkv, HQ=hq, scaling=scaling, rope_scale=rope_scale, softcap=softcap, BOUNDS=int(bounds),
        MASK_HEADS=1 if bounds else mask.shape[1], PER_QUERY_END=body_end.dim() == 1, **common["shape"],
        BLOCK_Q=CHUNK_BLOCK_Q, M=rows, BLOCK_T=triton_blocks.chunk_key_block(BLOCK_T // 4 if q.dtype == torch.float32 else BLOCK_T, ko),
        BLOCK_S=BLOCK_S, K_QUERY=triton_blocks.query_levels(ko),
        PRECISION="tf32x3" if q.dtype == torch.float32 else "tf32", **CHUNK_LAUNCH,  # tf32x3: float32 accuracy on tensor cores
    )  # fmt: skip
    return out


QUANTIZE_ROWS = 16  # vectors per per-token quantize program
_SCALE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def quantize_supported(x: torch.Tensor, axis: int, group: int, scale_dtype: torch.dtype) -> bool:
    """Whether the Triton quantize serves this format (its tiles need power-of-two head_dim and group;
    float and 8-bit metadata alike)."""
    d = x.shape[-1]
    return d == triton.next_power_of_2(d) and group == triton.next_power_of_2(group) and scale_dtype in _SCALE_CODES


@triton_op("kvq::triton_quantize", mutates_args=())
def triton_quantize(
    x: torch.Tensor, format: list[int], scale_dtype: torch.dtype,
    codebook: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, n_outliers: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """`kvq::quantize` (same arguments, bit-identical results) in Triton: x [B, H, T, D] float ->
    (codes, scale, zero, outlier values, outlier indices, clamped count)."""
    bits, axis, group = _check_quantize(x, format, codebook, lo, hi, n_outliers)
    meta = fmt.format_of(format)[4]
    if not quantize_supported(x, axis, group, scale_dtype):
        raise ValueError(f"kvq.triton_quantize needs a power-of-two head_dim and group and a float16/bfloat16/float32 "
                         f"scale dtype; got head_dim {x.shape[-1]}, group {group}, {scale_dtype} (use kvq.quantize)")  # fmt: skip
    b, h, t, d = x.shape
    x = x.contiguous()
    code_shape, meta_shape = _meta_shapes(x.shape, bits, axis, group)
    codes = x.new_empty(code_shape, dtype=torch.uint8)
    meta8 = fmt.is_meta8(meta)
    scale = x.new_empty(meta_shape, dtype=torch.uint8 if meta8 else scale_dtype)
    zero = x.new_empty(meta_shape, dtype=torch.uint8 if meta8 else scale_dtype)
    table = _scale_table(meta, x) if meta8 else x  # the 256 scales of 8-bit metadata
    out_val = x.new_empty([b, h, t, n_outliers])
    out_idx = x.new_empty([b, h, t, n_outliers], dtype=torch.uint8)
    rows = b * h * t
    tile = group if axis == 1 else QUANTIZE_ROWS
    programs = triton.cdiv(rows, tile)
    partial = x.new_zeros([programs], dtype=torch.int64)  # outliers clamped, per program
    finfo = torch.finfo(scale_dtype)
    vector = n_outliers > 0 and lo.numel() == 0
    mids = midpoints(codebook.float()) if codebook.numel() else x.new_zeros(1, dtype=torch.float32)
    thresholds = (lo.float().contiguous(), hi.float().contiguous()) if n_outliers and not vector else (x, x)
    # FIXED is passed though it has a default: torch's analysis of which arguments a launch writes
    # needs every argument, and without it assumes all are written (copies of every input).
    _launcher(triton_quantize_kernels, "_quantize", x)[(programs,)](
        x, *thresholds, mids, codes, scale, zero, out_val, out_idx, partial, table,
        rows, t, h, 1.0 if codebook.numel() else float(2**bits - 1), finfo.max, finfo.eps, finfo.smallest_normal * finfo.eps,
        D=d, BITS=bits, AXIS=axis, GROUP=group, CODEBOOK=codebook.numel() > 0, K=n_outliers, VECTOR_OUTLIERS=vector,
        SCALE=_SCALE_CODES[scale_dtype], ROWS=tile, FIXED=False, META8=meta8, **QUANTIZE_LAUNCH,
    )  # fmt: skip
    return codes, scale, zero, out_val, out_idx, partial.sum()


def quantize_fixed_supported(x: torch.Tensor) -> bool:
    """Whether the Triton quantize_fixed serves x (its rows need a power-of-two head_dim)."""
    return x.shape[-1] == triton.next_power_of_2(x.shape[-1])


@triton_op("kvq::triton_quantize_fixed", mutates_args=())
def triton_quantize_fixed(
    x: torch.Tensor, bits: int, zero: torch.Tensor, scale: torch.Tensor, codebook: torch.Tensor, lo: torch.Tensor,
    hi: torch.Tensor, n_outliers: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """`kvq::quantize_fixed` (same arguments, bit-identical results) in Triton: x [B, H, T, D] float
    against calibrated per-channel ranges -> (codes, outlier values, outlier indices, clamped count)."""
    _check_quantize_fixed(x, bits, zero, scale, codebook, lo, hi, n_outliers)
    if not quantize_fixed_supported(x):
        raise ValueError(f"kvq.triton_quantize_fixed needs a power-of-two head_dim, got {x.shape[-1]} (use kvq.quantize_fixed)")
    b, h, t, d = x.shape
    x = x.contiguous()
    codes = x.new_empty([b, h, t, packed_size(d, bits)], dtype=torch.uint8)
    out_val = x.new_empty([b, h, t, n_outliers])
    out_idx = x.new_empty([b, h, t, n_outliers], dtype=torch.uint8)
    programs = triton.cdiv(b * h * t, QUANTIZE_ROWS)
    partial = x.new_zeros([programs], dtype=torch.int64)
    mids = midpoints(codebook.float()) if codebook.numel() else x.new_zeros(1, dtype=torch.float32)
    fixed = [t_.float().contiguous() for t_ in (lo, hi, scale, zero)]
    _launcher(triton_quantize_kernels, "_quantize", x)[(programs,)](
        x, fixed[0], fixed[1], mids, codes, fixed[2], fixed[3], out_val, out_idx, partial, x,
        b * h * t, t, h, 1.0, 1.0, 1.0, 1.0,
        D=d, BITS=bits, AXIS=0, GROUP=d, CODEBOOK=codebook.numel() > 0, K=n_outliers, VECTOR_OUTLIERS=False,
        SCALE=2, ROWS=QUANTIZE_ROWS, FIXED=True, META8=False, **QUANTIZE_LAUNCH,
    )  # fmt: skip
    return codes, out_val, out_idx, partial.sum()


__all__ = ["interpreted", "quantize_fixed_supported", "quantize_supported", "triton_quantize_fixed", "triton_chunk_attention", "triton_decode_attention", "triton_quantize"]
