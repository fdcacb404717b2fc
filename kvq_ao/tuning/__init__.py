"""KVTuner's layer-wise mixed precision: prune each layer's (key, value) bit pairs to its Pareto
set, cluster layers with similar sensitivity, and search the reduced space (`search`).

Layer profiling on a real model and the `kvq tune` command build on these pieces.
"""

from kvq_ao.tuning.cluster import cluster_layers
from kvq_ao.tuning.pareto import CANDIDATES, candidate_pairs, pair_bits, pareto_front, prune
from kvq_ao.tuning.search import SearchResult, search

__all__ = ["CANDIDATES", "SearchResult", "candidate_pairs", "cluster_layers", "pair_bits", "pareto_front", "prune", "search"]
