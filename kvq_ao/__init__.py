"""kvq_ao: quantized KV caches for transformers models (KVQuant datatypes, KVTuner mixed precision).

    from kvq_ao import KVQuantConfig, quantize_kv_
    quantize_kv_(model, KVQuantConfig.preset("kivi-4"))
    model.generate(ids, max_new_tokens=64)   # now keeps and reads a quantized cache

Importing the package is free of side effects and cheap: every public name below is loaded on
first access (PEP 562), so `import kvq_ao` neither imports torchao, transformers, inductor or
any export toolchain nor registers anything with transformers. `quantize_kv_` registers the
"kvq" attention function when it is called.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> the module that defines it
_PUBLIC = {
    "quantize_kv_": "kvq_ao.api",
    "make_cache": "kvq_ao.api",
    "compile_config": "kvq_ao.api",
    "KVQuantConfig": "kvq_ao.config",
    "LayerKV": "kvq_ao.config",
    "QuantSpec": "kvq_ao.config",
    "QuantizedKVCache": "kvq_ao.cache",
    "NonFiniteKVError": "kvq_ao.finite",
    "QuantizedKV": "kvq_ao.tensor",
    "MemoryReport": "kvq_ao.memory",
    "estimate": "kvq_ao.memory",
    "calibrate": "kvq_ao.calibration",
    "tune": "kvq_ao.tuning.tuner",
    "evaluate": "kvq_ao.eval",
    "load_model": "kvq_ao.models",
    "export_executorch": "kvq_ao.export",
    "export_onnx": "kvq_ao.export",
}

__all__ = [
    "KVQuantConfig",
    "LayerKV",
    "MemoryReport",
    "NonFiniteKVError",
    "QuantSpec",
    "QuantizedKV",
    "QuantizedKVCache",
    "calibrate",
    "compile_config",
    "estimate",
    "evaluate",
    "export_executorch",
    "export_onnx",
    "load_model",
    "make_cache",
    "quantize_kv_",
    "tune",
]
__version__ = "0.1.0"


def _find_checkout_subpackages() -> None:
    """In a checkout, kernels/ and export/ sit beside this package at the repository's top level;
    an install maps them to kvq_ao.kernels and kvq_ao.export (pyproject's package-dir). Imported
    from a checkout without that mapping (the repository root first on sys.path, e.g. an installed
    wheel shadowed by the source folder), look for them beside the package as well."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    beside = all(os.path.isfile(os.path.join(root, *p)) for p in (("kernels", "reference.py"), ("export", "decoder.py")))
    if beside and os.path.isfile(os.path.join(root, "pyproject.toml")) and root not in __path__:
        __path__.append(root)


_find_checkout_subpackages()


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'kvq_ao' has no attribute {name!r}")
    # torchao first, quietly: transformers would otherwise import it later with a burst of
    # CUDA-extension warnings that mean nothing on a CPU machine.
    importlib.import_module("kvq_ao._torchao")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])


if TYPE_CHECKING:  # static analysers and IDEs see the real names
    from kvq_ao.api import compile_config, make_cache, quantize_kv_
    from kvq_ao.cache import QuantizedKVCache
    from kvq_ao.calibration import calibrate
    from kvq_ao.config import KVQuantConfig, LayerKV, QuantSpec
    from kvq_ao.eval import evaluate
    from kvq_ao.export import export_executorch, export_onnx
    from kvq_ao.memory import MemoryReport, estimate
    from kvq_ao.finite import NonFiniteKVError
    from kvq_ao.models import load_model
    from kvq_ao.tensor import QuantizedKV
    from kvq_ao.tuning.tuner import tune
