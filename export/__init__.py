"""Deployment export (installed as `kvq_ao.export`): ExecuTorch `.pte` and ONNX with the packed cache.

    from kvq_ao.export import export_executorch, export_onnx
    export_executorch(model, cfg, "model.pte", max_seq_len=256)
    export_onnx(model, cfg, "model.onnx", max_seq_len=256)

executorch, onnx, onnxscript and onnxruntime are imported only when used.
"""

# ExecuTorch backends of `export_executorch` (here, import-free, for the CLI's and benchmarks' choices).
EXECUTORCH_BACKENDS = ("xnnpack", "portable")


def export_executorch(*args, **kwargs):
    from kvq_ao.export.executorch import export_executorch as run

    return run(*args, **kwargs)


def export_onnx(*args, **kwargs):
    from kvq_ao.export.onnx import export_onnx as run

    return run(*args, **kwargs)


__all__ = ["EXECUTORCH_BACKENDS", "export_executorch", "export_onnx"]
