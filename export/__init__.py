"""Deployment export (installed as `kvq_ao.export`): ExecuTorch and ONNX exporters live here (issue 3)."""
