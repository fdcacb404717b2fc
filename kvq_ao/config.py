"""What to quantize and how: frozen, self-validating dataclasses with a JSON round trip.

`QuantSpec` describes one tensor (keys or values) of one layer; `LayerKV` pairs them;
`KVQuantConfig` holds one `LayerKV` per layer (or one for all layers) plus the settings the
whole cache shares: full-precision sink tokens, the full-precision window of recent tokens, and
the dtype of scales. `KVQuantConfig` is a torchao `AOBaseConfig`, so
`torchao.quantization.quantize_(model, cfg, filter_fn=...)` accepts it (see `kvq_ao.api`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvq_ao._torchao import AOBaseConfig
from kvq_ao.format import FLOAT_META, default_meta_exponent, meta_ints
from kvq_ao.quant.outliers import outlier_slots
from kvq_ao.quant.packing import SUPPORTED_BITS
from kvq_ao.quant.rotation import ROTATIONS
from kvq_ao.quant.uniform import AXIS_CHANNEL, AXIS_TOKEN

AXES = {"token": AXIS_TOKEN, "channel": AXIS_CHANNEL}
SCALE_DTYPES = ("float16", "float32")
SIDE_DTYPES = ("model", "float16", "bfloat16")  # what the full-precision side store holds
# "int": uniform integer grid; "nf": fixed NormalFloat levels; "nuq": per-layer calibrated levels.
DATATYPES = ("int", "nf", "nuq")
# How outliers are judged: "channel" by calibrated per-channel thresholds (KVQuant's keys),
# "vector" online, each vector's entries furthest from its mean (KVQuant's values).
OUTLIER_RULES = ("channel", "vector")
OUTLIER_DTYPES = ("model", "float16", "bfloat16")  # what an exact outlier value is stored in
# Where per-channel key ranges come from: "online", per block of `group_size` tokens as they arrive
# (KIVI); "calibrated", one range per layer, head and channel fitted offline (KVQuant's keys).
RANGES = ("online", "calibrated")
# How attention scores keys: "float", q . dequantized key; "int8" / "int16", integer dot products of
# the codes with the query rounded to int8 / int16 per head and scale row (`kvq_ao.format`, query_bits).
SCORES = ("float", "int8", "int16")
# How per-token groups store their scale and zero: "float" in the cache's scale_dtype, "8-bit" as one
# byte each (kvq_ao/format.py's `meta`: a log-grid scale and the zero as a fraction of the range).
METADATA = ("float", "8-bit")
_QUERY_BITS = {"float": 0, "int8": 8, "int16": 16}
CODEBOOK_BITS = (2, 3, 4)
CONFIG_VERSION = 1


@dataclass(frozen=True)
class QuantSpec:
    """How one tensor (keys or values) of one layer is stored.

    bits: 2, 3, 4 or 8 for packed integer codes; None keeps full precision ("none" in JSON).
    axis: "channel" quantizes each channel over blocks of `group_size` tokens (KIVI keys);
          "token" quantizes each token over groups of `group_size` channels (values).
    dtype: "int" (uniform levels), "nf" (NormalFloat levels) or "nuq" (per-layer levels from
          Fisher-weighted k-means, KVQuant; needs a calibration). nf/nuq take 2, 3 or 4 bits.
    outliers: fraction of each vector's entries kept exact (KVQuant's dense-and-sparse, e.g.
          0.01).
    outlier_rule: "channel" judges outliers by per-channel thresholds from a calibration (KVQuant's
          keys); "vector" takes each vector's entries furthest from its mean, online, with no
          calibration (KVQuant's values, whose thresholds are computed per token); "vector" needs
          axis "token", whose groups the removed entries stop stretching.
    max_outliers: outlier slots each vector has (the sparse side structure's fixed size); None
          gives room for the fraction itself, ceil(outliers * head_dim). Outliers cluster: with
          one slot per 64-entry key vector, 0.4% of SmolLM2's key entries still fall outside their
          channel range with no slot left and are clamped, so a preset may give them more room.
    outlier_dtype: what the kept outlier values are stored in: "model" (the model's dtype, exact),
          or "float16" / "bfloat16" (16 bits a value: in a float32 model a slot costs 24 bits with
          its uint8 channel index instead of 40, and the value is rounded to that precision).
    ranges: for axis "channel", where each channel's range comes from. "online" sets it per block
          of `group_size` tokens (the block being filled waits in full precision); "calibrated"
          takes it from a calibration (the channel's outlier thresholds, or its calibration
          min/max without outliers), so every token is quantized on arrival and the body holds no
          per-token metadata at all (`group_size` is then unused).
    rotation: "hadamard" stores each vector rotated by a fixed randomized Hadamard matrix of
          head_dim (`kvq_ao.quant.rotation`): attention rotates the query (keys) or rotates its
          output back (values), so results are those of the unrotated vectors, while the rotated
          coordinates carry no outlier channels and fit a per-vector range. Keys need post-RoPE
          storage (RoPE acts on channel pairs a rotation mixes).
    scores: keys only. "float" scores each key as q . (scale * level + zero); "int8" rounds
          q * scale to int8 once per query head and scale row and scores the codes by integer dot
          products (llama.cpp's q8 path; AVX-512 VNNI / AVX2 / Arm dot-product instructions in the
          native CPU kernel); "int16" rounds it to 32512 steps a side, scored as two int8 digits
          (256 times finer, about half the int8 path's speed-up). Needs uniform levels ("int") in
          per-channel groups and post-RoPE keys; it changes each score by the query's rounding
          (docs/integer_scores.md).
    metadata: how per-token groups store their scale and zero. "float" in the cache's
          `scale_dtype`; "8-bit" as one byte each (`kvq_ao.format`'s `meta`): the scale on a log
          grid of 16 steps an octave (rounded up by at most 4.4%), the zero as a 1/256 fraction of
          the range below 0, so each group's range is widened to contain 0 (a rotated vector's
          always does). Half the bytes of float16 metadata: a quarter bit of every element at
          head_dim 64 with one group a vector. Needs axis "token".
    """

    bits: int | None = None
    axis: str = "token"
    group_size: int = 32
    dtype: str = "int"
    outliers: float = 0.0
    outlier_rule: str = "channel"
    max_outliers: int | None = None
    outlier_dtype: str = "model"
    ranges: str = "online"
    rotation: str = "none"
    scores: str = "float"
    metadata: str = "float"

    def __post_init__(self) -> None:
        if self.bits is not None and (isinstance(self.bits, bool) or self.bits not in SUPPORTED_BITS):
            raise ValueError(f"bits must be one of {SUPPORTED_BITS} or 'none', got {self.bits!r}")
        if self.axis not in AXES:
            raise ValueError(f"axis must be one of {sorted(AXES)}, got {self.axis!r}")
        if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size <= 0:
            raise ValueError(f"group_size must be a positive int, got {self.group_size!r}")
        if self.dtype not in DATATYPES:
            raise ValueError(f"dtype must be one of {DATATYPES}, got {self.dtype!r}")
        if self.dtype != "int" and self.bits is not None and self.bits not in CODEBOOK_BITS:
            raise ValueError(f"dtype {self.dtype!r} supports bits {CODEBOOK_BITS}, got {self.bits}")
        if isinstance(self.outliers, bool) or not isinstance(self.outliers, (int, float)) or not 0 <= self.outliers <= 0.25:
            raise ValueError(f"outliers must be a fraction in [0, 0.25], got {self.outliers!r}")
        object.__setattr__(self, "outliers", float(self.outliers))
        if self.outlier_rule not in OUTLIER_RULES:
            raise ValueError(f"outlier_rule must be one of {OUTLIER_RULES}, got {self.outlier_rule!r}")
        if self.outlier_rule == "vector" and self.axis != "token":
            raise ValueError("outlier_rule 'vector' needs axis 'token' (per-channel groups span tokens, "
                             "so a vector's own extremes do not set their range); use 'channel'")  # fmt: skip
        if self.max_outliers is not None:
            if isinstance(self.max_outliers, bool) or not isinstance(self.max_outliers, int) or self.max_outliers < 1:
                raise ValueError(f"max_outliers must be a positive int or None, got {self.max_outliers!r}")
            if not self.outliers:
                raise ValueError("max_outliers needs outliers > 0 (it sizes the room for them)")
        if self.outlier_dtype not in OUTLIER_DTYPES:
            raise ValueError(f"outlier_dtype must be one of {OUTLIER_DTYPES}, got {self.outlier_dtype!r}")
        if self.ranges not in RANGES:
            raise ValueError(f"ranges must be one of {RANGES}, got {self.ranges!r}")
        if self.rotation not in ROTATIONS:
            raise ValueError(f"rotation must be one of {ROTATIONS}, got {self.rotation!r}")
        if self.scores not in SCORES:
            raise ValueError(f"scores must be one of {SCORES}, got {self.scores!r}")
        if self.scores != "float" and (self.bits is None or self.axis != "channel" or self.dtype != "int"):
            raise ValueError(f"scores {self.scores!r} needs quantized keys with uniform levels (dtype 'int') in per-channel groups "
                             f"(axis 'channel'), got bits {self.bits}, axis {self.axis!r}, dtype {self.dtype!r}")  # fmt: skip
        if self.metadata not in METADATA:
            raise ValueError(f"metadata must be one of {METADATA}, got {self.metadata!r}")
        if self.metadata == "8-bit" and (self.bits is None or self.axis != "token"):
            raise ValueError(f"metadata '8-bit' codes the scale and zero of per-token groups (axis 'token'; their ranges "
                             f"contain 0), got bits {self.bits}, axis {self.axis!r}")  # fmt: skip
        if self.ranges == "calibrated" and self.axis != "channel":
            raise ValueError("ranges 'calibrated' needs axis 'channel' (it fixes each channel's range; per-token "
                             "groups take their range from each token)")  # fmt: skip

    @property
    def needs_calibration(self) -> bool:
        return self.is_quantized and (self.dtype == "nuq" or self.calibrated_ranges
                                      or (self.outliers > 0 and self.outlier_rule == "channel"))  # fmt: skip

    @property
    def calibrated_ranges(self) -> bool:
        """Per-channel ranges fixed by a calibration (quantized on arrival, no metadata per token)."""
        return self.is_quantized and self.ranges == "calibrated"

    @property
    def is_quantized(self) -> bool:
        return self.bits is not None

    @property
    def rotated(self) -> bool:
        """Stored rotated (`rotation`); an unquantized tensor is stored as it is."""
        return self.is_quantized and self.rotation != "none"

    @property
    def query_bits(self) -> int:
        """How the kvq ops score keys of this spec (`kvq_ao.format`'s query_bits)."""
        return _QUERY_BITS[self.scores]

    def at_bits(self, bits: int) -> QuantSpec:
        """This spec at another width, everything else kept (axis, groups, outliers, ranges, rotation,
        metadata). Codebooks exist for 2-4 bits; at 8 bits uniform levels are already near lossless
        (K8V8 KL 6e-5 on SmolLM2), so an 8-bit spec is uniform whatever this one's datatype: the
        rule KVTuner's candidates and the tuned presets share."""
        return dataclasses.replace(self, bits=bits, dtype=self.dtype if bits in CODEBOOK_BITS else "int")

    @property
    def meta(self) -> int:
        """How the kvq ops read this spec's scale and zero (`kvq_ao.format`'s meta): float, or 8-bit
        codes at the format's default exponent for these levels."""
        if self.metadata == "float" or not self.is_quantized:
            return FLOAT_META
        return meta_ints(default_meta_exponent(self.bits, self.dtype != "int"))

    @property
    def axis_id(self) -> int:
        return AXES[self.axis]

    @property
    def token_block(self) -> int:
        """Tokens that must arrive before they can be quantized together."""
        return self.group_size if self.is_quantized and self.axis == "channel" and not self.calibrated_ranges else 1

    def outlier_slots(self, head_dim: int) -> int:
        """Outlier slots of each vector: `max_outliers`, or ceil(outliers * head_dim); 0 unquantized."""
        if not self.is_quantized or not self.outliers:
            return 0
        room = outlier_slots(self.outliers, head_dim)  # also checks head_dim fits the uint8 indices
        return room if self.max_outliers is None else self.max_outliers

    def outlier_values_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype outlier values are stored in for a model of `model_dtype`."""
        return model_dtype if self.outlier_dtype == "model" else getattr(torch, self.outlier_dtype)

    def check_head_dim(self, head_dim: int) -> None:
        if not self.is_quantized:
            return
        if self.max_outliers is not None and self.max_outliers > head_dim:
            raise ValueError(f"max_outliers {self.max_outliers} exceeds head_dim {head_dim}")
        self.outlier_slots(head_dim)  # outliers' uint8 channel indices need head_dim <= 256
        if self.axis == "token" and head_dim % self.group_size:
            raise ValueError(f"group_size {self.group_size} does not divide head_dim {head_dim}")
        per_word = 8 if self.bits == 3 else max(1, 8 // self.bits)
        if head_dim % per_word:
            raise ValueError(f"{self.bits}-bit packing needs head_dim divisible by {per_word}, got {head_dim}")

    def label(self) -> str:
        if self.bits is None:
            return "fp"
        kind = {"int": "int", "nf": "nf", "nuq": "nuq"}[self.dtype]
        out = f"+{self.outliers:.0%}" + ("v" if self.outlier_rule == "vector" else "") if self.outliers else ""
        out += f"x{self.max_outliers}" if self.max_outliers is not None else ""
        out += {"model": "", "float16": "/f16", "bfloat16": "/bf16"}[self.outlier_dtype] if self.outliers else ""
        grouping = "cal" if self.calibrated_ranges else f"{self.axis[0]}{self.group_size}"
        out += {"float": "", "int8": "-q8", "int16": "-q16"}[self.scores]
        out += {"float": "", "8-bit": "-m8"}[self.metadata]
        return ("rot-" if self.rotation != "none" else "") + f"{kind}{self.bits}-{grouping}{out}"

    def to_dict(self) -> dict[str, Any]:
        d = {"bits": "none" if self.bits is None else self.bits, "axis": self.axis, "group_size": self.group_size}
        if self.dtype != "int":
            d["dtype"] = self.dtype
        if self.outliers:
            d["outliers"] = self.outliers
        if self.outlier_rule != "channel":
            d["outlier_rule"] = self.outlier_rule
        if self.max_outliers is not None:
            d["max_outliers"] = self.max_outliers
        if self.outlier_dtype != "model":
            d["outlier_dtype"] = self.outlier_dtype
        if self.ranges != "online":
            d["ranges"] = self.ranges
        if self.rotation != "none":
            d["rotation"] = self.rotation
        if self.scores != "float":
            d["scores"] = self.scores
        if self.metadata != "float":
            d["metadata"] = self.metadata
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantSpec:
        _check_keys(d, {"bits", "axis", "group_size", "dtype", "outliers", "outlier_rule", "max_outliers", "outlier_dtype",
                       "ranges", "rotation", "scores", "metadata"},
                    "QuantSpec")
        bits = d.get("bits", None)
        bits = None if bits in (None, "none") else bits
        return cls(bits=bits, axis=d.get("axis", "token"), group_size=d.get("group_size", 32),
                   dtype=d.get("dtype", "int"), outliers=d.get("outliers", 0.0),
                   outlier_rule=d.get("outlier_rule", "channel"), max_outliers=d.get("max_outliers"),
                   outlier_dtype=d.get("outlier_dtype", "model"), ranges=d.get("ranges", "online"),
                   rotation=d.get("rotation", "none"), scores=d.get("scores", "float"),
                   metadata=d.get("metadata", "float"))  # fmt: skip


FP = QuantSpec(bits=None)


@dataclass(frozen=True)
class LayerKV:
    """The (key, value) specs of one attention layer."""

    key: QuantSpec = FP
    value: QuantSpec = FP

    def __post_init__(self) -> None:
        for name in ("key", "value"):
            if not isinstance(getattr(self, name), QuantSpec):
                raise TypeError(f"LayerKV.{name} must be a QuantSpec, got {type(getattr(self, name)).__name__}")

    @property
    def token_block(self) -> int:
        return math.lcm(self.key.token_block, self.value.token_block)

    def bits_label(self) -> str:
        def one(s: QuantSpec) -> str:
            return "16" if s.bits is None else str(s.bits)

        return f"K{one(self.key)}V{one(self.value)}"

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key.to_dict(), "value": self.value.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LayerKV:
        _check_keys(d, {"key", "value"}, "LayerKV")
        return cls(key=QuantSpec.from_dict(d.get("key", {})), value=QuantSpec.from_dict(d.get("value", {})))


@dataclass(frozen=True)
class DepthSpan:
    """The layers whose centre, as a fraction of the model's depth, lies in [start, end) take `layer`
    (`KVQuantConfig.depth_spans`). With 30 layers, [0, 0.26) holds layers 0-7 and [0.5, 0.76) 15-22."""

    start: float
    end: float
    layer: LayerKV

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise ValueError(f"depth span {name} must be a fraction of the model's depth in [0, 1], got {v!r}")
        if self.start >= self.end:
            raise ValueError(f"depth span start ({self.start}) must be below its end ({self.end})")
        if not isinstance(self.layer, LayerKV):
            raise TypeError(f"depth span layer must be a LayerKV, got {type(self.layer).__name__}")

    def to_dict(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.end, "layer": self.layer.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DepthSpan:
        _check_keys(d, {"start", "end", "layer"}, "depth span")
        missing = {"start", "end", "layer"} - set(d)
        if missing:
            raise ValueError(f"depth span needs {sorted(missing)}")
        return cls(d["start"], d["end"], LayerKV.from_dict(d["layer"]))


@dataclass(frozen=True)
class KVQuantConfig(AOBaseConfig):
    """A whole KV-cache quantization recipe.

    default: the `LayerKV` of every layer not listed in `layers`.
    layers: optional per-layer specs, one per model layer (KVTuner's mixed precision).
    depth_spans: optional `DepthSpan`s, per-layer specs for any layer count: a layer whose centre
        (index + 0.5) / layers falls in a span takes the span's spec (the first span that holds it)
        instead of `default`. For presets that widen the layers doing a job (retrieval lives in a
        few layers' keys) without naming one model's layer indices. Not with `layers`.
    sink_tokens: the first tokens kept in full precision (attention sinks).
    residual_length: the most recent tokens kept in full precision (KIVI's residual). Tokens
        become quantized in blocks once they fall behind this window.
    scale_dtype: dtype of scales and zero points ("float16" halves metadata, as KIVI does).
    pre_rope_keys: store keys before the rotary embedding and rotate them inside attention
        after dequantization (KVQuant). The cache un-rotates the model's keys itself.
    calibration: path of a calibration artifact (`kvq calibrate`) for configs with "nuq"
        datatypes or outliers; "auto" finds (or makes) the model's artifact in the user cache.
    side_dtype: what the full-precision side store (sink and window) holds: "model" (the model's
        dtype) or "float16" / "bfloat16" (half the bytes in a float32 model, as the papers' fp16
        windows; the cache then sees every incoming key and value rounded to it, on every path).
    """

    default: LayerKV = field(default_factory=LayerKV)
    layers: tuple[LayerKV, ...] = ()
    depth_spans: tuple[DepthSpan, ...] = ()
    sink_tokens: int = 0
    residual_length: int = 0
    scale_dtype: str = "float16"
    pre_rope_keys: bool = False
    calibration: str | None = None
    side_dtype: str = "model"
    name: str = "custom"
    version: int = CONFIG_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.default, LayerKV):
            raise TypeError(f"default must be a LayerKV, got {type(self.default).__name__}")
        object.__setattr__(self, "layers", tuple(self.layers))
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, LayerKV):
                raise TypeError(f"layers[{i}] must be a LayerKV, got {type(layer).__name__}")
        object.__setattr__(self, "depth_spans", tuple(self.depth_spans))
        for i, span in enumerate(self.depth_spans):
            if not isinstance(span, DepthSpan):
                raise TypeError(f"depth_spans[{i}] must be a DepthSpan, got {type(span).__name__}")
        if self.layers and self.depth_spans:
            raise ValueError("give per-layer specs either as `layers` (one per model layer) or as `depth_spans`, not both")
        for name in ("sink_tokens", "residual_length"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")
        if not isinstance(self.pre_rope_keys, bool):
            raise ValueError(f"pre_rope_keys must be true or false, got {self.pre_rope_keys!r}")
        if self.calibration is not None and not isinstance(self.calibration, str):
            raise ValueError(f"calibration must be a path, 'auto' or null, got {self.calibration!r}")
        if self.side_dtype not in SIDE_DTYPES:
            raise ValueError(f"side_dtype must be one of {SIDE_DTYPES}, got {self.side_dtype!r}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {self.scale_dtype!r}")
        if self.version != CONFIG_VERSION:
            raise ValueError(f"unsupported config version {self.version!r}; this kvq_ao reads version {CONFIG_VERSION}")
        specs = [(f"layer {i}", layer) for i, layer in enumerate(self.layers or (self.default,))]
        specs += [(f"depth span {j}", span.layer) for j, span in enumerate(self.depth_spans)]
        for where, layer in specs:
            if layer.value.scores != "float":
                raise ValueError(f"{where}: scores {layer.value.scores!r} is for keys (values are weighted by the softmax, not scored)")
            if self.pre_rope_keys and layer.key.scores != "float" and layer.key.is_quantized:
                raise ValueError(f"{where}: {layer.key.scores} key scores need pre_rope_keys false: pre-RoPE keys are rotated per "
                                 "position after dequantization, so their codes cannot be dotted with one query")  # fmt: skip
            if self.pre_rope_keys and layer.key.rotation != "none" and layer.key.is_quantized:
                raise ValueError(f"{where}: rotated keys need pre_rope_keys false: RoPE turns channel pairs by "
                                 "position-dependent angles, which a rotation of head_dim does not commute with")  # fmt: skip
            block = layer.token_block
            if block > 1 and self.sink_tokens >= block:
                raise ValueError(
                    f"{where}: sink_tokens ({self.sink_tokens}) must be smaller than the per-channel "
                    f"token group ({block}) so sink tokens can be left out of the group's range"
                )

    @property
    def needs_calibration(self) -> bool:
        # the specs a model can resolve to: a per-layer list replaces the default (and spans)
        layers = self.layers or (self.default, *(span.layer for span in self.depth_spans))
        return any(s.needs_calibration for layer in layers for s in (layer.key, layer.value))

    # ----------------------------------------------------------------- per-layer view
    def resolve(self, num_layers: int) -> tuple[LayerKV, ...]:
        """One LayerKV per model layer; a per-layer config must match the model's layer count."""
        if self.layers and len(self.layers) != num_layers:
            raise ValueError(
                f"config {self.name!r} has {len(self.layers)} layer specs but the model has {num_layers} layers"
            )
        if self.layers:
            return self.layers

        def spec(i: int) -> LayerKV:
            centre = (i + 0.5) / num_layers
            return next((span.layer for span in self.depth_spans if span.start <= centre < span.end), self.default)

        return tuple(spec(i) for i in range(num_layers))

    def with_layers(self, layers: list[LayerKV] | tuple[LayerKV, ...], name: str | None = None) -> KVQuantConfig:
        return dataclasses.replace(self, layers=tuple(layers), name=name or self.name)

    # ----------------------------------------------------------------- presets
    @classmethod
    def preset(cls, name: str) -> KVQuantConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
        return PRESETS[name]

    @staticmethod
    def preset_names() -> list[str]:
        return list(PRESETS)

    # ----------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "kvq_ao_config": self.version,
            "name": self.name,
            "sink_tokens": self.sink_tokens,
            "residual_length": self.residual_length,
            "scale_dtype": self.scale_dtype,
            "pre_rope_keys": self.pre_rope_keys,
            "calibration": self.calibration,
            **({"side_dtype": self.side_dtype} if self.side_dtype != "model" else {}),
            "default": self.default.to_dict(),
            "layers": [layer.to_dict() for layer in self.layers],
            **({"depth_spans": [span.to_dict() for span in self.depth_spans]} if self.depth_spans else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVQuantConfig:
        if not isinstance(d, dict) or "kvq_ao_config" not in d:
            raise ValueError("not a kvq_ao config: expected a JSON object with a 'kvq_ao_config' version field")
        _check_keys(d, {"kvq_ao_config", "name", "sink_tokens", "residual_length", "scale_dtype", "default", "layers",
                        "pre_rope_keys", "calibration", "side_dtype", "depth_spans"}, "config")  # fmt: skip
        layers, spans = d.get("layers", []), d.get("depth_spans", [])
        for what, v in (("layers", layers), ("depth_spans", spans)):
            if not isinstance(v, list):
                raise ValueError(f"config {what!r} must be a list, got {type(v).__name__}")
        return cls(
            default=LayerKV.from_dict(d.get("default", {})),
            layers=tuple(LayerKV.from_dict(x) for x in layers),
            depth_spans=tuple(DepthSpan.from_dict(x) for x in spans),
            sink_tokens=d.get("sink_tokens", 0),
            residual_length=d.get("residual_length", 0),
            scale_dtype=d.get("scale_dtype", "float16"),
            pre_rope_keys=d.get("pre_rope_keys", False),
            calibration=d.get("calibration", None),
            side_dtype=d.get("side_dtype", "model"),
            name=d.get("name", "custom"),
            version=d["kvq_ao_config"],
        )

    def to_json_key(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def fingerprint(self) -> int:
        """A 48-bit integer naming this config's JSON: what an exported program records (ExecuTorch
        constants are numbers), so a runner given a config can tell whether the program was built with it."""
        return int(hashlib.sha256(self.to_json_key().encode()).hexdigest()[:12], 16)

    def save(self, path: str | Path) -> None:
        """Write the config as JSON, atomically (`kvq_ao.files`)."""
        from kvq_ao.files import atomic_write

        atomic_write(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> KVQuantConfig:
        try:
            data = json.loads(Path(path).read_bytes().decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        try:
            if not isinstance(data, dict):
                raise TypeError(f"a config is a JSON object, got {type(data).__name__}")
            return cls.from_dict(data)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"{path}: invalid kvq_ao config: {e}") from None


def _check_keys(d: Any, allowed: set[str], what: str) -> None:
    if not isinstance(d, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(d).__name__}")
    unknown = set(d) - allowed
    if unknown:
        raise ValueError(f"{what} has unknown field(s) {sorted(unknown)}; allowed: {sorted(allowed)}")


def _kivi(bits: int, scores: str = "float") -> KVQuantConfig:
    return KVQuantConfig(
        default=LayerKV(QuantSpec(bits, "channel", 32, scores=scores), QuantSpec(bits, "token", 32)),
        residual_length=128,
        name=f"kivi-{bits}" + {"float": "", "int8": "-q8", "int16": "" if bits == 4 else "-q16"}[scores],
    )


# How the -1pct presets judge value outliers, per bit width. "vector" is KVQuant's own rule for values
# (per-token thresholds computed online); "channel" uses calibrated per-channel thresholds as for keys.
# Chosen on development text by benchmarks/kvquant_value_outliers.py (2026-12-01, for the earlier
# per-block layout; rule: "vector" where it lowers development PPL). The compact layouts below keep
# no value outliers, so no preset uses it (experiments/kvquant_compact.py does).
VALUE_OUTLIER_RULE: dict[int, str] = {4: "channel", 3: "channel", 2: "vector"}


@dataclass(frozen=True)
class KVQuantLayout:
    """What a kvquant-B preset stores besides its bits (see `_kvquant`)."""

    window: int  # recent tokens kept in full precision (plus one sink token)
    key_slots: int | None  # outlier slots per key vector (None: ceil(1% x head_dim))
    value_group: int = 64  # channels per value scale/zero (64 = one per vector at head_dim 64)
    key_levels: str = "nuq"  # "nuq": calibrated levels; "int": uniform levels inside the calibrated ranges


# Chosen on development text by experiments/kvquant_compact.py (results/kvquant_compact/kvquant_compact.json: the
# lowest development KL to fp among layouts within 5.3 / 4.0 / 3.0 bits per element at 4096 tokens;
# docs/kvquant.md says how that rule came to replace a PPL rule). Keys take calibrated per-channel
# ranges (no per-block metadata, no key block held in float), values one scale/zero per vector,
# outlier values and the full-precision window are float16. What decided most: the window (3 bits:
# 0 tokens +10.3%, 32 +2.9%, 128 +1.3% on development text); at every width a longer float16 window
# without value outliers beat a shorter one with them (KL 0.0125 vs 0.0170 at 3 bits, 0.0034 vs
# 0.0055 at 4 bits); at 4 bits two key outlier slots (KL 0.0039 vs 0.0050 with one). Keys: inside
# calibrated per-channel ranges, uniform levels served better than calibrated nuq levels at 4 bits
# (KL 0.0020 vs 0.0034; the nuq-key 4-bit preset also lost passkeys at the start of the prompt,
# docs/long_context.md). At 3 bits the KL tied (0.0123 vs 0.0125) and development passkeys broke the
# tie for nuq keys (13 vs 12 of 30, round 5 in docs/kvquant.md); at 2 bits nuq won (0.048 vs 0.146).
# Values keep nuq levels.
KVQUANT_LAYOUT: dict[int, KVQuantLayout] = {
    4: KVQuantLayout(window=160, key_slots=2, key_levels="int"),
    3: KVQuantLayout(window=128, key_slots=None),
    2: KVQuantLayout(window=128, key_slots=None),
}


def _kvquant(bits: int, outliers: float) -> KVQuantConfig:
    """KVQuant: pre-RoPE keys with calibrated per-channel ranges (uniform or calibrated nuq levels
    inside them, per width), per-token values with calibrated nuq levels and one scale/zero per
    vector, an attention sink and a float16 full-precision window (`KVQUANT_LAYOUT`). The -1pct presets keep 1% of key entries exact (values keep none: a longer
    window served better, see KVQUANT_LAYOUT), judged by calibrated channel thresholds, which are also the keys' ranges; without outliers
    each channel's range is its calibration min/max (the same layout, KVQuant's "no outliers" ablation).
    """
    layout = KVQUANT_LAYOUT[bits]
    key = QuantSpec(bits, "channel", 128, layout.key_levels, outliers, max_outliers=layout.key_slots if outliers else None,
                    outlier_dtype="float16", ranges="calibrated")  # fmt: skip
    value = QuantSpec(bits, "token", layout.value_group, "nuq", outlier_dtype="float16")  # float16 as the keys', should outliers be added
    return KVQuantConfig(
        default=LayerKV(key, value),
        sink_tokens=1,
        residual_length=layout.window,
        side_dtype="float16",
        pre_rope_keys=True,
        calibration="auto",
        name=f"kvquant-{bits}" + ("-1pct" if outliers else ""),
    )


def _rotated(key_bits: int, value_bits: int) -> KVQuantConfig:
    """Keys and values rotated by the randomized Hadamard matrix (`QuantSpec.rotation`), post-RoPE,
    each vector with its own range and calibrated nuq levels, one float16 sink token and a 112-token
    float16 window: no outlier slots, no per-channel metadata."""
    spec = lambda bits: QuantSpec(bits, "token", 64, "nuq", rotation="hadamard")  # noqa: E731
    return KVQuantConfig(default=LayerKV(spec(key_bits), spec(value_bits)), sink_tokens=1, residual_length=112,
                         side_dtype="float16", calibration="auto", name=f"rot-k{key_bits}v{value_bits}")  # fmt: skip


# Where retrieval lives (docs/rotation.md, "Which layers' keys retrieve"; passkey on development
# prompts): full-precision keys in SmolLM2's layers 0-7 bring back the needle at the start of the
# prompt, in layers 15-22 the one in the middle; no other layers' do. As fractions of depth, so the
# spans name layers of any model, not one model's indices.
RETRIEVAL_SPANS: tuple[tuple[float, float], ...] = ((0.0, 0.26), (0.5, 0.76))


def _rotated_recall(key_bits: int, value_bits: int, wide_key_bits: int, window: int) -> KVQuantConfig:
    """`_rotated` with `wide_key_bits` keys in the layers that retrieve (RETRIEVAL_SPANS), paid for
    with a shorter full-precision window."""
    base = _rotated(key_bits, value_bits)
    wide = LayerKV(dataclasses.replace(base.default.key, bits=wide_key_bits), base.default.value)
    return dataclasses.replace(base, depth_spans=tuple(DepthSpan(a, b, wide) for a, b in RETRIEVAL_SPANS),
                               residual_length=window, name=f"rot-k{key_bits}v{value_bits}-recall")  # fmt: skip


# KVTuner's (key bits, value bits) per layer over the rotated datatypes with 8-bit scale and zero,
# searched on SmolLM2's calibration text under 4.5 and 3.5 bits per element at 4096 tokens (`kvq
# tune --dtype rot --metadata 8-bit --widths 2,3,4,8`; results/tune/tuned-rot-m8-4.5.json and
# -3.5.json, docs/rotation.md). One "KV" pair per layer of SmolLM2's 30, from the first layer.
TUNED_ROTATED_PAIRS: dict[str, str] = {
    "4.5": "33 33 43 43 43 43 43 43 84 43 43 32 32 32 43 43 32 84 84 43 84 43 43 84 84 32 43 32 43 43",
    "3.5": "23 23 32 32 32 42 32 42 43 22 22 32 32 32 42 32 32 43 43 42 43 32 32 44 43 32 42 32 42 22",
}


def _rotated_tuned(budget: str) -> KVQuantConfig:
    """`rot-k4v3`'s layout with 8-bit metadata and KVTuner's pair per layer (TUNED_ROTATED_PAIRS).
    The pairs are depth spans, layer i of n covering [i/n, (i+1)/n), so SmolLM2 takes exactly the
    searched config and a model of another depth the pair found at each layer's relative depth (a
    transfer the search never checked: `kvq tune` searches a model's own)."""
    base = _rotated(4, 3)
    spec = dataclasses.replace(base.default.key, metadata="8-bit")
    pairs = [(int(p[0]), int(p[1])) for p in TUNED_ROTATED_PAIRS[budget].split()]
    layer = lambda pair: LayerKV(spec.at_bits(pair[0]), spec.at_bits(pair[1]))  # noqa: E731
    n, spans, start = len(pairs), [], 0
    for i in range(1, n + 1):  # one span per run of equal pairs
        if i == n or pairs[i] != pairs[start]:
            spans.append(DepthSpan(start / n, i / n, layer(pairs[start])))
            start = i
    return dataclasses.replace(base, default=layer((4, 3)), depth_spans=tuple(spans), name=f"kvtuner-rot-{budget}")


def _kvquant_rotated_values(bits: int) -> KVQuantConfig:
    """KVQuant's keys without outlier slots (pre-RoPE, calibrated ranges and levels) with values
    rotated and coded against calibrated per-channel ranges (no per-vector metadata either), so a
    112-token float16 window fits 2.5 bits per element at 4096 tokens."""
    layout = KVQUANT_LAYOUT[bits]
    key = QuantSpec(bits, "channel", 128, layout.key_levels, outlier_dtype="float16", ranges="calibrated")
    value = QuantSpec(bits, "channel", 128, "nuq", ranges="calibrated", rotation="hadamard")
    return KVQuantConfig(default=LayerKV(key, value), sink_tokens=1, residual_length=112, side_dtype="float16",
                         pre_rope_keys=True, calibration="auto", name=f"kvquant-{bits}-rotv")  # fmt: skip


# The rotated presets: per budget of bits per element at 4096 tokens (4.5, 3.5, 2.5), the layout with
# the lowest KL to fp on development text among 19 candidates (experiments/rotation.py,
# results/rotation/rotation_dev.json; docs/rotation.md).
PRESETS: dict[str, KVQuantConfig] = {
    "fp": KVQuantConfig(name="fp"),
    # 8-bit with KIVI's axes: per-token int8 keys (g64) flipped a near-tie greedy token on SmolLM2
    # (fp margin 0.05 logits); per-channel keys cut the max logit error from 0.44 to 0.12.
    "int8": KVQuantConfig(default=LayerKV(QuantSpec(8, "channel", 32), QuantSpec(8, "token", 32)), name="int8"),
    "int4-token": KVQuantConfig(default=LayerKV(QuantSpec(4, "token", 32), QuantSpec(4, "token", 32)), name="int4-token"),
    # kivi-4's keys are scored against an int16 query (QuantSpec.scores): -0.002 points of fp PPL against
    # float scores on SmolLM2's 48 held-out windows, integer dot products on CPUs (docs/integer_scores.md).
    # kivi-2's stay in float: its windows move by as much when only the thread count changes, so
    # 48 windows cannot show it within issue 48's 0.05 points.
    "kivi-4": _kivi(4, "int16"),
    "kivi-3": _kivi(3),
    "kivi-2": _kivi(2),
    # opt-in integer queries: int8 (+0.067 points on kivi-4), int16 on kivi-2
    "kivi-4-q8": _kivi(4, "int8"),
    "kivi-2-q8": _kivi(2, "int8"),
    "kivi-2-q16": _kivi(2, "int16"),
    **{f"kvquant-{b}": _kvquant(b, 0.0) for b in (4, 3, 2)},
    **{f"kvquant-{b}-1pct": _kvquant(b, 0.01) for b in (4, 3, 2)},
    "rot-k4v3": _rotated(4, 3),
    "rot-k3v2": _rotated(3, 2),
    # rot-k3v2 that keeps passkeys: 4-bit keys in the retrieving layers, a 48-token window (3.46 bits)
    "rot-k3v2-recall": _rotated_recall(3, 2, 4, 48),
    "kvquant-2-rotv": _kvquant_rotated_values(2),
    # KVTuner over the rotated datatypes with 8-bit scale and zero, one (key, value) pair per layer
    "kvtuner-rot-4.5": _rotated_tuned("4.5"),
    "kvtuner-rot-3.5": _rotated_tuned("3.5"),
}


__all__ = ["KVQuantConfig", "LayerKV", "QuantSpec", "DepthSpan", "AXES", "DATATYPES", "OUTLIER_RULES", "RANGES", "SCALE_DTYPES"]
