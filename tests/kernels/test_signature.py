"""The operand's fields and their order are written once, in kvq_ao/format.py.

The attention ops take each of K and V as one `Tensor?[]` and one `int[]` in the order of
`OPERAND_TENSORS` / `OPERAND_INTS`; the C++ kernels read them by the indices of a header generated
from that module, the Triton ops launch their kernels by field name, and the cache's tensor
subclass lists its fields from it. So reversing both tuples there, and nothing else, must leave
every backend computing the same numbers: the conformance suite is run on such a copy.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from kvq_ao import format as fmt
from kvq_ao.kernels import cpu
from kvq_ao.ops import ATTENTION_SCHEMA
from kvq_ao.tensor import QuantizedKV

ROOT = Path(__file__).resolve().parents[2]


def test_the_schema_the_header_and_the_subclass_take_the_fields_from_the_format_module():
    schema = torch._C.parse_schema("kvq::decode_attention" + ATTENTION_SCHEMA)
    types = {a.name: str(a.type) for a in schema.arguments}
    assert types["k"] == types["v"] == "List[Optional[Tensor]]" and types["k_format"] == types["v_format"] == "List[int]"
    header = cpu.generated_header()
    for i, name in enumerate(fmt.OPERAND_TENSORS):
        assert f"constexpr int {name.upper()} = {i};" in header
    for i, name in enumerate(fmt.OPERAND_INTS):
        assert f"constexpr int {name.upper()} = {i};" in header
    assert QuantizedKV.tensor_data_names[: len(fmt.OPERAND_TENSORS)] == list(fmt.OPERAND_TENSORS)
    assert QuantizedKV.tensor_attribute_names[: len(fmt.OPERAND_INTS)] == list(fmt.OPERAND_INTS)


def test_no_kernel_source_spells_the_operand_list_or_a_format_sentinel():
    """Kernels name fields (`k.codes`, `kvq_format::CODES`), never a positional operand list; the
    format numbers' values (float bits, one calibrated row) live in kvq_ao/format.py only. (The
    Triton kernels' parameters are bound by name at launch and checked by name below.)"""
    sources = [*(ROOT / "kernels").rglob("*.py"), *(ROOT / "kernels").rglob("*.cpp"), *(ROOT / "kernels").rglob("*.h")]
    listed = re.compile(r"codes\s*,\s*\w*scale\s*,\s*\w*zero\s*,\s*\w*(codebook|levels)")
    sentinel = re.compile(r"(?<!%)(?<!% )\b(bits|BITS|group|GROUP)\s*[!=]=\s*0\b|\bONE_ROW\s*=\s*\d|\bif\s+group\s+else\b")
    offenders = []
    for path in sources:
        if path.name in ("triton_attention.py", "triton_decode.py", "triton_blocks.py"):  # jit parameters: bound by name, checked below
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if listed.search(line) or sentinel.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_the_triton_kernels_take_each_operand_field_by_its_name():
    """The ops launch the attention kernels with `<k|v>_<field>` keywords built from the operand
    (`kernels/gpu/triton_ops.py`): each kernel's operand parameters are exactly those names, plus
    `<k|v>_table`, the 256 scales of 8-bit metadata, which the ops derive from the `meta` format
    number (it is no tensor of the operand)."""
    from kvq_ao.kernels.gpu import triton_attention, triton_decode

    body = [name for name in fmt.OPERAND_TENSORS if name != "side"]
    for kernel in (triton_decode._decode_split, triton_attention._chunk_attention):
        params = [p.name for p in kernel.params]
        for prefix in ("k", "v"):
            fields = [p for p in params if p.startswith(f"{prefix}_") and p != f"{prefix}_table"]
            assert fields == [f"{prefix}_{name}" for name in body] and f"{prefix}_table" in params, kernel.__name__


def _reversed_copy(folder: Path) -> Path:
    """The installed layout (kvq_ao with kernels/ and export/ inside) with both field tuples reversed."""
    package = folder / "kvq_ao"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "kvq_ao", package, ignore=ignore)
    shutil.copytree(ROOT / "kernels", package / "kernels", ignore=ignore)
    shutil.copytree(ROOT / "export", package / "export", ignore=ignore)
    source = (package / "format.py").read_text()
    for name in ("OPERAND_TENSORS", "OPERAND_INTS"):
        fields = getattr(fmt, name)
        literal = "(" + ", ".join(f'"{f}"' for f in fields) + ")"
        assert source.count(literal) == 1, f"{name}'s literal not found in kvq_ao/format.py"
        source = source.replace(literal, "(" + ", ".join(f'"{f}"' for f in reversed(fields)) + ")")
    (package / "format.py").write_text(source)
    return package


def test_reversing_the_operand_fields_in_the_format_module_changes_no_result(tmp_path):
    _reversed_copy(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    probe = ("import kvq_ao.format as f, kvq_ao.kernels.cpu as c; import kvq_ao.ops; "
             "print(f.__file__, f.OPERAND_TENSORS[0], f.OPERAND_INTS[0], c.build_key())")  # fmt: skip
    where, first_tensor, first_int, key = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, check=True,
                                                         capture_output=True, text=True).stdout.split()  # fmt: skip
    assert where.startswith(str(tmp_path)) and (first_tensor, first_int) == (fmt.OPERAND_TENSORS[-1], fmt.OPERAND_INTS[-1])
    assert key != cpu.build_key()  # the native kernels are rebuilt from the reversed header
    suite = [str(ROOT / "tests/kernels/test_conformance.py"), str(ROOT / "tests/test_tensor.py"),
             "-k", "test_decode_attention or test_chunk_attention or backend_the_machine or test_tensor"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *suite], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1500)  # fmt: skip
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    summary = done.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 150 and "skipped" not in summary, tail  # every backend's cases ran
