"""Group layers whose sensitivity looks alike, so the search runs over groups instead of layers.

Each layer is described by its log10 error over the candidate pairs (the profile's shape and
level). Agglomerative clustering with average linkage on those vectors (scikit-learn) puts
layers with similar profiles together; average linkage is not pulled by one extreme layer the
way single linkage is, and needs no guess of cluster centres the way k-means does. Layers of one
group share the union of their Pareto sets as the group's candidates.
"""

from __future__ import annotations

import numpy as np

from kvq_ao.tuning.pareto import Pair


def cluster_layers(profiles: np.ndarray, n_groups: int) -> list[int]:
    """profiles [layers, candidates] of positive errors -> a group id per layer (0..n_groups-1).

    Groups are numbered by first appearance, so layer 0 is in group 0.
    """
    profiles = np.asarray(profiles, dtype=np.float64)
    if profiles.ndim != 2 or profiles.shape[0] == 0:
        raise ValueError(f"profiles must be [layers, candidates], got shape {profiles.shape}")
    if not np.all(np.isfinite(profiles)) or np.any(profiles <= 0):
        raise ValueError("profiles must be finite positive errors")
    n_layers = profiles.shape[0]
    if not 1 <= n_groups <= n_layers:
        raise ValueError(f"n_groups must be in [1, {n_layers}], got {n_groups}")
    if n_groups == n_layers:
        return list(range(n_layers))
    from sklearn.cluster import AgglomerativeClustering

    labels = AgglomerativeClustering(n_clusters=n_groups, linkage="average").fit_predict(np.log10(profiles))
    renumber: dict[int, int] = {}
    return [renumber.setdefault(int(label), len(renumber)) for label in labels]


def group_candidates(groups: list[int], pruned: list[list[Pair]]) -> list[list[Pair]]:
    """Each group's candidates: the union of its layers' Pareto sets, cheapest first."""
    out: dict[int, set[Pair]] = {}
    for g, pairs in zip(groups, pruned):
        out.setdefault(g, set()).update(pairs)
    return [sorted(out[g], key=lambda p: (p[0] + p[1], p)) for g in sorted(out)]


__all__ = ["cluster_layers", "group_candidates"]
