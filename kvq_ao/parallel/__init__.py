"""Context parallelism: a quantized cache split along the token axis over torch.distributed ranks.

    torchrun --nproc-per-node 2 examples/context_parallel.py

Every rank loads the model, calls `quantize_kv_` and builds the cache with
`make_context_parallel_cache(model)` (a collective: configs are compared across ranks), then runs
the same `generate()`/forward calls; each rank stores 1/world of every layer's packed body and
the ranks merge their partial attention exactly (`merge.py`).
"""

from kvq_ao.parallel.cache import ContextParallelCache, ShardPlan, make_context_parallel_cache
from kvq_ao.parallel.merge import gather_merge, merge_partials

__all__ = ["ContextParallelCache", "ShardPlan", "gather_merge", "make_context_parallel_cache", "merge_partials"]
