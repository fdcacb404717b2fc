"""kvq_ao: quantized KV caches for transformers models (KVQuant datatypes, KVTuner mixed precision).

    from kvq_ao import KVQuantConfig, quantize_kv_
    quantize_kv_(model, KVQuantConfig.preset("kivi-4"))
    model.generate(ids, max_new_tokens=64)   # now keeps and reads a quantized cache
"""

from kvq_ao import _torchao  # noqa: F401  (first: imports torchao quietly before transformers does)
from kvq_ao.api import make_cache, quantize_kv_
from kvq_ao.cache import QuantizedKVCache
from kvq_ao.config import KVQuantConfig, LayerKV, QuantSpec
from kvq_ao.memory import MemoryReport, estimate
from kvq_ao.tensor import QuantizedKV

__all__ = [
    "KVQuantConfig",
    "LayerKV",
    "QuantSpec",
    "QuantizedKV",
    "QuantizedKVCache",
    "MemoryReport",
    "estimate",
    "make_cache",
    "quantize_kv_",
]
__version__ = "0.1.0"
