"""Offline calibration for KVQuant's datatypes: Fisher-weighted codebooks and outlier thresholds.

`calibrate(model, texts, config)` runs the model on calibration text (never the evaluation
text), collects every layer's keys (pre-RoPE when the config says so) and values together with
their Fisher information (squared gradients of the language-model loss with respect to those
activations, one backward pass per sample), and fits what the config's specs need:

* outlier thresholds: per channel, the (f/2, 1 - f/2) quantiles of the calibration activations
  for an outlier fraction f (`kvq_ao.quant.outliers`), for specs whose outlier_rule is "channel"
  ("vector" outliers are judged online and need none); for specs with calibrated ranges they are
  also each channel's fixed quantization range (min/max when f = 0; sink tokens left out);
* "nuq" codebooks: per layer, for keys and values separately, 2**bits levels from 1-D k-means
  on the activations normalized exactly as the cache normalizes them (groups, outlier clamping,
  sink tokens left out), each entry weighted by its Fisher information (KVQuant: the levels go
  where errors hurt the loss), optionally with Q-Norm (the dequantized distribution's mean and
  standard deviation matched to the original's).

The result is a `Calibration`: a safetensors file of tensors plus a JSON file of metadata (no
pickle), checked on load against the model and config it is used with.
"""

from __future__ import annotations

import contextlib
import datetime
import glob
import hashlib
import json
import sys
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from kvq_ao import artifacts
from kvq_ao.files import atomic_write, sha256_of
from kvq_ao.cache import TensorCalibration
from kvq_ao.config import KVQuantConfig, LayerKV, QuantSpec
from kvq_ao.model_info import check_model, model_dims, rotary_of
from kvq_ao.models import CALIBRATION_SAMPLES, CALIBRATION_SEQ_LEN, cache_dir, calibration_windows, pydoc_text, text_windows
from kvq_ao.quant import rotation
from kvq_ao.quant.rope import rotate
from kvq_ao.quant.codebook import normalize
from kvq_ao.quant.outliers import split_vector_outliers
from kvq_ao.quant.uniform import AXIS_CHANNEL, fixed_range

CALIBRATION_VERSION = 1
KINDS = ("key", "value")


# ----------------------------------------------------------------------------- artifact
class Calibration:
    """Per-layer codebooks and outlier thresholds for one model and one config."""

    def __init__(self, meta: dict, tensors: dict[str, torch.Tensor]):
        self.meta, self.tensors = meta, tensors

    @staticmethod
    def key(layer: int, kind: str, what: str) -> str:
        return f"layers.{layer}.{kind}.{what}"

    def layer(self, i: int) -> tuple[TensorCalibration, TensorCalibration]:
        def one(kind: str) -> TensorCalibration:
            get = lambda what: self.tensors.get(self.key(i, kind, what))  # noqa: E731
            return TensorCalibration(codebook=get("codebook"), lo=get("lo"), hi=get("hi"))

        return one("key"), one("value")

    # -- checks
    def check(self, config: KVQuantConfig, num_layers: int) -> None:
        """Raise a clear error unless this calibration was made for `config` on a model with `num_layers`."""
        model = self.meta["model"]
        if model["num_layers"] != num_layers:
            raise ValueError(f"calibration {self.name!r} was made for a model with {model['num_layers']} layers, "
                             f"this model has {num_layers}")  # fmt: skip
        if not self.made_for(config, num_layers):
            made_for = self.meta["config"].get("name", "?")
            raise ValueError(f"calibration {self.name!r} was made for config {made_for!r}, whose layer specs, "
                             f"pre_rope_keys or sink_tokens differ from {config.name!r}; calibrate this config "
                             f"(kvq calibrate --preset/--config)")  # fmt: skip

    def made_for(self, config: KVQuantConfig, num_layers: int) -> bool:
        """Whether this calibration fits `config`: the same layer specs, key placement and sink (what
        the fit depends on; neither the full-precision window nor the dtype outlier values are
        stored in changes what gets quantized how)."""
        made_for = KVQuantConfig.from_dict(self.meta["config"])

        def fitted(cfg: KVQuantConfig) -> tuple:
            specs = [LayerKV(*(dataclasses.replace(s, outlier_dtype="model") for s in (kv.key, kv.value)))
                     for kv in cfg.resolve(num_layers)]  # fmt: skip
            return specs, cfg.pre_rope_keys, cfg.sink_tokens

        try:
            return fitted(made_for) == fitted(config)
        except ValueError:  # a per-layer config for another layer count
            return False

    def check_model(self, num_layers: int, kv_heads: int, head_dim: int) -> None:
        model = self.meta["model"]
        want = (model["num_layers"], model["kv_heads"], model["head_dim"])
        if want != (num_layers, kv_heads, head_dim):
            raise ValueError(
                f"calibration {self.name!r} was made for {model.get('name', '?')} ({want[0]} layers, {want[1]} KV heads, "
                f"head_dim {want[2]}), not for this model ({num_layers} layers, {kv_heads} KV heads, head_dim {head_dim})"
            )

    @property
    def name(self) -> str:
        return self.meta.get("path", self.meta["config"].get("name", "?"))

    # -- files
    def save(self, path: str | Path) -> Path:
        """Write `path` (.json metadata) and its .safetensors next to it; returns the JSON path.

        Both atomically, the tensors first under a name holding their checksum
        (`<name>.<sha256[:12]>.safetensors`), then the JSON naming them: a reader sees a whole
        calibration or none, and two writers racing on one path leave one whole calibration (each
        JSON names its own tensors). Tensors files no JSON names any more are removed after an hour."""
        from safetensors.torch import save as to_bytes

        path = Path(path).with_suffix(".json")
        data = to_bytes({k: v.contiguous() for k, v in self.tensors.items()})
        digest = hashlib.sha256(data).hexdigest()
        tensor_path = atomic_write(path.with_name(f"{path.stem}.{digest[:12]}.safetensors"), data)
        meta = dict(self.meta, tensors_file=tensor_path.name, tensors_sha256=digest)
        meta.pop("path", None)
        atomic_write(path, json.dumps(meta, indent=2) + "\n")
        _remove_stale_tensors(path, keep=tensor_path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        from safetensors.torch import load_file

        path = Path(path).with_suffix(".json")
        if not path.exists():
            raise FileNotFoundError(f"no calibration at {path} (make one with `kvq calibrate`)")
        try:
            meta = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: corrupt calibration metadata ({e})") from None
        if not isinstance(meta, dict) or meta.get("kvq_ao_calibration") != CALIBRATION_VERSION:
            raise ValueError(f"{path}: not a kvq_ao calibration (version {CALIBRATION_VERSION}) file")
        for field in ("model", "config", "tensors_file", "tensors_sha256"):
            if field not in meta:
                raise ValueError(f"{path}: calibration metadata lacks {field!r}")
        tensor_path = path.parent / meta["tensors_file"]
        if not tensor_path.exists():
            raise FileNotFoundError(f"{path}: its tensors file {tensor_path} is missing")
        if sha256_of(tensor_path) != meta["tensors_sha256"]:
            raise ValueError(f"{tensor_path}: corrupt or truncated (checksum differs from {path.name})")
        try:
            tensors = load_file(str(tensor_path))
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"{tensor_path}: unreadable safetensors file ({e})") from None
        meta["path"] = str(path)
        return cls(meta, tensors)


def _remove_stale_tensors(path: Path, keep: Path, age_s: float = 3600.0) -> None:
    """Tensors files of earlier saves of `path` (`<stem>.<hash>.safetensors`) older than `age_s`: a
    concurrent writer's fresh file may still be about to be named by its JSON, an old one is not."""
    import time

    for f in path.parent.glob(glob.escape(path.stem) + ".*.safetensors"):
        if f != keep and f.stem.rsplit(".", 1)[0] == path.stem:
            with contextlib.suppress(OSError):
                if time.time() - f.stat().st_mtime > age_s:
                    f.unlink()


# ----------------------------------------------------------------------------- activations
@dataclass
class Activations:
    """Per layer: keys and values [S, H, T, D] (keys as the config stores them) and their Fisher info."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    key_fisher: list[torch.Tensor]
    value_fisher: list[torch.Tensor]
    pre_rope: bool

    def of(self, kind: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return (self.keys, self.key_fisher) if kind == "key" else (self.values, self.value_fisher)


def _attention_modules(model) -> list[torch.nn.Module]:
    mods = [m for m in model.modules() if hasattr(m, "k_proj") and hasattr(m, "v_proj") and hasattr(m, "layer_idx")]
    return sorted(mods, key=lambda m: m.layer_idx)


def collect(model, ids: torch.Tensor, pre_rope: bool, progress: bool = True) -> Activations:
    """Run `ids` [S, T] one sample at a time; record K/V activations and their squared gradients.

    Keys are hooked where they leave the projection (after a per-head k_norm if the model has
    one): that is the pre-RoPE key. Post-RoPE keys and their gradients follow by rotation.
    """
    attns = _attention_modules(model)
    if not attns:
        raise ValueError("calibration: found no attention modules with k_proj/v_proj")
    n_layers = len(attns)
    head_dim = attns[0].head_dim
    leaves: dict[tuple[int, str], torch.Tensor] = {}

    def hook(i: int, kind: str):
        def fn(_mod, _inp, out):
            leaf = out.detach().requires_grad_(True)
            leaves[(i, kind)] = leaf
            return leaf

        return fn

    handles = []
    for i, a in enumerate(attns):
        key_src = a.k_norm if hasattr(a, "k_norm") else a.k_proj
        handles.append(key_src.register_forward_hook(hook(i, "key")))
        handles.append(a.v_proj.register_forward_hook(hook(i, "value")))
    acts = {(i, kind): [] for i in range(n_layers) for kind in KINDS}
    fisher = {(i, kind): [] for i in range(n_layers) for kind in KINDS}
    ropes = rotary_of(model)  # per layer
    was_training = model.training
    requires = [p.requires_grad for p in model.parameters()]
    try:
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        for s in tqdm(range(ids.shape[0]), desc="calibration forward/backward", disable=not progress):
            x = ids[s : s + 1]
            with torch.enable_grad():  # calibration may be triggered from inside no_grad (eval, generate)
                logits = model(input_ids=x, use_cache=False).logits
                loss = F.cross_entropy(logits[0, :-1].float(), x[0, 1:])
                loss.backward()
            for (i, kind), leaf in leaves.items():
                t = x.shape[1]
                a = leaf.detach().reshape(1, t, -1, head_dim).transpose(1, 2)[0].float()  # [H, T, D]
                g = leaf.grad.reshape(1, t, -1, head_dim).transpose(1, 2)[0].float()
                if kind == "key" and not pre_rope:
                    pos = torch.arange(t)
                    inv_freq, rope_scale = ropes[i]
                    a = rotate(a, pos, inv_freq, rope_scale)
                    g = rotate(g, pos, inv_freq, 1.0 / rope_scale)  # dL/dk_post = R dL/dk_pre / s
                acts[(i, kind)].append(a)
                fisher[(i, kind)].append(g.square())
            leaves.clear()
    finally:
        for h in handles:
            h.remove()
        for p, r in zip(model.parameters(), requires):
            p.requires_grad_(r)
        model.train(was_training)
    stack = lambda d, kind: [torch.stack(d[(i, kind)]) for i in range(n_layers)]  # noqa: E731
    return Activations(stack(acts, "key"), stack(acts, "value"), stack(fisher, "key"), stack(fisher, "value"), pre_rope)


# ----------------------------------------------------------------------------- fitting
THRESHOLD_MARGIN = 1e-4


def channel_thresholds(x: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [S, H, T, D] -> per-channel (lo, hi) [H, D] at the (f/2, 1 - f/2) quantiles.

    Each threshold is moved outward by 1e-4 of its channel's range: a quantile is often a real
    activation (layer-0 pre-RoPE keys depend only on the token id, so frequent tokens repeat
    exact values), and an entry sitting exactly on a threshold would flip between outlier and
    dense on a 1-ulp difference between runtimes (seen: ONNX/ExecuTorch vs eager).
    """
    h, d = x.shape[1], x.shape[3]
    flat = x.permute(1, 3, 0, 2).reshape(h * d, -1)
    q = torch.tensor([fraction / 2, 1 - fraction / 2], dtype=torch.float32)
    lo, hi = torch.quantile(flat, q, dim=1)  # [H*D] each
    margin = THRESHOLD_MARGIN * (hi - lo).clamp(min=torch.finfo(torch.float32).tiny)
    return (lo - margin).reshape(h, d).contiguous(), (hi + margin).reshape(h, d).contiguous()


def normalized(x: torch.Tensor, spec: QuantSpec, sink: int, lo: torch.Tensor | None, hi: torch.Tensor | None):
    """(u in [0, 1], keep mask) of x [S, H, T, D] as the cache normalizes it before the level search.

    Entries kept exact as outliers and sink tokens are masked out of the fit.
    """
    keep = torch.ones_like(x, dtype=torch.bool)
    if spec.outliers > 0 and spec.outlier_rule == "vector":
        x, _, _, is_outlier = split_vector_outliers(x, spec.outlier_slots(x.shape[-1]), spec.group_size)
        keep &= ~is_outlier
    if lo is not None:
        lo4, hi4 = lo[None, :, None, :], hi[None, :, None, :]
        keep &= (x >= lo4) & (x <= hi4)
        x = torch.minimum(torch.maximum(x, lo4), hi4)
    if sink:
        keep[:, :, :sink] = False
    if spec.calibrated_ranges:  # every token against its channel's fixed range, as the cache codes it
        zero, scale = (t.float()[None, :, None, :] for t in fixed_range(lo, hi, 1, torch.float16))
        u = (x - zero) / torch.where(scale > 0, scale, torch.ones_like(scale))
        return u.clamp(0.0, 1.0), keep
    if sink:
        if spec.axis_id == AXIS_CHANNEL:  # the cache stands the block's last token in for sink tokens
            x = x.clone()
            x[:, :, :sink] = x[:, :, spec.group_size - 1 : spec.group_size]
    u = normalize(x, spec.axis_id, spec.group_size, meta=spec.meta)[0].reshape(x.shape)  # against the range as stored
    return u.clamp(0.0, 1.0), keep


def weighted_kmeans_1d(u: torch.Tensor, w: torch.Tensor, k: int, iters: int = 60, seed: int = 0) -> torch.Tensor:
    """Sorted k levels minimizing sum w * (u - level)^2 (Lloyd's algorithm in one dimension).

    Initialized at weighted quantiles; an empty cluster keeps its level.
    """
    u, w = u.double().flatten(), w.double().flatten()
    if u.numel() == 0 or float(w.sum()) <= 0:
        raise ValueError("k-means needs points with positive total weight")
    order = torch.argsort(u)
    cdf = torch.cumsum(w[order], 0) / w.sum()
    targets = (torch.arange(k, dtype=torch.float64) + 0.5) / k
    levels = u[order][torch.searchsorted(cdf, targets).clamp(max=u.numel() - 1)]
    for _ in range(iters):
        mids = (levels[1:] + levels[:-1]) / 2
        code = torch.bucketize(u, mids)
        mass = torch.zeros(k, dtype=torch.float64).index_add_(0, code, w)
        total = torch.zeros(k, dtype=torch.float64).index_add_(0, code, w * u)
        new = torch.where(mass > 0, total / mass.clamp(min=1e-300), levels)
        new, _ = torch.sort(new)
        if torch.allclose(new, levels, atol=1e-9, rtol=0):
            levels = new
            break
        levels = new
    return levels.clamp(0.0, 1.0).float()


def qnorm(levels: torch.Tensor, u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Q-Norm: shift/scale levels so the dequantized values' mean and std match the originals'."""
    u, w = u.double().flatten(), w.double().flatten()
    lv = levels.double()
    q = lv[torch.bucketize(u, (lv[1:] + lv[:-1]) / 2)]
    mean = lambda v: (w * v).sum() / w.sum()  # noqa: E731
    mu, mq = mean(u), mean(q)
    su, sq = mean((u - mu) ** 2).sqrt(), mean((q - mq) ** 2).sqrt()
    out = (lv - mq) / sq.clamp(min=1e-12) * su + mu
    return torch.sort(out.clamp(0.0, 1.0))[0].float()


def _subsample(n: int, limit: int, seed: int) -> torch.Tensor | None:
    if n <= limit:
        return None
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:limit]


def fit(acts: Activations, config: KVQuantConfig, fisher: bool = True, use_qnorm: bool = False,
        max_points: int = 400_000, progress: bool = True) -> dict[str, torch.Tensor]:  # fmt: skip
    """The calibration tensors `config` needs, fitted on `acts`."""
    n_layers = len(acts.keys)
    specs = config.resolve(n_layers)
    tensors: dict[str, torch.Tensor] = {}
    jobs = [(i, kind) for i in range(n_layers) for kind in KINDS if getattr(specs[i], kind).needs_calibration]
    for i, kind in tqdm(jobs, desc="fitting codebooks/thresholds", disable=not progress):
        spec: QuantSpec = getattr(specs[i], kind)
        x_all, f_all = acts.of(kind)
        x, f = x_all[i], f_all[i]
        if spec.rotated:  # fitted to what the cache stores: x R. The Fisher weight of a rotated
            # coordinate needs the gradient itself, (g R)_j^2; with g^2 alone, its expectation over
            # a rotation that spreads g evenly, |g|^2 / D, for every coordinate of the vector
            x = rotation.rotate(x, rotation.rotation_matrix(x.shape[-1], x.device))
            f = f.mean(-1, keepdim=True).expand_as(f)
        lo = hi = None
        if spec.calibrated_ranges or (spec.outliers > 0 and spec.outlier_rule == "channel"):
            # Calibrated ranges leave the sink tokens out (kept in full precision, they would set
            # every channel's min/max); outlier thresholds alone keep the fit they always had.
            fitted = x[:, :, config.sink_tokens :] if spec.calibrated_ranges else x
            lo, hi = channel_thresholds(fitted, spec.outliers)
            tensors[Calibration.key(i, kind, "lo")] = lo
            tensors[Calibration.key(i, kind, "hi")] = hi
        if spec.dtype == "nuq":
            u, keep = normalized(x, spec, config.sink_tokens, lo, hi)
            w = f if fisher else torch.ones_like(f)
            u, w = u[keep], w[keep]
            pick = _subsample(u.numel(), max_points, seed=i)
            if pick is not None:
                u, w = u[pick], w[pick]
            levels = weighted_kmeans_1d(u, w, 2**spec.bits)
            if use_qnorm:
                levels = qnorm(levels, u, w)
            tensors[Calibration.key(i, kind, "codebook")] = levels
    return tensors


# ----------------------------------------------------------------------------- entry points
def calibrate(model, texts, config: KVQuantConfig, *, tokenizer=None, samples: int = CALIBRATION_SAMPLES,
              seq_len: int = CALIBRATION_SEQ_LEN,
              fisher: bool = True, use_qnorm: bool = False, activations: Activations | None = None,
              progress: bool = True) -> Calibration:  # fmt: skip
    """Calibrate `config` on `texts` (a string, a list of strings, or token ids [S, T]).

    Returns a `Calibration`; `.save(path)` writes it. Pass `activations` (from `collect`) to fit
    several configs on one pass over the model.
    """
    check_model(model, config)
    n_layers, kv_heads, head_dim = model_dims(model)
    if activations is None:
        if isinstance(texts, torch.Tensor):
            ids = texts
        else:
            tokenizer = tokenizer or getattr(model, "kvq_tokenizer", None)
            if tokenizer is None:
                raise ValueError("calibrate: pass token ids or a tokenizer= for text")
            text = texts if isinstance(texts, str) else "\n\n".join(texts)
            ids = text_windows(tokenizer, text, samples, seq_len)
        _check_sample_len(config, n_layers, ids.shape[1])
        activations = collect(model, ids, config.pre_rope_keys, progress)
    elif activations.pre_rope != config.pre_rope_keys:
        raise ValueError("these activations were collected with a different pre_rope_keys setting")
    tensors = fit(activations, config, fisher=fisher, use_qnorm=use_qnorm, progress=progress)
    meta = {
        "kvq_ao_calibration": CALIBRATION_VERSION,
        "model": {"name": model_key(model), "num_layers": n_layers, "kv_heads": kv_heads, "head_dim": head_dim},
        "config": config.to_dict(),
        "fisher_weighted": fisher,
        "qnorm": use_qnorm,
        "samples": int(activations.keys[0].shape[0]),
        "seq_len": int(activations.keys[0].shape[2]),
        "created": datetime.date.today().isoformat(),
    }
    return Calibration(meta, tensors)


def _check_sample_len(config: KVQuantConfig, n_layers: int, seq_len: int) -> None:
    for spec in config.resolve(n_layers):
        for s in (spec.key, spec.value):
            if s.needs_calibration and s.token_block > 1 and seq_len % s.group_size:
                raise ValueError(f"calibration samples of {seq_len} tokens are not whole blocks of {s.group_size}")


def model_key(model) -> str:
    """A file-name-safe identity for a model: its folder name plus its KV shape."""
    name = Path(str(getattr(model, "name_or_path", "") or "model")).name or "model"
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    layers, heads, head_dim = model_dims(model)
    return f"{name}-L{layers}-H{heads}-D{head_dim}"


def default_path(model, config: KVQuantConfig) -> Path:
    return cache_dir() / "calibration" / model_key(model) / f"{config.name}.json"


def _cached(model, config: KVQuantConfig, n_layers: int) -> bool:
    path = artifacts.seed(default_path(model, config))
    return path.exists() and Calibration.load(path).made_for(config, n_layers)


def calibrate_missing(model, configs: list[KVQuantConfig], log=lambda msg: print(msg, file=sys.stderr)) -> list[str]:
    """Make the user-cache calibration of every config that uses it ("auto") and lacks one.

    What `for_model` would do on first use, but with one activation pass (the slow part: a
    forward and a backward per sample) shared by all configs of the same key layout. Returns the
    names calibrated."""
    n_layers = model_dims(model)[0]
    missing = [c for c in configs if c.needs_calibration and c.calibration in (None, "auto") and not _cached(model, c, n_layers)]
    tokenizer = getattr(model, "kvq_tokenizer", None)
    if missing and tokenizer is None:
        raise ValueError("calibrate_missing: the model has no kvq_tokenizer (load it with kvq_ao.load_model)")
    for pre_rope in sorted({c.pre_rope_keys for c in missing}):
        group = [c for c in missing if c.pre_rope_keys == pre_rope]
        log(f"kvq_ao: calibrating {', '.join(c.name for c in group)} on pydoc calibration text (once; saved to the user cache)")
        activations = collect(model, calibration_windows(tokenizer), pre_rope)
        for config in group:
            calibrate(model, None, config, activations=activations).save(default_path(model, config))
    return [c.name for c in missing]


def for_model(model, config: KVQuantConfig, log=lambda msg: print(msg, file=sys.stderr)) -> Calibration:
    """The calibration `config` names ("auto": the user cache, made on first use), checked against the model."""
    dims = model_dims(model)
    if config.calibration not in (None, "auto"):
        calib = Calibration.load(config.calibration)
    else:
        path = artifacts.seed(default_path(model, config))  # the shipped calibration, for the packaged model
        calib = Calibration.load(path) if path.exists() else None
        if calib is not None and not calib.made_for(config, dims[0]):
            # The user cache is ours: a preset whose layout changed between versions is remade, not refused.
            log(f"kvq_ao: the cached calibration {path} was made for another layout of {config.name!r}; recalibrating")
            calib = None
        if calib is None:
            log(f"kvq_ao: no calibration of {config.name!r} for {model_key(model)} yet; calibrating on pydoc "
                f"calibration text (once; saved to {path})")  # fmt: skip
            calib = calibrate(model, pydoc_text("calib"), config)
            calib.save(path)
            calib = Calibration.load(path)
    calib.check_model(*dims)
    calib.check(config, dims[0])
    return calib


__all__ = ["Activations", "Calibration", "calibrate", "calibrate_missing", "collect", "default_path", "for_model", "model_key"]
