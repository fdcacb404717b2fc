"""Artifacts computed once for the model kvq_ao ships with, installed as package data.

Calibrating the KVQuant presets, profiling SmolLM2's layers for KVTuner and searching a tuned
config take minutes on a laptop and give the same files for everyone who runs the packaged
model, so kvq_ao ships them (`kvq_ao/shipped/`, a few hundred KB) and a first `kvq demo` only
evaluates. The shipped tree mirrors the user cache (`kvq_ao.models.cache_dir()`):

    calibration/<model key>/<preset>.json + .safetensors    (`kvq calibrate`)
    tune/<layer profile>.json                                (`kvq tune`'s profile)
    tune/<model key>-tuned-<budget>bit.json                  (`kvq demo`'s tuned config)

`seed(path)` copies the shipped twin of a user-cache path into the user cache when that path is
missing, so shipped and self-made files go through one loader and its checks (format version,
sha256 of the tensors, made for this model and this preset's layout); a shipped file that no
longer fits its preset is remade like any stale cache entry. `benchmarks/ship_artifacts.py`
regenerates the tree from scratch, and tests check that every shipped file still loads and fits.
"""

from __future__ import annotations

import glob
import shutil
from pathlib import Path

from kvq_ao.files import replacing

SHIPPED = Path(__file__).parent / "shipped"


def shipped_twin(path: Path) -> Path | None:
    """The shipped file at `path`'s place in the user cache, or None."""
    from kvq_ao.models import cache_dir

    try:
        relative = Path(path).resolve().relative_to(cache_dir().resolve())
    except ValueError:
        return None
    twin = SHIPPED / relative
    return twin if twin.is_file() else None


def seed(path: Path) -> Path:
    """Copy `path`'s shipped twin (and its companions: same stem, other suffixes) into the user
    cache when `path` is missing; returns `path`. Each file is written under a temporary name and
    renamed, the named file last, so a reader never sees it without its companions."""
    path = Path(path)
    twin = None if path.exists() else shipped_twin(path)
    if twin is None:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    companions = sorted(twin.parent.glob(glob.escape(twin.stem) + ".*"), key=lambda f: f.name == twin.name)
    for src in companions:
        with replacing(path.parent / src.name) as tmp:
            shutil.copyfile(src, tmp)
    return path


__all__ = ["SHIPPED", "seed", "shipped_twin"]
