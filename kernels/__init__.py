"""Implementations of the kvq ops (installed as `kvq_ao.kernels`).

`composite` holds the core-ATen reference implementation that CPU, inductor and the exporters use.
"""
