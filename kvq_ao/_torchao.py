"""The one place kvq_ao imports torchao.

torchao logs a warning for every optional CUDA extension it cannot load and torch warns about
enum registrations while torchao imports; on a CPU machine both are expected noise, so they are
silenced for the duration of the import only (`import kvq_ao` should be quiet).
"""

import logging
import warnings


def _quiet_import():
    loggers = [logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.core.config import AOBaseConfig
            from torchao.quantization.transform_module import register_quantize_module_handler
            from torchao.utils import TorchAOBaseTensor

            import torchao.prototype.mx_formats.config  # noqa: F401  (transformers imports it later)
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
    return AOBaseConfig, register_quantize_module_handler, TorchAOBaseTensor


AOBaseConfig, register_quantize_module_handler, TorchAOBaseTensor = _quiet_import()

__all__ = ["AOBaseConfig", "register_quantize_module_handler", "TorchAOBaseTensor"]
