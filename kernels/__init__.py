"""Kernels of the kvq ops, by device (installed as `kvq_ao.kernels`).

* `reference.py`: the readable core-ATen implementation of every op. It defines what the ops
  compute; it is what torch.export (ExecuTorch, ONNX) lowers, what inductor traces and fuses on a
  device without a native kernel, and what any such device runs eagerly.
* `cpu/`: native C++ kernels (decode attention straight from packed codes), built with torch's
  C++ extension tools on first use and registered for the CPU dispatch key of the same ops.
* `gpu/`: Triton kernels (decode attention) registered as `torch.library.triton_op`s, which CUDA
  tensors use when triton is installed; tested on CPU in Triton's interpreter.
"""

from __future__ import annotations

import torch


def native_device(device: torch.device) -> bool:
    """Whether a native kernel serves kvq.decode_attention on `device` (then inductor calls it instead
    of fusing the reference)."""
    if device.type == "cpu":
        from kvq_ao.kernels import cpu

        return cpu.is_loaded()
    return False


__all__ = ["native_device"]
