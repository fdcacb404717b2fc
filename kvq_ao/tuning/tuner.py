"""`tune(model, ids, max_avg_bits)`: profile (cached), prune, cluster, search; the chosen config.

The loss everywhere is KL(fp || quantized) of the next-token distribution on calibration tokens,
measured through the real cache path; pruning and clustering use each layer's KL profile (the
end-to-end signal; attention-output error is recorded beside it), the search measures whole
assignments. The profile also predicts a whole assignment's KL as the sum of its layers' KLs;
the exact best predictions (`predicted_front`) seed the measured search, and the chosen
assignment's predicted and measured KL are both reported. Average bits are nominal: the mean of
(key bits + value bits) / 2 over layers.
"""

from __future__ import annotations

import csv
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvq_ao import artifacts
from kvq_ao.files import replacing
from kvq_ao.config import KVQuantConfig
from kvq_ao.tuning.cluster import cluster_layers, group_candidates
from kvq_ao.tuning.pareto import KVTUNER_WIDTHS, Pair, candidate_pairs, pair_bits, prune
from kvq_ao.tuning.calibrated import WidthCalibrations
from kvq_ao.tuning.profile import LayerProfile, assignment_config, base_config, kl_to, layer_spec, profile, run_with
from kvq_ao.tuning.search import SearchResult, predicted_front, search

def default_profile_path(model, base: KVQuantConfig, ids: torch.Tensor, log=print) -> Path:
    """Where `tune` keeps `model`'s layer profile for this base config and calibration size, in the
    user cache; seeded from a shipped profile of the same name when kvq_ao has one (profiling
    SmolLM2 takes ~8 minutes on 2 cores, the search from a profile ~1.5; `kvq_ao.artifacts`). A
    cached profile that does not load (damaged, or written by an older kvq_ao) is removed, with
    the reason logged, so it is seeded or profiled again like a missing one."""
    from kvq_ao.calibration import model_key
    from kvq_ao.models import cache_dir

    key = base.default.key
    variant = ("" if key.dtype == "int" else f"-{key.dtype}") + ("-prerope" if base.pre_rope_keys else "")
    variant += "" if base.side_dtype == "model" else f"-side-{base.side_dtype}"
    variant += "" if base.default.value.metadata == "float" else "-m8"
    if base.needs_calibration:  # the whole layout (outliers, ranges, sink...) decides what gets profiled
        variant += "-" + hashlib.sha256(base.to_json_key().encode()).hexdigest()[:8]
    name = f"{model_key(model)}-r{base.residual_length}-g{key.group_size}{variant}-{ids.shape[0]}x{ids.shape[1]}.json"
    path = cache_dir() / "tune" / name
    if path.exists():
        try:
            LayerProfile.load(path)
        except ValueError as e:
            log(f"kvq_ao: the cached layer profile cannot be used ({e}); replacing it")
            path.unlink()
    return artifacts.seed(path)


@dataclass
class TuneResult:
    profile: LayerProfile
    groups: list[int]
    candidates: list[list[Pair]]
    front: list[SearchResult]
    chosen: SearchResult
    config: KVQuantConfig
    uniform: list[tuple[Pair, float]]  # (pair, loss) of every uniform assignment
    profile_seconds: float
    search_seconds: float

    def predicted_loss(self, assignment: tuple[Pair, ...]) -> float:
        """KL predicted for a group assignment: the sum of its layers' profiled KLs."""
        return self.profile.predicted_kl(per_layer(assignment, self.groups))


def per_layer(assignment: tuple[Pair, ...], groups: list[int]) -> list[Pair]:
    """One pair per group -> one pair per layer."""
    return [assignment[g] for g in groups]


def tune(model, ids: torch.Tensor, max_avg_bits: float, n_groups: int = 8, base: KVQuantConfig | None = None,
         profile_path: str | Path | None = None, trials: int = 96, seed: int = 0, progress: bool = True,
         log=print, calibration_ids: torch.Tensor | None = None, calibration_folder: Path | None = None,
         widths: tuple[int, ...] = KVTUNER_WIDTHS) -> TuneResult:  # fmt: skip
    """KVTuner on `model` over ids [S, T] under `max_avg_bits` (see the module docstring), over the
    (key, value) pairs of `widths` (KVTuner's {2, 4, 8} by default; 3 may be added). A base of
    calibrated datatypes (`base_config(dtype="kvquant")`) is calibrated once per width, on pydoc's
    calibration text into the user cache, or on `calibration_ids` into `calibration_folder`.
    A saved profile lacking some pairs is extended with them (only those are profiled)."""
    base = base or base_config()
    candidates = list(candidate_pairs(widths))
    attach = lambda config: config  # noqa: E731  (configs of calibrated datatypes get their calibration)
    if any(layer_spec(p, base).key.needs_calibration or layer_spec(p, base).value.needs_calibration for p in candidates):
        log(f"calibrating each bit width of the base once ({calibration_folder if calibration_folder else 'user cache'})")
        attach = WidthCalibrations(model, base, layer_spec, widths=tuple(sorted(set(widths))), calibration_ids=calibration_ids,
                                   folder=calibration_folder).attach  # fmt: skip
    t0 = time.perf_counter()
    prof = None
    if profile_path is not None and Path(profile_path).exists():
        prof = LayerProfile.load(profile_path)
        prof.check_model(model)
        if prof.base != base.to_dict():
            raise ValueError(f"{profile_path}: profiled with another base config; delete it or pass another path")
        log(f"reusing the layer profile {profile_path}")
        if missing := prof.missing(candidates):
            log(f"profiling the {len(missing)} pairs it lacks: {' '.join(f'K{k}V{v}' for k, v in missing)}")
            prof = prof.extended(profile(model, ids, base, candidates=missing, progress=progress, attach=attach))
            prof.save(profile_path)
    if prof is None:
        prof = profile(model, ids, base, candidates=candidates, progress=progress, attach=attach)
        if profile_path is not None:
            prof.save(profile_path)
    prof = prof.select(candidates)
    profile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    pruned = [prune({p: prof.layer_kl(layer, p) for p in prof.candidates}) for layer in range(prof.kl.shape[0])]
    groups = cluster_layers(prof.kl, min(n_groups, prof.kl.shape[0]))
    cands = group_candidates(groups, pruned)
    sizes = [groups.count(g) for g in range(len(cands))]
    logp_fp = run_with(model, ids, None)
    members = [[layer for layer, g in enumerate(groups) if g == gi] for gi in range(len(cands))]
    predicted = predicted_front(cands, sizes, lambda g, p: sum(prof.layer_kl(layer, p) for layer in members[g]))
    within = [r.assignment for r in predicted if r.avg_bits <= max_avg_bits + 1e-9]
    seeds = within[::-1][: max(4, trials // 6)]  # the predicted best, nearest the budget first

    def loss(assignment: tuple[Pair, ...]) -> float:
        cfg = attach(assignment_config(per_layer(assignment, groups), base))
        return kl_to(logp_fp, run_with(model, ids, cfg))

    log(f"searching {len(cands)} layer groups under {max_avg_bits:g} average bits (each step measures an assignment's KL "
        f"on {ids.numel()} calibration tokens through the cache)")
    front = search(cands, sizes, loss, max_avg_bits=max_avg_bits, trials=trials, seed=seed, progress=progress, seeds=seeds)
    chosen = min(front, key=lambda r: r.loss)
    n = len(groups)
    log(f"measuring the {len(candidates)} uniform assignments for comparison")
    uniform = [(p, kl_to(logp_fp, run_with(model, ids, attach(assignment_config([p] * n, base))))) for p in candidates]
    search_s = time.perf_counter() - t0
    config = attach(assignment_config(per_layer(chosen.assignment, groups), base, name=f"tuned-{max_avg_bits:g}bit"))
    return TuneResult(prof, groups, cands, front, chosen, config, uniform, profile_s, search_s)


def write_front(result: TuneResult, csv_path: str | Path, png_path: str | Path | None = None) -> None:
    """The measured Pareto front (and the uniform assignments) as CSV, and a bits-vs-loss plot."""
    with replacing(csv_path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kind", "avg_bits", "kl", "predicted_kl", "pairs_per_group"])
        for r in result.front:
            pairs = " ".join(f"K{k}V{v}" for k, v in r.assignment)
            w.writerow(["pareto", f"{r.avg_bits:.4f}", f"{r.loss:.6g}", f"{result.predicted_loss(r.assignment):.6g}", pairs])
        for p, loss in result.uniform:
            predicted = result.profile.predicted_kl([p] * len(result.groups))
            w.writerow(["uniform", f"{pair_bits(p):.4f}", f"{loss:.6g}", f"{predicted:.6g}", f"K{p[0]}V{p[1]}"])
    if png_path is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs, ys = [r.avg_bits for r in result.front], [r.loss for r in result.front]
    ax.plot(xs, ys, "o-", label="tuned (Pareto front)")
    ax.scatter([pair_bits(p) for p, _ in result.uniform], [l for _, l in result.uniform], marker="s", c="tab:red", label="uniform")
    for p, loss in result.uniform:
        ax.annotate(f"K{p[0]}V{p[1]}", (pair_bits(p), loss), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.scatter([result.chosen.avg_bits], [result.chosen.loss], marker="*", s=150, c="gold", edgecolors="k", zorder=5, label="chosen")
    ax.set_yscale("log")
    ax.set_xlabel("average bits per K/V element (nominal)")
    ax.set_ylabel("KL(fp || quantized) on calibration text")
    ax.legend(fontsize=8)
    fig.tight_layout()
    with replacing(png_path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def summary_rows(result: TuneResult) -> list[tuple[str, str, str, str]]:
    """(layer, group, pair, profiled KL of that pair) per layer."""
    rows = []
    for layer, g in enumerate(result.groups):
        p = result.chosen.assignment[g]
        rows.append((str(layer), str(g), f"K{p[0]}V{p[1]}", f"{result.profile.layer_kl(layer, p):.4g}"))
    return rows


__all__ = ["TuneResult", "default_profile_path", "summary_rows", "tune", "write_front"]
