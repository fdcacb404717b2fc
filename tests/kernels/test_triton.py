"""What is particular to the Triton kernels: their ops' schemas, fake kernels and argument checks,
half-precision ties in quantize, generation and torch.compile through them, the GPU benchmark's dry
run. What they compute, over every format, shape, mask and dtype, is checked with every other
backend by tests/kernels/test_conformance.py (in Triton's interpreter) and their compile for real
GPUs by tests/kernels/test_triton_aot.py.
"""

import re

import pytest
import torch

pytest.importorskip("triton", reason="the GPU kernels' tests need triton (installed with the test extra)")

from kvq_ao import KVQuantConfig, make_cache, quantize_kv_  # noqa: E402
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


@pytest.mark.parametrize("preset", ["kivi-2", "kvquant-nuq3-1pct", "kvquant-calibrated-ranges"])
def test_compiled_decode_step_traces_the_triton_op_without_graph_breaks(preset):
    """A decode step of a quantized model, compiled with fullgraph=True while the Triton kernels serve
    CPU tensors: one graph, the Triton op in it once per layer, the result of the eager step (native
    kernel). Dynamo traces; the graph runs the kernels in the interpreter (inductor's lowering of the
    Triton launches needs a GPU driver and is exercised by benchmarks/gpu.py on a GPU)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model = tiny_llama(seed=3)
    ranges = "calibrated" if preset == "kvquant-calibrated-ranges" else "online"
    cfg = KVQuantConfig.preset("kivi-2") if preset == "kivi-2" else kvquant_config(bits=3, outliers=0.02, model=model, key_ranges=ranges)
    quantize_kv_(model, cfg)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))

    def prefilled():
        cache = make_cache(model, cfg, max_cache_len=64)
        model(ids, cache=cache)
        return cache

    with torch.no_grad():
        eager = model(ids[:, -1:], cache=prefilled()).logits
        counter = CompileCounterWithBackend("eager")
        step = torch.compile(lambda token, cache: model(token, cache=cache).logits, backend=counter, fullgraph=True)
        torch._dynamo.reset()
        with gpu.on_cpu():
            compiled = step(ids[:, -1:], prefilled())
    assert counter.frame_count == 1
    calls = [n for n in counter.graphs[0].graph.nodes if "triton_decode_attention" in str(n.target)]
    assert len(calls) == model.config.num_hidden_layers
    coded = [n for n in counter.graphs[0].graph.nodes if "quantize_fixed" in str(n.target)]
    if ranges == "calibrated":  # the new key is coded on arrival, by the Triton op
        assert coded and all("triton_quantize_fixed" in str(n.target) for n in coded), [str(n.target) for n in coded]
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


def test_the_gpu_benchmark_dry_run_checks_and_times_every_section(tmp_path):
    """benchmarks/gpu.py --dry-run: the script a lent GPU machine runs, on CPU tensors in the
    interpreter at tiny shapes; its correctness section passed and every section produced rows."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "gpu.json"
    run = subprocess.run([sys.executable, "benchmarks/gpu.py", "--dry-run", "--out", str(out)], cwd=root,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    presets = {"kivi-4", "kivi-2", "kvquant-3-1pct", "kvquant-2-1pct"}
    assert {r["format"] for r in rows if r["section"] == "check" and r["ok"]} == presets
    assert {r["format"] for r in rows if r["section"] == "check-quantize" and r["ok"]} == presets
    assert {r["format"] for r in rows if r["section"] == "attention"} == presets | {"sdpa-bf16"}
    assert {r["format"] for r in rows if r["section"] == "step"} == {"fp", "kivi-4", "kivi-2"}
    assert all(r["ms"] > 0 for r in rows if "ms" in r)
