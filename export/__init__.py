"""Deployment export (installed as `kvq_ao.export`): ExecuTorch `.pte` and ONNX with the packed cache.

    from kvq_ao.export import export_executorch, export_onnx
    export_executorch(model, cfg, "model.pte", max_seq_len=256)
    export_onnx(model, cfg, "model.onnx", max_seq_len=256)

executorch, onnx, onnxscript and onnxruntime are imported only when used.
"""

# ExecuTorch backends of `export_executorch` (here, import-free, for the CLI's and benchmarks' choices).
EXECUTORCH_BACKENDS = ("xnnpack", "portable")
# How a `.pte` runs the kvq decode attention: "native" calls the kvq ExecuTorch kernel library (the
# C++ kernel eager PyTorch runs), "portable" the reference decomposed into ExecuTorch's portable
# ops (slow, needs nothing), "auto" native where the library builds here, else portable, announced.
KVQ_KERNELS = ("auto", "native", "portable")


def export_executorch(*args, **kwargs):
    from kvq_ao.export.executorch import export_executorch as run

    return run(*args, **kwargs)


def export_onnx(*args, **kwargs):
    from kvq_ao.export.onnx import export_onnx as run

    return run(*args, **kwargs)


__all__ = ["EXECUTORCH_BACKENDS", "KVQ_KERNELS", "export_executorch", "export_onnx"]
