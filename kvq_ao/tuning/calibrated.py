"""Calibrations for tuning over KVQuant's datatypes: one per bit width, combined per layer.

A per-layer config mixing 2-, 4- and 8-bit layers needs each layer's codebooks and channel ranges
fitted for that layer's width. A calibration's fit is per layer and per kind (keys, values): a
layer's tensors depend only on its own activations and its own spec. So each width is calibrated
once, as a uniform config of that width (in the user cache, on the shared calibration text, like
any preset), and the calibration of any mix is assembled from them layer by layer: the same
tensors calibrating the mix itself would fit, without a pass over the model per assignment.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from kvq_ao.calibration import Calibration, calibrate, calibrate_missing, collect, default_path, model_key
from kvq_ao.config import KVQuantConfig
from kvq_ao.model_info import model_dims


class WidthCalibrations:
    """The calibration of every width a calibrated tuning base uses, and `attach(config)`, which gives
    a per-layer config the calibration assembled for it."""

    def __init__(self, model, base: KVQuantConfig, layer_spec, widths: tuple[int, ...] = (2, 4, 8),
                 calibration_ids: torch.Tensor | None = None, folder: Path | None = None):  # fmt: skip
        """Calibrates each width on pydoc's calibration text into the user cache (once, as `kvq calibrate`
        would), or on `calibration_ids` [S, T] into `folder` when given (tests, other text)."""
        from kvq_ao.models import cache_dir

        self.n_layers = model_dims(model)[0]
        self.folder = Path(folder) if folder else cache_dir() / "tune" / "calibrations" / model_key(model)
        self.uniform = {w: dataclasses.replace(base.with_layers([], name=f"{base.name}-{w}bit"), calibration="auto",
                                               default=layer_spec((w, w), base)) for w in widths}  # fmt: skip
        needed = {w: c for w, c in self.uniform.items() if c.needs_calibration}
        if calibration_ids is None:  # widths already calibrated are loaded, not refitted
            calibrate_missing(model, list(needed.values()))
            self.by_width = {w: Calibration.load(default_path(model, c)) for w, c in needed.items()}
            return
        acts = collect(model, calibration_ids, base.pre_rope_keys, progress=False)
        self.by_width = {}
        for w, c in needed.items():
            path = calibrate(model, None, c, activations=acts, progress=False).save(self.folder / f"{c.name}.json")
            self.by_width[w] = Calibration.load(path)

    def assemble(self, config: KVQuantConfig) -> Calibration:
        """The calibration of a per-layer config whose layers each use one of the calibrated widths."""
        tensors, meta = {}, None
        for i, layer in enumerate(config.resolve(self.n_layers)):
            for kind in ("key", "value"):
                spec = getattr(layer, kind)
                if not spec.needs_calibration:
                    continue
                source = self.by_width.get(spec.bits)
                width_spec = getattr(self.uniform[spec.bits].default, kind) if source is not None else None
                if width_spec != spec:
                    raise ValueError(f"layer {i} {kind}s ({spec.label()}) match no calibrated width of this tuning base")
                prefix = f"layers.{i}.{kind}."
                tensors.update({k: t for k, t in source.tensors.items() if k.startswith(prefix)})
                meta = meta or source.meta
        if meta is None:
            raise ValueError(f"config {config.name!r} needs no calibration")
        meta = {k: v for k, v in meta.items() if k not in ("tensors_file", "tensors_sha256", "path")}
        return Calibration(dict(meta, config=config.to_dict(), assembled_from=sorted(self.by_width)), tensors)

    def attach(self, config: KVQuantConfig) -> KVQuantConfig:
        """`config` with its assembled calibration saved (once per distinct layout) and named."""
        if not config.needs_calibration:
            return config
        what = dict(config.to_dict(), name=None, calibration=None, default=None,
                    layers=[layer.to_dict() for layer in config.resolve(self.n_layers)])  # fmt: skip
        layout = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
        path = self.folder / f"{layout}.json"
        if not path.exists():
            self.assemble(config).save(path)
        return dataclasses.replace(config, calibration=str(path))


__all__ = ["WidthCalibrations"]
