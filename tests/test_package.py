"""The package's face: `import kvq_ao` is quiet, cheap and changes nothing; every public module
declares `__all__` and every declared name exists."""

import importlib
import pkgutil
import subprocess
import sys

import kvq_ao

HEAVY = ("torchao", "transformers", "optuna", "sklearn", "matplotlib", "executorch", "onnx", "onnxruntime",
         "onnxscript", "torch._inductor", "torch._dynamo")  # fmt: skip


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_loads_no_heavy_dependency_and_prints_nothing():
    out = _run(f"import sys; import kvq_ao; print([m for m in {HEAVY!r} if m in sys.modules])")
    assert out.strip() == "[]"
    done = subprocess.run([sys.executable, "-c", "import kvq_ao"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == ""


def test_the_quickstart_import_prints_nothing():
    """`from kvq_ao import KVQuantConfig, quantize_kv_` in a fresh interpreter: no warning of torch,
    torchao or transformers reaches the user (torchao's import is silenced in kvq_ao._torchao)."""
    done = subprocess.run([sys.executable, "-c", "from kvq_ao import KVQuantConfig, quantize_kv_"], capture_output=True,
                          text=True, timeout=300, cwd="/")  # fmt: skip
    assert done.returncode == 0 and done.stdout == "" and done.stderr == "", done.stderr


def test_a_checkout_imports_its_kernels_and_export_without_the_install_mapping(tmp_path):
    """kernels/ and export/ sit at the top of the repository and are installed as kvq_ao.kernels and
    kvq_ao.export by pyproject's package-dir mapping. Found from the repository root without that
    mapping (no editable finder, e.g. a wheel install shadowed by the checkout), the package finds
    them beside itself instead of failing with "No module named 'kvq_ao.kernels'"."""
    import site
    from pathlib import Path

    root = Path(kvq_ao.__file__).resolve().parents[1]
    paths = [str(root), *site.getsitepackages()]
    code = (f"import sys; sys.path[:0] = {paths!r}; import kvq_ao.kernels.reference, kvq_ao.export.decoder, kvq_ao; "
            "print(kvq_ao.kernels.reference.__file__); print(kvq_ao.export.decoder.__file__)")  # fmt: skip
    # -S: no site module, so no .pth file (the editable install's finder) is processed
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [str(root / "kernels" / "reference.py"), str(root / "export" / "decoder.py")]


def test_public_names_load_no_optional_dependency_until_used():
    """Even every public name imported: the tuner's optuna/sklearn, the plot's matplotlib and the
    exporters' toolchains load only when tuning, plotting or exporting runs."""
    out = _run("import sys\nfrom kvq_ao import *\n"
               "print([m for m in ('optuna', 'sklearn', 'matplotlib', 'executorch', 'onnx', 'onnxruntime', 'onnxscript') "
               "if m in sys.modules])")  # fmt: skip
    assert out.strip() == "[]"


def test_import_leaves_transformers_attention_registries_unchanged():
    """Registration happens in quantize_kv_, never at import (of the package or of any public name)."""
    out = _run(
        "from transformers.masking_utils import AttentionMaskInterface\n"
        "from transformers.modeling_utils import AttentionInterface\n"
        "def snap(): return (dict(AttentionInterface._global_mapping), dict(AttentionMaskInterface._global_mapping))\n"
        "before = snap()\n"
        "import kvq_ao\n"
        "from kvq_ao import *  # every public name, so every public module\n"
        "import kvq_ao.api, kvq_ao.cache, kvq_ao.eval, kvq_ao.calibration\n"
        "print(snap() == before, 'kvq' in before[0])\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "cfg = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,\n"
        "                  num_attention_heads=2, num_key_value_heads=1, head_dim=32)\n"
        "quantize_kv_(LlamaForCausalLM(cfg), KVQuantConfig.preset('kivi-4'))\n"
        "print('kvq' in AttentionInterface._global_mapping, 'kvq' in AttentionMaskInterface._global_mapping)\n"
    )
    assert out.split() == ["True", "False", "True", "True"]  # unchanged by imports; registered by quantize_kv_


def _public_modules():
    names = ["kvq_ao", "kvq_ao.export", "kvq_ao.kernels"]
    for package in ("kvq_ao", "kvq_ao.quant", "kvq_ao.tuning", "kvq_ao.parallel", "kvq_ao.export", "kvq_ao.kernels"):
        pkg = importlib.import_module(package)
        names += [f"{package}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_")]
    return sorted(set(names))


def test_every_public_module_declares_all_and_its_names_exist():
    modules = _public_modules()
    assert "kvq_ao.quant.packing" in modules and "kvq_ao.export.onnx" in modules and len(modules) > 25
    for name in modules:
        module = importlib.import_module(name)
        assert isinstance(getattr(module, "__all__", None), list), f"{name} has no __all__ list"
        missing = [n for n in module.__all__ if not hasattr(module, n)]
        assert not missing, f"{name}.__all__ names what it does not define: {missing}"


def test_top_level_api():
    assert set(kvq_ao.__all__) >= {"quantize_kv_", "KVQuantConfig", "QuantSpec", "LayerKV", "calibrate", "tune", "evaluate",
                                   "compile_config", "export_executorch", "export_onnx", "load_model"}  # fmt: skip
    for name in kvq_ao.__all__:
        assert callable(getattr(kvq_ao, name)), name
    try:
        kvq_ao.not_a_name
    except AttributeError as e:
        assert "not_a_name" in str(e)
    else:
        raise AssertionError("unknown attribute did not raise")
