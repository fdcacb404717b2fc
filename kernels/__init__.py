"""Implementations of the kvq ops (installed as `kvq_ao.kernels`).

`composite` holds the core-ATen reference implementation that CPU, inductor and the exporters use.
"""

__all__: list[str] = []  # the kernels are reached through torch.ops.kvq (kvq_ao.ops); modules by device
