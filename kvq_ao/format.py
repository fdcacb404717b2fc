"""The one definition of a KV operand: what the kvq ops take for the keys or the values of a layer.

Every implementation of the attention ops (the reference in `kvq_ao.kernels.reference`, the
native CPU kernel, the ExecuTorch kernel library, the Triton kernels) reads an operand through
this module, so its fields, their order and the meaning of its numbers are written here once:

* `OPERAND_TENSORS`: the tensors of one operand, in the order the ops' `Tensor?[]` argument
  lists them. Absent ones are None: scale/zero for a float body, the codebook for uniform
  levels, out_val/out_idx without outliers.
* out_val/out_idx [..., k]: k exact entries of each vector and their channels (uint8). Every slot
  holds an entry: the outliers first, most extreme first, and slots a vector's outliers leave free
  hold its lowest-numbered other channels (exact values there cost nothing extra and lose
  nothing). So no index is reserved to mean "empty", and channels 0-255 are all addressable.
* `OPERAND_INTS`: its format numbers, in the order of the ops' `int[]` argument.

The ops' schemas (`kvq_ao.ops`) are built from these names; the C++ kernels get the field
indices and format constants from a header generated from this module at build time
(`c_header`), the Triton kernels import them from here. Reordering either tuple changes the
schema, the header and every binding together (tests/kernels/test_signature.py does it).

Format numbers are encoded with the constants below (this module is the only place that knows
their values; kernels and the cache ask the predicates):

* bits: 2, 3, 4 or 8 for packed codes, `FLOAT_BITS` for a body that is stored as floats;
* axis: `AXIS_TOKEN` (each token's channels in groups of `group`) or `AXIS_CHANNEL` (each
  channel over blocks of `group` tokens);
* group: a positive group size, or `ONE_ROW` with the channel axis: one calibrated scale/zero
  row for every position (KVQuant's fixed per-channel key ranges).
* query_bits: how keys are scored. `FLOAT_QUERY`: in float, q . (scale * level + zero).
  `INT8_QUERY` and `INT16_QUERY` (keys with uniform codes in per-channel groups, post-RoPE):
  integer dot products against the query rounded to L = `query_levels(query_bits)` steps a side
  (127 for int8, as llama.cpp's q8 `vec_dot`; 32512 = 127 * 256 for int16, so that a kernel may
  split each entry into two int8 digits, hi * 256 + lo, and keep byte dot products) once per
  query head and scale row:

      qs = q * scale                      (float32, per channel)
      m = max_c |qs_c|;  qi = rint(qs * (L / m))     (float32 ops, ties to even; all 0 if m == 0)
      score = (m / L) * (qi . code) + q . zero  (+ q_c * (exact - dense) for each exact outlier)

  Every step before the integer dot product is one float32 operation, so every kernel rounds the
  query to the same integer vector; qi . code is exact in int32 (then rounded once to float32).
  Values always take `FLOAT_QUERY`.
* meta: how scale and zero are stored. `FLOAT_META`: as floats (the cache's scale dtype).
  Otherwise (`meta_ints(e)`, per-token groups of packed codes only) as one uint8 code each, half
  the bytes of float16 metadata (a quarter bit of every element at head_dim 64), decoded as

      scale = 2**e * SCALE_TABLE[s]        SCALE_TABLE[s] = float32(2**(s / 16)): 16 steps an octave
      zero  = -(scale * float(L * z)) * 2**-8        (float32 operations, in this order)

  with L = `range_levels(bits, codebook)` (2**bits - 1 uniform levels, 1 for a codebook in
  [0, 1]): the zero is a fraction z / 256 of the group's range below 0, so every group's range
  contains 0 (a rotated vector's always does). A group [lo, hi] is coded (`kvq_ao.quant.metadata`,
  and each quantizer alike) with lo' = min(lo, 0), hi' = max(hi, 0), S[c] = 2**e * SCALE_TABLE[c]:
  c0 = #{c : fl(S[c] * L) < fl(hi' - lo')}; z(c) = the smallest z in [0, 255] with
  zero(c, z) <= lo' (255 if none); c = the first of c0, c0 + 1, c0 + 2 (each capped at 255) with
  zero(c, z(c)) <= lo' and fl(zero + fl(S[c] * L)) >= hi', else the last of them. So the stored
  range covers the group (a group wider than S[255] * L is clamped: pick e so that none is), and
  every kernel computes the same bytes with float32 multiplies and compares only.
"""

from __future__ import annotations

import math
from typing import Any

OPERAND_TENSORS: tuple[str, ...] = ("codes", "scale", "zero", "codebook", "out_val", "out_idx", "side")
OPERAND_INTS: tuple[str, ...] = ("bits", "axis", "group", "query_bits", "meta")

AXIS_TOKEN = 0
AXIS_CHANNEL = 1
FLOAT_BITS = 0  # `bits` of a float body: codes hold the values themselves, no scale/zero
ONE_ROW = 0  # `group` of calibrated per-channel ranges: one scale/zero row for every position
FLOAT_QUERY = 0  # `query_bits`: keys scored in float
INT8_QUERY = 8  # `query_bits`: keys scored by integer dot products against an int8 query
INT16_QUERY = 16  # `query_bits`: the same against a query of 32512 steps a side (two int8 digits)
QUERY_BITS = (FLOAT_QUERY, INT8_QUERY, INT16_QUERY)
_QUERY_LEVELS = {INT8_QUERY: 127, INT16_QUERY: 127 * 256}
FLOAT_META = 0  # `meta`: scale and zero stored as floats
META_OFFSET = 128  # `meta` of 8-bit metadata with scale exponent e: META_OFFSET + e, |e| <= META_EXPONENT_BOUND
META_EXPONENT_BOUND = 90  # keeps every 8-bit scale and zero a normal float32
SCALE_STEPS = 16  # 8-bit scale codes per octave
ZERO_STEPS = 256  # 8-bit zero codes over a group's range (z / 256 of it below 0)
PACKED_BITS = (2, 3, 4, 8)  # the widths of packed codes
CODEBOOK_BITS = (2, 3, 4)  # the widths a codebook (non-uniform levels) may have
# The version of everything above as bytes in memory: a program exported with packed caches (.pte,
# .onnx) records it, and the runners refuse a program of another version (its buffers would be
# read with another layout). Bump it with any change to what an operand's bytes mean.
FORMAT_VERSION = 4
MAX_OUTLIER_HEAD_DIM = 256  # outlier channel indices are uint8 (every slot holds a channel: none is reserved)


def encode(bits: int | None, axis: int, group: int, calibrated_rows: bool = False, query_bits: int = FLOAT_QUERY,
           meta: int = FLOAT_META) -> tuple[int, int, int, int, int]:  # fmt: skip
    """(bits, axis, group, query_bits, meta) as the ops take them, from a spec's terms: bits None is
    a float body, `calibrated_rows` one calibrated scale/zero row for every position (per-channel
    only), `query_bits` how keys are scored, `meta` how scale and zero are stored."""
    return (FLOAT_BITS if bits is None else bits, axis, ONE_ROW if calibrated_rows else group, query_bits, meta)


def is_meta8(meta: int) -> bool:
    """Whether scale and zero are stored as 8-bit codes (uint8 tensors) rather than floats."""
    return meta != FLOAT_META


def meta_ints(exponent: int) -> int:
    """`meta` of 8-bit metadata whose scale codes start at 2**exponent (a clear error out of range)."""
    bound = META_EXPONENT_BOUND
    if isinstance(exponent, bool) or not isinstance(exponent, int) or not -bound <= exponent <= bound:
        raise ValueError(f"kvq: the 8-bit scale exponent must be an int in [-{bound}, {bound}] (scales and zeros stay normal "
                         f"float32), got {exponent!r}")  # fmt: skip
    return META_OFFSET + exponent


def is_valid_meta(meta: int) -> bool:
    """Whether `meta` names float metadata or 8-bit metadata with an exponent in bounds."""
    return not is_meta8(meta) or abs(meta - META_OFFSET) <= META_EXPONENT_BOUND


def meta_exponent(meta: int) -> int:
    """e of 8-bit metadata: its smallest scale is 2**e, its largest 2**(e + 255 / 16)."""
    if not is_meta8(meta):
        raise ValueError("kvq: float metadata has no scale exponent")
    return meta - META_OFFSET


def range_levels(bits: int, codebook: bool) -> int:
    """L, a group's range in units of its scale: 2**bits - 1 uniform levels, 1 for a codebook in [0, 1]."""
    return 1 if codebook else 2**bits - 1


def default_meta_exponent(bits: int, codebook: bool) -> int:
    """The scale exponent e of an uncalibrated 8-bit format: its groups' ranges S * L may span about
    2**-7 to 2**9 (16 octaves), which holds a KV vector's range in the models kvq_ao runs."""
    return -7 - round(math.log2(range_levels(bits, codebook)))


def scale_table() -> list[float]:
    """SCALE_TABLE: float32(2**(s / 16)) for s in 0..255, as Python floats (exactly float32 values)."""
    import struct

    return [struct.unpack("f", struct.pack("f", 2.0 ** (s / SCALE_STEPS)))[0] for s in range(256)]


def is_int_query(query_bits: int) -> bool:
    """Whether keys of this format are scored by integer dot products against a rounded query."""
    return query_bits in _QUERY_LEVELS


def query_levels(query_bits: int) -> int:
    """L, the integer query's steps a side (`INT8_QUERY`: 127, `INT16_QUERY`: 32512)."""
    if query_bits not in _QUERY_LEVELS:
        raise ValueError(f"kvq: query_bits {query_bits} has no integer query (one of {tuple(_QUERY_LEVELS)})")
    return _QUERY_LEVELS[query_bits]


def is_float(bits: int) -> bool:
    """Whether an operand of this width is stored as floats (no codes)."""
    return bits == FLOAT_BITS


def is_one_row(axis: int, group: int) -> bool:
    """Whether a format reads one calibrated scale/zero row for every position."""
    return axis == AXIS_CHANNEL and group == ONE_ROW


def tokens_per_group(axis: int, group: int, tokens: int) -> int:
    """How many positions share one scale/zero row along the token axis (per-channel formats)."""
    return max(tokens, 1) if is_one_row(axis, group) else group


def check_format(bits: int, axis: int, group: int, allow_float: bool = True, query_bits: int = FLOAT_QUERY,
                 meta: int = FLOAT_META) -> None:  # fmt: skip
    """Raise a ValueError naming the field when (bits, axis, group, query_bits, meta) is not a format."""
    if not (bits in PACKED_BITS or (allow_float and is_float(bits))):
        raise ValueError(f"kvq: bits must be one of {PACKED_BITS}{f' or {FLOAT_BITS} (float)' if allow_float else ''}, got {bits}")
    if axis not in (AXIS_TOKEN, AXIS_CHANNEL):
        raise ValueError(f"kvq: axis must be {AXIS_TOKEN} (token) or {AXIS_CHANNEL} (channel), got {axis}")
    if group < 0 or (group == ONE_ROW and axis != AXIS_CHANNEL):
        raise ValueError(f"kvq: group size must be positive (or {ONE_ROW}, one row for every position, with per-channel "
                         f"groups), got {group}")  # fmt: skip
    if query_bits not in QUERY_BITS:
        raise ValueError(f"kvq: query_bits must be {FLOAT_QUERY} (float scores), {INT8_QUERY} (int8 query) or {INT16_QUERY} "
                         f"(int16 query), got {query_bits}")  # fmt: skip
    if is_int_query(query_bits) and (is_float(bits) or axis != AXIS_CHANNEL):
        raise ValueError(f"kvq: an integer query (query_bits {query_bits}) scores packed codes in per-channel groups, got bits "
                         f"{bits}, axis {axis}")  # fmt: skip
    if not is_valid_meta(meta):
        raise ValueError(f"kvq: meta must be {FLOAT_META} (float scale and zero) or {META_OFFSET} + e with e in "
                         f"[-{META_EXPONENT_BOUND}, {META_EXPONENT_BOUND}] (8-bit), got {meta}")  # fmt: skip
    if is_meta8(meta) and (is_float(bits) or axis != AXIS_TOKEN):
        raise ValueError(f"kvq: 8-bit metadata (meta {meta}) codes per-token groups of packed codes (their ranges contain 0), "
                         f"got bits {bits}, axis {axis}")  # fmt: skip


def word_layout(bits: int) -> tuple[int, int]:
    """(codes per word, bytes per word) of the planar packing (`kvq_ao.quant.packing`)."""
    if bits not in PACKED_BITS:
        raise ValueError(f"bits must be one of {PACKED_BITS}, got {bits!r}")
    word_bits = math.lcm(bits, 8)
    return word_bits // bits, word_bits // 8


def midpoints(codebook):
    """The decision thresholds between a sorted codebook's neighbouring levels (nearest-level coding)."""
    return (codebook[1:] + codebook[:-1]) * 0.5


def format_ints(bits: int, axis: int, group: int, query_bits: int = FLOAT_QUERY, meta: int = FLOAT_META) -> list[int]:
    """An operand's format numbers as the ops' `int[]` (in `OPERAND_INTS` order)."""
    values = {"bits": bits, "axis": axis, "group": group, "query_bits": query_bits, "meta": meta}
    return [int(values[name]) for name in OPERAND_INTS]


def format_of(ints) -> tuple[int, int, int, int, int]:
    """(bits, axis, group, query_bits, meta) of an ops' `int[]` format (a clear error on a wrong length)."""
    if len(ints) != len(OPERAND_INTS):
        raise ValueError(f"kvq: a format lists {len(OPERAND_INTS)} ints {OPERAND_INTS}, got {len(ints)}")
    values = dict(zip(OPERAND_INTS, (int(v) for v in ints)))
    return values["bits"], values["axis"], values["group"], values["query_bits"], values["meta"]


class Operand:
    """One operand (K or V) of the attention ops: its tensors and format numbers by name.

    Built by keyword (`Operand(codes=..., ..., group=...)`; query_bits and meta may be left out:
    float scores, float metadata) or from the ops' lists (`Operand.from_lists`); `lists()` gives them back in schema
    order. Fields the format does not use are None.
    """

    __slots__ = OPERAND_TENSORS + OPERAND_INTS
    _DEFAULTS: dict = {"query_bits": FLOAT_QUERY, "meta": FLOAT_META}

    def __init__(self, **fields: Any) -> None:
        fields = {**self._DEFAULTS, **fields}
        missing = set(self.__slots__) - set(fields)
        extra = set(fields) - set(self.__slots__)
        if missing or extra:
            raise TypeError(f"Operand needs exactly {self.__slots__}; missing {sorted(missing)}, unexpected {sorted(extra)}")
        for name, value in fields.items():
            setattr(self, name, value)

    @classmethod
    def from_lists(cls, tensors, ints, name: str = "operand") -> Operand:
        """The operand of an op's `Tensor?[]` and `int[]` arguments (a clear error on wrong lengths)."""
        if len(tensors) != len(OPERAND_TENSORS):
            raise ValueError(f"kvq: {name} must list {len(OPERAND_TENSORS)} tensors {OPERAND_TENSORS}, got {len(tensors)}")
        if len(ints) != len(OPERAND_INTS):
            raise ValueError(f"kvq: {name}_format must list {len(OPERAND_INTS)} ints {OPERAND_INTS}, got {len(ints)}")
        return cls(**dict(zip(OPERAND_TENSORS, tensors)), **{n: int(v) for n, v in zip(OPERAND_INTS, ints)})

    def lists(self) -> tuple[list, list[int]]:
        """(tensors, format numbers) in the order of the ops' schema."""
        return [getattr(self, n) for n in OPERAND_TENSORS], [getattr(self, n) for n in OPERAND_INTS]

    def fields(self) -> dict[str, Any]:
        return {n: getattr(self, n) for n in self.__slots__}

    def replace(self, **changes: Any) -> Operand:
        return Operand(**{**self.fields(), **changes})

    @property
    def is_float(self) -> bool:
        return is_float(self.bits)

    @property
    def int_query(self) -> bool:
        """Whether these keys are scored by integer dot products (`is_int_query`)."""
        return is_int_query(self.query_bits)

    @property
    def meta8(self) -> bool:
        """Whether scale and zero are 8-bit codes (`is_meta8`)."""
        return is_meta8(self.meta)

    @property
    def n_outliers(self) -> int:
        return 0 if self.out_val is None else self.out_val.shape[-1]

    def __repr__(self) -> str:
        shape = tuple(self.codes.shape) if self.codes is not None else None
        return (f"Operand(codes={shape}, bits={self.bits}, axis={self.axis}, group={self.group}, query_bits={self.query_bits}, "
                f"meta={self.meta}, outliers={self.n_outliers})")


def c_header() -> str:
    """The C++ view of this module: operand field indices and format constants, generated into the
    native kernels' build directory (kernels/cpu), so C++ never retypes them."""
    lines = [
        "// Generated from kvq_ao/format.py at build time: the kvq ops' operand lists. Do not edit.",
        "#pragma once",
        "#include <cmath>",
        "#include <cstdint>",
        "namespace kvq_format {",
    ]
    lines += [f"constexpr int {name.upper()} = {i};  // index in an operand's Tensor?[]" for i, name in enumerate(OPERAND_TENSORS)]
    lines.append(f"constexpr int kTensorFields = {len(OPERAND_TENSORS)};")
    lines += [f"constexpr int {name.upper()} = {i};  // index in an operand's int[]" for i, name in enumerate(OPERAND_INTS)]
    lines.append(f"constexpr int kIntFields = {len(OPERAND_INTS)};")
    lines += [
        f"constexpr int64_t kAxisToken = {AXIS_TOKEN};",
        f"constexpr int64_t kAxisChannel = {AXIS_CHANNEL};",
        f"constexpr int64_t kFloatBits = {FLOAT_BITS};",
        f"constexpr int64_t kOneRow = {ONE_ROW};",
        f"constexpr int64_t kFloatQuery = {FLOAT_QUERY};",
        f"constexpr int64_t kInt8Query = {INT8_QUERY};",
        f"constexpr int64_t kInt16Query = {INT16_QUERY};",
        "// L, an integer query's steps a side (0: keys scored in float)",
        "constexpr int32_t query_levels(int64_t query_bits) { switch (query_bits) { "
        + " ".join(f"case {b}: return {n};" for b, n in _QUERY_LEVELS.items()) + " default: return 0; } }",
        f"constexpr int64_t kFloatMeta = {FLOAT_META};",
        f"constexpr int64_t kMetaOffset = {META_OFFSET};",
        f"constexpr int kZeroSteps = {ZERO_STEPS};",
        "// 8-bit metadata: scale = 2^e * kScaleTable[s], zero = -(scale * float(L * z)) * 2^-8 (kvq_ao/format.py)",
        "constexpr float kScaleTable[256] = {" + ", ".join(f"{v.hex()}f" for v in scale_table()) + "};",
        "constexpr bool is_meta8(int64_t meta) { return meta != kFloatMeta; }",
        f"constexpr int64_t kMetaExponentBound = {META_EXPONENT_BOUND};  // |e| of 8-bit metadata",
        "constexpr bool is_valid_meta(int64_t meta) {"
        " return !is_meta8(meta) || (meta >= kMetaOffset - kMetaExponentBound && meta <= kMetaOffset + kMetaExponentBound); }",
        "// L, a group's range in units of its scale: 2^bits - 1 uniform levels, 1 for a codebook in [0, 1]",
        "constexpr int range_levels(int64_t bits, bool codebook) { return codebook ? 1 : (1 << bits) - 1; }",
        "// What scale code s and zero code z of 8-bit metadata decode to (exact float32 steps: every kernel reads the same floats)",
        "inline float meta_scale(int64_t meta, int s) { return std::ldexp(kScaleTable[s], static_cast<int>(meta - kMetaOffset)); }",
        "inline float meta_zero(float scale, int levels, int z) { return -(scale * static_cast<float>(levels * z)) * (1.0f / kZeroSteps); }",
        "// The floats of 8-bit metadata `meta` for codes of L levels: scale[s] for every scale code, zero(scale, z);",
        "// the one table the attention kernels decode with and the quantizers code against.",
        "struct MetaTable {",
        "  float scale[256] = {};",
        "  int levels = 0;",
        "  MetaTable() = default;",
        "  MetaTable(int64_t meta, int levels_) : levels(levels_) { for (int s = 0; s < 256; ++s) scale[s] = meta_scale(meta, s); }",
        "  float zero(float s, int z) const { return meta_zero(s, levels, z); }",
        "};",
        f"constexpr int kMaxOutlierHeadDim = {MAX_OUTLIER_HEAD_DIM};",
        "// The planar packing (kvq_ao.quant.packing): codes per word and bytes per word of each width.",
        "constexpr int codes_per_word(int64_t bits) { switch (bits) { "
        + " ".join(f"case {b}: return {word_layout(b)[0]};" for b in PACKED_BITS) + " default: return 0; } }",
        "constexpr int bytes_per_word(int64_t bits) { switch (bits) { "
        + " ".join(f"case {b}: return {word_layout(b)[1]};" for b in PACKED_BITS) + " default: return 0; } }",
        "constexpr int64_t packed_row_bytes(int64_t dim, int64_t bits) { return dim / codes_per_word(bits) * bytes_per_word(bits); }",
        "constexpr bool is_float(int64_t bits) { return bits == kFloatBits; }",
        "constexpr bool is_one_row(int64_t axis, int64_t group) { return axis == kAxisChannel && group == kOneRow; }",
        "constexpr bool is_packed_bits(int64_t bits) { return " + " || ".join(f"bits == {b}" for b in PACKED_BITS) + "; }",
        f'constexpr const char* kPackedBitsText = "{PACKED_BITS}";',
        "}  // namespace kvq_format",
        "",
    ]
    return "\n".join(lines)


__all__ = ["AXIS_CHANNEL", "AXIS_TOKEN", "CODEBOOK_BITS", "FLOAT_BITS", "FLOAT_META", "FLOAT_QUERY", "FORMAT_VERSION", "INT8_QUERY", "MAX_OUTLIER_HEAD_DIM", "META_EXPONENT_BOUND", "META_OFFSET",
           "ONE_ROW", "OPERAND_INTS", "OPERAND_TENSORS", "Operand", "PACKED_BITS", "QUERY_BITS", "SCALE_STEPS", "ZERO_STEPS", "c_header", "check_format",
           "default_meta_exponent", "encode", "format_ints", "format_of", "is_float", "is_meta8", "is_one_row", "is_valid_meta", "meta_exponent", "meta_ints", "midpoints",
           "range_levels", "scale_table", "tokens_per_group", "word_layout"]  # fmt: skip
