"""What is particular to the Triton kernels: their ops' schemas, fake kernels and argument checks,
half-precision ties in quantize, generation and torch.compile through them, the GPU benchmark's dry
run. What they compute, over every format, shape, mask and dtype, is checked with every other
backend by tests/kernels/test_conformance.py (in Triton's interpreter) and their compile for real
GPUs by tests/kernels/test_triton_aot.py.
"""

import dataclasses
import re

import pytest
import torch

pytest.importorskip("triton", reason="the GPU kernels' tests need triton (installed with the test extra)")

from kvq_ao import KVQuantConfig, LayerKV, quantize_kv_  # noqa: E402
from kvq_ao.format import AXIS_CHANNEL, AXIS_TOKEN, format_ints  # noqa: E402
from kvq_ao.kernels import gpu, reference  # noqa: E402
from kvq_ao.ops import ATTENTION_SCHEMA  # noqa: E402

from attention_cases import STREAM_FORMATS, attend, native_case, op_args, positional, quantize_case, streaming_case  # noqa: E402
from conftest import kvquant_config, tiny_llama  # noqa: E402

gpu.load()


def triton_attention(named):
    return attend(named, torch.ops.kvq.triton_decode_attention)


@pytest.mark.parametrize("name", ["triton_decode_attention", "triton_chunk_attention"])
def test_the_triton_ops_take_exactly_the_attention_ops_arguments(name):
    """The schema torch infers from the Python signature is the one ATTENTION_SCHEMA defines, so each
    Triton op and its kvq op are interchangeable per device."""
    def arguments(schema):  # name, type (an inferred int is a SymInt), default
        return [(a.name, re.sub(r"\bSymInt\b", "int", str(a.type)), a.default_value) for a in schema.arguments]

    inferred = getattr(torch.ops.kvq, name).default._schema
    assert arguments(inferred) == arguments(torch._C.parse_schema("kvq::decode_attention" + ATTENTION_SCHEMA))
    assert [str(r.type) for r in inferred.returns] == ["Tensor"]


def test_bad_input_gets_the_ops_own_error():
    named = native_case(3)
    named["q"] = named["q"].expand(-1, -1, 2, -1)
    with pytest.raises(ValueError, match="takes one query token"):
        triton_attention(named)


def test_opcheck_triton_decode_attention():
    """Registration and fake kernel (the schema, fake tensors, no mutation of inputs)."""
    named = native_case(3, k_fmt=(3, AXIS_CHANNEL, 16, True, 1), pre_rope=True, blocks=2)
    torch.library.opcheck(torch.ops.kvq.triton_decode_attention.default, positional(named),
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip


# --------------------------------------------------------------------------- chunk (multi-token) attention
def test_opcheck_triton_chunk_attention():
    named = streaming_case(2, 8, STREAM_FORMATS[2], STREAM_FORMATS[3], window=10, pre_rope=True)
    torch.library.opcheck(torch.ops.kvq.triton_chunk_attention.default, (), op_args(named),
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip


# --------------------------------------------------------------------------- quantize (the append path)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("outliers", ["channel", "vector"])
def test_triton_quantize_of_half_precision_input_differs_only_in_how_ties_are_broken(dtype, outliers):
    """Half-precision vectors often hold equal entries; when two tie for an outlier slot, torch.topk
    and the kernel may keep different ones (torch's order among ties is unspecified). Every vector
    without such a tie is byte-identical; vectors with one keep equally extreme entries."""
    x, *rest = quantize_case(7, 4, AXIS_TOKEN, 32, False, outliers, dtype=dtype, t=64)
    got = torch.ops.kvq.triton_quantize(x, rest[0], torch.float16, *rest[1:])
    want = reference.quantize(x, rest[0], torch.float16, *rest[1:])
    same = (got[4] == want[4]).all(-1)  # vectors whose outlier slots agree
    assert same.float().mean() > 0.9
    for a, b in zip(got[:5], want[:5]):
        assert torch.equal(a[same], b[same])
    xf = x.float()
    score = (xf - xf.mean(-1, keepdim=True)).abs() if outliers == "vector" else (xf.abs() - 1.5).clamp(min=0)
    picked = lambda idx: score.gather(-1, idx.long().clamp(max=63)).sort(-1).values  # noqa: E731
    torch.testing.assert_close(picked(got[4])[~same], picked(want[4])[~same], rtol=1e-3, atol=1e-3)


def test_opcheck_triton_quantize():
    x, *rest = quantize_case(1, 3, AXIS_CHANNEL, 16, True, "channel")
    torch.library.opcheck(torch.ops.kvq.triton_quantize.default, (x, rest[0], torch.float16, *rest[1:]),
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip


def test_triton_quantize_refuses_shapes_its_tiles_cannot_take():
    x = torch.randn(1, 1, 4, 48)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        torch.ops.kvq.triton_quantize(x, format_ints(4, AXIS_TOKEN, 16), torch.float16, torch.zeros(0), torch.zeros(0), torch.zeros(0), 0)
    with gpu.on_cpu():  # the cache then uses the reference op for that shape
        assert gpu.quantize_op(x, AXIS_TOKEN, 16, torch.float16) is torch.ops.kvq.quantize
        assert gpu.quantize_op(torch.randn(1, 1, 4, 64), AXIS_TOKEN, 16, torch.float16) is torch.ops.kvq.triton_quantize


def test_triton_quantize_fixed_checks_its_arguments_and_fake_kernel():
    from kvq_ao.quant.uniform import fixed_range

    x, lo, hi = torch.randn(1, 2, 4, 64), -torch.ones(2, 64), torch.ones(2, 64)
    zero, scale = fixed_range(lo, hi, 7, torch.float16)
    with pytest.raises(ValueError, match=r"fixed ranges need zero as \[heads, head_dim\]"):
        torch.ops.kvq.triton_quantize_fixed(x, 3, zero[:1], scale, torch.zeros(0), lo, hi, 0)
    odd = torch.randn(1, 2, 4, 48)
    z48, s48 = fixed_range(-torch.ones(2, 48), torch.ones(2, 48), 7, torch.float16)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        torch.ops.kvq.triton_quantize_fixed(odd, 3, z48, s48, torch.zeros(0), -torch.ones(2, 48), torch.ones(2, 48), 0)
    with gpu.on_cpu():  # the cache then uses the reference op for that shape
        assert gpu.quantize_fixed_op(odd) is torch.ops.kvq.quantize_fixed
        assert gpu.quantize_fixed_op(x) is torch.ops.kvq.triton_quantize_fixed
    assert gpu.quantize_fixed_op(x) is torch.ops.kvq.quantize_fixed
    torch.library.opcheck(torch.ops.kvq.triton_quantize_fixed.default, (x, 3, zero, scale, torch.zeros(0), lo, hi, 1),
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip
    def arguments(op):  # name and type (an inferred int is a SymInt): the two ops are interchangeable
        return [(a.name, re.sub(r"\bSymInt\b", "int", str(a.type))) for a in op.default._schema.arguments]

    assert arguments(torch.ops.kvq.triton_quantize_fixed) == arguments(torch.ops.kvq.quantize_fixed)


@pytest.mark.parametrize("key_ranges", ["online", "calibrated"])
def test_generation_through_the_triton_kernels_equals_the_native_path(key_ranges):
    """quantize_kv_ and generate() unchanged, the Triton kernels serving every cache op (prefill
    chunks, appends, decode steps) in the interpreter: the same tokens as the CPU kernels, with
    key ranges per block or calibrated (keys coded on arrival by `kvq.triton_quantize_fixed`)."""
    model = tiny_llama(seed=5)
    cfg = kvquant_config(bits=3, outliers=0.02, model=model, key_ranges=key_ranges)
    quantize_kv_(model, cfg)
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded row

    def run():
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, prefill_chunk_size=8,
                                  output_scores=True, return_dict_in_generate=True)  # fmt: skip

    native = run()
    with gpu.on_cpu():
        triton = run()
    assert torch.equal(native.sequences, triton.sequences)
    for a, b in zip(native.scores, triton.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_cpu_is_served_by_the_triton_kernels_only_when_asked():
    cpu = torch.device("cpu")
    assert not gpu.serves(cpu)
    with gpu.on_cpu():
        assert gpu.serves(cpu)
    assert not gpu.serves(cpu)


# What makes a device wait for the host inside a graph: reading a tensor's value (or a shape that
# depends on values) on the host, in the Dynamo graph (methods) or the AOTAutograd graph (ATen ops).
HOST_SYNC_METHODS = {"item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "cpu", "numpy"}
HOST_SYNC_OPS = {"aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.is_nonzero", "aten.equal",
                 "aten.masked_select", "aten.unique_consecutive", "aten._unique2"}  # fmt: skip


def host_syncs(graphs, aten_graphs) -> list[str]:
    found = [f"{n.target}()" for n in graphs_nodes(graphs) if n.op == "call_method" and n.target in HOST_SYNC_METHODS]
    return found + [str(n.target) for n in graphs_nodes(aten_graphs)
                    if n.op == "call_function" and str(n.target).split(".default")[0] in HOST_SYNC_OPS]  # fmt: skip


def graphs_nodes(graphs):
    return [n for g in graphs for n in g.graph.nodes]


def inspecting_backend():
    """A torch.compile backend (a function: transformers deep-copies its compile config) that keeps
    every graph Dynamo hands it, lowers each through AOTAutograd (torch's analysis of the Triton
    launches run for an sm_90 target, as on a GPU) to keep the ATen and Triton-launch graph a GPU
    backend would compile, and then runs the Dynamo graph as it is: the Triton ops in Triton's
    interpreter. (Inductor's CPU backend cannot run Triton launches; on a GPU, benchmarks/gpu.py
    compiles the same step with inductor and CUDA graphs.) Returns (backend, dynamo graphs, aten graphs)."""
    from torch._dynamo.backends.common import aot_autograd

    from kvq_ao.kernels.gpu.aot import traced_as_on_gpu

    graphs, aten = [], []

    class Captured(Exception):
        pass

    def capture(aot_gm, _):
        aten.append(aot_gm)
        raise Captured

    def backend(gm, example_inputs):
        graphs.append(gm)
        with traced_as_on_gpu(90), pytest.raises(Captured):
            aot_autograd(fw_compiler=capture)(gm, example_inputs)
        return gm.forward

    return backend, graphs, aten


@pytest.mark.parametrize("preset", ["kivi-2", "kivi-2-m8", "kvquant-nuq3-1pct", "kvquant-calibrated-ranges"])
def test_compiled_decode_step_on_the_triton_ops_is_one_graph_without_recompiles_or_host_syncs(preset):
    """generate(..., compile_config=compile_config()) of a quantized model while the Triton kernels
    serve CPU tensors, 20 decode steps: one Dynamo graph (fullgraph, so no graph break), no recompile
    (Dynamo's error_on_recompile), the Triton op in it once per layer, no node in the AOTAutograd
    graph that reads a device value on the host (HOST_SYNCS; so CUDA graphs can capture the step),
    and the tokens and scores of eager generation with the native kernels."""
    from kvq_ao import compile_config

    model = tiny_llama(seed=3)
    ranges = "calibrated" if preset == "kvquant-calibrated-ranges" else "online"
    if preset.startswith("kivi-2"):  # kivi-2-m8: values with 8-bit scale and zero, whose 256 scales eager caches
        cfg = KVQuantConfig.preset("kivi-2")
        if preset == "kivi-2-m8":
            cfg = dataclasses.replace(cfg, default=LayerKV(cfg.default.key, dataclasses.replace(cfg.default.value, metadata="8-bit")))
    else:
        cfg = kvquant_config(bits=3, outliers=0.02, model=model, key_ranges=ranges)
    quantize_kv_(model, cfg)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))

    def run(**kw):
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=21, min_new_tokens=21, do_sample=False,
                                  cache_implementation="static", output_scores=True, return_dict_in_generate=True, **kw)  # fmt: skip

    eager = run()
    cc = compile_config()
    cc.backend, graphs, aten_graphs = inspecting_backend()
    torch._dynamo.reset()
    with gpu.on_cpu(), torch._dynamo.config.patch(error_on_recompile=True):
        compiled = run(compile_config=cc)
    assert len(graphs) == 1 and len(aten_graphs) == 1  # 20 compiled steps, one graph
    nodes = list(graphs[0].graph.nodes)
    calls = [n for n in nodes if "triton_decode_attention" in str(n.target)]
    assert len(calls) == model.config.num_hidden_layers
    coded = [n for n in nodes if "quantize_fixed" in str(n.target)]
    if ranges == "calibrated":  # the new key is coded on arrival, by the Triton op
        assert coded and all("triton_quantize_fixed" in str(n.target) for n in coded), [str(n.target) for n in coded]
    aten = [str(n.target) for n in aten_graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("triton_kernel_wrapper" in t for t in aten) >= 2 * model.config.num_hidden_layers  # split + merge launches
    assert not host_syncs(graphs, aten_graphs), sorted(set(aten))
    assert torch.equal(eager.sequences, compiled.sequences)
    for a, b in zip(eager.scores, compiled.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_the_scale_table_of_8_bit_metadata_is_built_once_per_exponent_and_device_but_never_cached_from_a_trace():
    """A decode step of an 8-bit operand looks its scale codes up in a 256-float table. Eager calls
    share one real tensor per (exponent, device), equal to metadata.scales; a fake tensor (what a
    torch.compile trace sees) gets a fresh table of its own mode and leaves the cache as it was."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from kvq_ao.format import META_OFFSET
    from kvq_ao.kernels.gpu import triton_ops
    from kvq_ao.quant import metadata

    codes = torch.zeros(4, dtype=torch.uint8)
    first = triton_ops._scale_table(META_OFFSET - 9, codes)
    assert triton_ops._scale_table(META_OFFSET - 9, codes.clone()) is first
    assert torch.equal(first, metadata.scales(-9))
    other = triton_ops._scale_table(META_OFFSET - 10, codes)
    assert other is not first and torch.equal(other, first / 2)
    cached = dict(triton_ops._SCALE_TABLES)
    with FakeTensorMode() as mode:
        traced = triton_ops._scale_table(META_OFFSET - 11, mode.from_tensor(codes))
    assert isinstance(traced, FakeTensor) and triton_ops._SCALE_TABLES == cached


def test_the_host_sync_check_sees_a_host_sync():
    """host_syncs finds a value read on the host (`.item()` of a fill level) and a value-dependent
    shape (`nonzero`), so a step that made either would fail the test above."""
    for fn, flag in ((lambda x: x[: int(x.sum().item())], "capture_scalar_outputs"),
                     (lambda x: torch.nonzero(x), "capture_dynamic_output_shape_ops")):  # fmt: skip
        backend, graphs, aten_graphs = inspecting_backend()
        torch._dynamo.reset()
        with torch._dynamo.config.patch(**{flag: True}):
            torch.compile(fn, backend=backend, fullgraph=True)(torch.ones(3))
        assert host_syncs(graphs, aten_graphs), [str(n.target) for n in graphs_nodes(graphs + aten_graphs)]
    assert not host_syncs(*inspecting_run(lambda x: x * 2))


def inspecting_run(fn):
    backend, graphs, aten_graphs = inspecting_backend()
    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(torch.ones(3))
    return graphs, aten_graphs


def test_the_gpu_benchmark_dry_run_checks_and_times_every_section(tmp_path):
    """benchmarks/gpu.py --dry-run: the script a lent GPU machine runs, on CPU tensors in the
    interpreter at tiny shapes; its conformance and check sections passed and every section produced
    its rows (attention: both shapes, batch 1 and 8, SDPA and each preset; launch options; prefill and
    the compiled step against their bf16 baselines, with the bandwidth model)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "benchmarks/gpu.py", "--dry-run", "--out", str(tmp_path)], cwd=root,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((tmp_path / "gpu.json").read_text())
    rows = result["rows"]
    presets = {"kivi-4", "kvquant-3-1pct"}
    conformance = [r for r in rows if r["section"] == "conformance"]
    assert conformance and all(r["ok"] for r in conformance)
    assert {r["case"].split(":")[0] for r in conformance} == {"decode", "chunk"}
    assert {r["format"] for r in rows if r["section"] == "check" and r["ok"]} == presets
    assert {r["format"] for r in rows if r["section"] == "check-quantize" and r["ok"]} == presets
    attention = [r for r in rows if r["section"] == "attention"]
    assert {(r["shape"], r["batch"]) for r in attention} == {("smollm2", 1), ("llama3-8b", 1), ("llama3-8b", 8)}
    assert {r["format"] for r in attention} == presets | {"sdpa-bf16"}
    assert all(r["gbs"] > 0 and r["of_copy_bw"] > 0 for r in attention)
    assert {(r["num_warps"], r["num_stages"]) for r in rows if r["section"] == "launch"} == {(4, 1), (8, 1)}
    assert {r["format"] for r in rows if r["section"] == "prefill"} == {"bf16-sdpa", "kivi-2"}
    step = [r for r in rows if r["section"] == "step"]
    assert {r["format"] for r in step} == {"bf16-static", "kivi-2"} and all(r["model_ms"] > 0 for r in step)
    assert all(r["ms"] > 0 for r in rows if "ms" in r) and result["seconds"] > 0
    named = subprocess.run([sys.executable, "benchmarks/gpu.py", "--dry-run", "--sections", "launch", "--out", str(tmp_path / "a.json")],
                           cwd=root, capture_output=True, text=True, timeout=600)  # the command prepare-carry prints names a file
    assert named.returncode == 0 and json.loads((tmp_path / "a.json").read_text())["rows"], named.stderr[-2000:]


def test_shapes_the_block_tiles_cannot_take_go_to_the_kvq_ops():
    """The Triton attention kernels tile power-of-two head_dims (>= 32) and groups; a head_dim of 96
    or a group of 24 is served by `kvq.decode_attention` / `kvq.chunk_attention` (on CUDA: the
    reference), and the Triton ops refuse such shapes by name."""
    from types import SimpleNamespace

    def operands(d, group=16, query_bits=0, outliers=0):
        return (SimpleNamespace(group=group, bits=4, query_bits=query_bits, out_val=torch.empty(1, 1, 1, outliers)),
                SimpleNamespace(group=group, bits=4, query_bits=0, out_val=None, side=torch.empty(1, 1, 1, d)))  # fmt: skip

    def q(d, tq=1):
        return torch.empty(1, 2, tq, d)

    with gpu.on_cpu():
        assert gpu.attention_op(q(64), *operands(64)) is torch.ops.kvq.triton_decode_attention
        assert gpu.attention_op(q(64, 5), *operands(64)) is torch.ops.kvq.triton_chunk_attention
        assert gpu.attention_op(q(96), *operands(96)) is torch.ops.kvq.decode_attention
        assert gpu.attention_op(q(96, 5), *operands(96)) is torch.ops.kvq.chunk_attention
        assert gpu.attention_op(q(64), *operands(64, group=24)) is torch.ops.kvq.decode_attention
        for bits in (8, 16):  # integer queries: Triton's with groups of >= 16 tokens and no outliers
            assert gpu.attention_op(q(64), *operands(64, query_bits=bits)) is torch.ops.kvq.triton_decode_attention
            assert gpu.attention_op(q(64, 5), *operands(64, query_bits=bits)) is torch.ops.kvq.triton_chunk_attention
            assert gpu.attention_op(q(64), *operands(64, group=8, query_bits=bits)) is torch.ops.kvq.decode_attention
            assert gpu.attention_op(q(64, 5), *operands(64, query_bits=bits, outliers=1)) is torch.ops.kvq.chunk_attention
    assert gpu.attention_op(q(64), *operands(64)) is torch.ops.kvq.decode_attention  # CPU: the native kernel
    named = native_case(0, d=96, k_fmt=(4, AXIS_CHANNEL, 16, False, 0), v_fmt=(4, AXIS_TOKEN, 16, False, 0))
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        triton_attention(named)
    chunk = streaming_case(0, 5, (4, AXIS_CHANNEL, False, 0), (4, AXIS_TOKEN, False, 0), d=48)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        attend(chunk, torch.ops.kvq.triton_chunk_attention)
