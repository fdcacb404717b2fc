"""Per-layer sensitivity of a model's KV cache to each (key bits, value bits) pair.

For every layer and candidate pair, the model runs once over calibration tokens with only that
layer quantized (through the real cache and the kvq attention ops), and two signals are recorded:
* the relative attention-output error ||o_q - o|| / ||o|| of that layer (KVTuner's signal;
  layers before it are untouched, so its inputs are exactly the fp ones);
* the KL divergence of the next-token distribution from the fp model's (the end-to-end cost).
A profile is saved as JSON with the model's identity, the base config and the sha256 of its
content, and reused: it is measured, never hand-written, so any edit is refused as damage.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from kvq_ao.config import FP, KVQuantConfig, LayerKV, QuantSpec
from kvq_ao.files import atomic_write
from kvq_ao.tuning.pareto import CANDIDATES, Pair, check_pair

PROFILE_VERSION = 2  # 2: the content's sha256 is recorded and checked


TUNE_DTYPES = ("int", "nf", "kvquant", "rot")


def base_config(residual_length: int = 128, sink_tokens: int = 0, group_size: int = 32, dtype: str = "int",
                pre_rope_keys: bool = False, side_dtype: str = "model", metadata: str = "float") -> KVQuantConfig:  # fmt: skip
    """What every tuned layer shares: KIVI's axes and window (the uniform presets' layout), and the
    datatype of the 2- and 4-bit candidates ("int", or KVQuant's fixed NormalFloat levels "nf").

    dtype "kvquant" tunes over KVQuant's datatypes instead: the layout of the kvquant-B-1pct presets
    (calibrated nuq levels, calibrated key ranges, 1% outliers in float16, pre-RoPE keys, their sink
    and window, which replace the arguments), each width calibrated once (`WidthCalibrations`).
    dtype "rot" tunes over the rotated presets' datatypes (`rot-k4v3`'s layout: post-RoPE keys and
    values rotated per vector with calibrated nuq levels, one float16 sink token and a 112-token float16
    window), calibrated the same way; 8-bit candidates are uniform, still rotated.

    side_dtype holds the window in 16 bits ("float16"/"bfloat16"; `KVQuantConfig.side_dtype`), so a
    tuned int config reaches the effective bits of the compact kvquant presets.

    metadata "8-bit" stores the scale and zero of every per-token group of the base (the values,
    and rot's keys) as one byte each (`QuantSpec.metadata`)."""
    if metadata != "float":
        base = base_config(residual_length, sink_tokens, group_size, dtype, pre_rope_keys, side_dtype)
        lean = lambda spec: dataclasses.replace(spec, metadata=metadata) if spec.is_quantized and spec.axis == "token" else spec  # noqa: E731
        layer = LayerKV(lean(base.default.key), lean(base.default.value))
        return dataclasses.replace(base, default=layer, name=f"{base.name}-m8")
    if dtype not in TUNE_DTYPES:
        raise ValueError(f"dtype must be one of {TUNE_DTYPES}, got {dtype!r}")
    if dtype == "kvquant":
        if side_dtype != "model":
            raise ValueError("side_dtype: the kvquant base keeps its presets' float16 side store; leave it at 'model'")
        preset = KVQuantConfig.preset("kvquant-4-1pct")
        # nuq key levels at every width, KVQuant's datatype, as every tuned kvquant config in results/
        # was made (the 3/4-bit presets hold uniform key levels inside the same calibrated ranges).
        key = dataclasses.replace(preset.default.key, dtype="nuq")
        return dataclasses.replace(preset, default=LayerKV(key, preset.default.value), name="tune-base-kvquant", calibration=None)
    if dtype == "rot":
        if side_dtype != "model":
            raise ValueError("side_dtype: the rot base keeps its presets' float16 side store; leave it at 'model'")
        return dataclasses.replace(KVQuantConfig.preset("rot-k4v3"), name="tune-base-rot", calibration=None)
    bits = 8 if dtype == "int" else 4  # never used (each layer gets its pair); codebooks stop at 4 bits
    return KVQuantConfig(residual_length=residual_length, sink_tokens=sink_tokens, pre_rope_keys=pre_rope_keys, side_dtype=side_dtype,
                         default=LayerKV(QuantSpec(bits, "channel", group_size, dtype), QuantSpec(bits, "token", group_size, dtype)),
                         name="tune-base")  # fmt: skip


def layer_spec(pair: Pair, base: KVQuantConfig) -> LayerKV:
    """The base's layer at `pair`'s (key bits, value bits) (`QuantSpec.at_bits`)."""
    check_pair(pair)
    return LayerKV(base.default.key.at_bits(pair[0]), base.default.value.at_bits(pair[1]))


def assignment_config(pairs: list[Pair], base: KVQuantConfig, name: str = "tuned") -> KVQuantConfig:
    """A per-layer config from one pair per layer."""
    return base.with_layers([layer_spec(p, base) for p in pairs], name=name)


@dataclass
class LayerProfile:
    model: dict
    base: dict
    candidates: list[Pair]
    attn_error: np.ndarray  # [layers, candidates]
    kl: np.ndarray  # [layers, candidates]
    tokens: int
    meta: dict = field(default_factory=dict)

    def column(self, pair: Pair) -> int:
        return self.candidates.index(tuple(pair))

    def layer_kl(self, layer: int, pair: Pair) -> float:
        """KL with only `layer` quantized to `pair`."""
        return float(self.kl[layer, self.column(pair)])

    def predicted_kl(self, layer_pairs: list[Pair]) -> float:
        """KL predicted for a per-layer assignment: the sum of its layers' profiled KLs."""
        return sum(self.layer_kl(layer, p) for layer, p in enumerate(layer_pairs))

    def missing(self, candidates: list[Pair]) -> list[Pair]:
        """The pairs of `candidates` this profile has no column for."""
        return [tuple(p) for p in candidates if tuple(p) not in self.candidates]

    def select(self, candidates: list[Pair]) -> LayerProfile:
        """This profile restricted to `candidates` (all profiled), in their order."""
        if gone := self.missing(candidates):
            raise ValueError(f"pairs {gone} were not profiled")
        cols = [self.column(p) for p in candidates]
        return dataclasses.replace(self, candidates=[tuple(p) for p in candidates], attn_error=self.attn_error[:, cols],
                                   kl=self.kl[:, cols])  # fmt: skip

    def extended(self, other: LayerProfile) -> LayerProfile:
        """This profile with `other`'s columns for pairs it lacks: the same model, base and tokens, so a
        profile grows to new candidate widths without re-profiling the pairs it has."""
        if (other.model, other.base, other.tokens) != (self.model, self.base, self.tokens):
            raise ValueError("can only extend a profile with one of the same model, base config and calibration tokens")
        new = self.missing(other.candidates)
        cols = [other.column(p) for p in new]
        return dataclasses.replace(self, candidates=self.candidates + new,
                                   attn_error=np.concatenate([self.attn_error, other.attn_error[:, cols]], axis=1),
                                   kl=np.concatenate([self.kl, other.kl[:, cols]], axis=1))  # fmt: skip

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = dict(kvq_ao_profile=PROFILE_VERSION, model=self.model, base=self.base, candidates=[list(p) for p in self.candidates],
                    attn_error=self.attn_error.tolist(), kl=self.kl.tolist(), tokens=self.tokens, meta=self.meta)  # fmt: skip
        atomic_write(path, json.dumps(dict(data, sha256=_content_sha256(data))) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> LayerProfile:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
            if not isinstance(d, dict) or d.get("kvq_ao_profile") != PROFILE_VERSION:
                raise ValueError(f"not a kvq_ao layer profile of version {PROFILE_VERSION} (an older kvq_ao's: delete it "
                                 "to profile again)")  # fmt: skip
            if d.pop("sha256", None) != _content_sha256(d):
                raise ValueError("its content differs from the sha256 recorded when it was saved (damaged or edited)")
            cands = [tuple(p) for p in d["candidates"]]
            attn, kl = np.asarray(d["attn_error"], dtype=np.float64), np.asarray(d["kl"], dtype=np.float64)
            if attn.shape != (d["model"]["num_layers"], len(cands)) or kl.shape != attn.shape:
                raise ValueError("table shapes do not match the model's layers and the candidates")
            return cls(d["model"], d["base"], cands, attn, kl, d["tokens"], d.get("meta", {}))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{path}: invalid layer profile ({type(e).__name__}: {e})") from None

    def check_model(self, model) -> None:
        from kvq_ao.calibration import model_key

        want = _model_identity(model)
        if self.model != want:
            raise ValueError(f"this profile was made for {self.model['name']} ({self.model['num_layers']} layers, "
                             f"{self.model['kv_heads']} KV heads, head_dim {self.model['head_dim']}), not for "
                             f"{model_key(model)}; profile this model (kvq tune without --profile)")  # fmt: skip


def _content_sha256(data: dict) -> str:
    """sha256 of a profile's JSON content in a canonical form (keys sorted; floats as JSON writes
    them, which read back exactly)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _model_identity(model) -> dict:
    from kvq_ao.model_info import model_dims
    from kvq_ao.calibration import model_key

    layers, heads, head_dim = model_dims(model)
    return {"name": model_key(model), "num_layers": layers, "kv_heads": heads, "head_dim": head_dim}


def _attention_outputs(model, capture: dict[int, list[torch.Tensor]]):
    """Hooks appending each layer's attention output (the o_proj input) to `capture[layer]`."""
    from kvq_ao.calibration import _attention_modules

    def hook(i):
        return lambda _m, args: capture.setdefault(i, []).append(args[0].detach().float())

    return [a.o_proj.register_forward_pre_hook(hook(i)) for i, a in enumerate(_attention_modules(model))]


@torch.no_grad()
def run_with(model, ids: torch.Tensor, config: KVQuantConfig | None, capture: dict | None = None) -> torch.Tensor:
    """Log-probabilities [S, T, vocab] of ids [S, T], one pass per sequence (fp when config is None)."""
    from kvq_ao.api import make_cache, quantize_kv_

    if config is not None:
        quantize_kv_(model, config)
    out = []
    for row in ids:
        x = row[None]
        logits = model(x).logits if config is None else model(x, cache=make_cache(model, config)).logits
        out.append(F.log_softmax(logits[0].float(), -1))
    return torch.stack(out)


def kl_to(logp_fp: torch.Tensor, logp_q: torch.Tensor) -> float:
    """Mean KL(fp || quantized) per predicted token."""
    return F.kl_div(logp_q.flatten(0, 1), logp_fp.flatten(0, 1), log_target=True, reduction="batchmean").item()


def profile(model, ids: torch.Tensor, base: KVQuantConfig | None = None, candidates: list[Pair] = list(CANDIDATES),
            progress: bool = True, attach=lambda config: config) -> LayerProfile:  # fmt: skip
    """Profile every layer x candidate pair on ids [S, T] (see the module docstring). `attach` gives a
    config its calibration (`WidthCalibrations.attach`) when the base's datatypes need one."""
    from kvq_ao.model_info import model_dims

    base = base or base_config()
    for p in candidates:
        check_pair(p)
    n_layers = model_dims(model)[0]
    fp_out: dict[int, list[torch.Tensor]] = {}
    handles = _attention_outputs(model, fp_out)
    try:
        logp_fp = run_with(model, ids, None)
    finally:
        for h in handles:
            h.remove()
    attn = np.zeros((n_layers, len(candidates)))
    kl = np.zeros((n_layers, len(candidates)))
    fp_layers = [LayerKV(FP, FP)] * n_layers
    bar = tqdm(total=n_layers * len(candidates), desc="profiling layers x pairs", disable=not progress)
    for layer in range(n_layers):
        for j, pair in enumerate(candidates):
            layers = list(fp_layers)
            layers[layer] = layer_spec(pair, base)
            got: dict[int, list[torch.Tensor]] = {}
            handles = _attention_outputs(model, got)
            try:
                logp = run_with(model, ids, attach(base.with_layers(layers, name=f"profile-L{layer}-K{pair[0]}V{pair[1]}")))
            finally:
                for h in handles:
                    h.remove()
            ref, out = torch.cat(fp_out[layer]), torch.cat(got[layer])
            attn[layer, j] = ((out - ref).norm() / ref.norm().clamp(min=1e-30)).item()
            kl[layer, j] = max(kl_to(logp_fp, logp), 1e-12)
            bar.update()
    bar.close()
    return LayerProfile(_model_identity(model), base.to_dict(), [tuple(p) for p in candidates], attn, kl,
                        tokens=int(ids.numel()))  # fmt: skip


__all__ = ["TUNE_DTYPES", "LayerProfile", "assignment_config", "base_config", "kl_to", "layer_spec", "profile", "run_with"]
