"""Every Triton kernel specialization compiles for real GPUs (sm_80 and sm_90), without a GPU.

Triton's interpreter (tests/kernels/test_triton.py) runs code the GPU compiler refuses; this
compiles, through triton's own compiler and bundled ptxas, each specialization that generate()
makes with the presets (recorded from a one-layer model of SmolLM2's attention shape in bfloat16)
and each one the format matrix below asks for (recorded without running the kernels). ptxas's
registers and spills are printed (`pytest -s`); benchmarks/triton_aot.py writes them to results/.
A failure to compile fails, and so does a register spill (a kernel that spills reads and writes
local memory in its inner loop, which a bandwidth-bound decode cannot afford).
"""

import pytest
import torch

pytest.importorskip("triton", reason="the GPU kernels' tests need triton (installed with the test extra)")

from attention_cases import FIXED, attend, native_case, streaming_case  # noqa: E402
from kvq_ao.kernels import gpu  # noqa: E402
from kvq_ao.kernels.gpu.aot import (OLDEST_TRITON, KernelReport, compile_all, compile_all_with, launch_of, preset_launches,  # noqa: E402
                                    recorded_launches, traced_as_on_gpu, triton_folder, unique)  # fmt: skip
from kvq_ao.format import AXIS_CHANNEL, AXIS_TOKEN, default_meta_exponent, format_ints, meta_ints  # noqa: E402
from kvq_ao.quant.codebook import nf_codebook  # noqa: E402

gpu.load()

PRESETS = ["int8", "kivi-4", "kivi-3", "kivi-2", "kvquant-4-1pct", "kvquant-3-1pct", "kvquant-2-1pct", "kvquant-3", "kivi-2-q16",
           "kivi-2-q8"]
CAPABILITIES = (80, 90)
KEY, VALUE = (4, AXIS_CHANNEL, 16, False, 0), (4, AXIS_TOKEN, 16, False, 0)


def _widths():
    """(k format, v format) pairs: every width with uniform and codebook levels on each side, a float
    body, calibrated key ranges, outlier slots, and KVTuner's mixed pairs (K8V2, K2V8, K4V2)."""
    pairs = []
    for bits in (2, 3, 4, 8):
        for codebook in (False, True) if bits <= 4 else (False,):
            pairs += [((bits, AXIS_CHANNEL, 16, codebook, 0), VALUE), (KEY, (bits, AXIS_TOKEN, 16, codebook, 0))]
    pairs += [((0, AXIS_TOKEN, 16, False, 0), (0, AXIS_TOKEN, 16, False, 0)),
              ((3, AXIS_CHANNEL, FIXED, True, 2), (3, AXIS_TOKEN, 16, True, 1)),
              ((8, AXIS_CHANNEL, 32, False, 0), (2, AXIS_TOKEN, 32, False, 0)),
              ((2, AXIS_CHANNEL, 32, False, 0), (8, AXIS_TOKEN, 32, False, 0)),
              ((4, AXIS_TOKEN, 16, False, 1), (4, AXIS_CHANNEL, 16, False, 0))]  # fmt: skip
    return pairs


def matrix_launches() -> list:
    """The format matrix's specializations of the attention and quantize kernels (not run). Head_dim
    256 is taken in bfloat16, the dtype of the models that have it (float32 products at head_dim 256
    hold more than 255 registers a thread and spill a few dozen bytes)."""
    with recorded_launches(run=False) as seen:
        for k_fmt, v_fmt in _widths():
            attend(native_case(0, k_fmt=k_fmt, v_fmt=v_fmt, blocks=2), torch.ops.kvq.triton_decode_attention)
        for extra in (dict(ratio=1, d=128), dict(ratio=1, d=256, hkv=1, dtype=torch.bfloat16), dict(ratio=8, hkv=1), dict(pre_rope=True, softcap=2.5),
                      dict(head_mask=True, dtype=torch.float16), dict(dtype=torch.bfloat16, pre_rope=True)):  # fmt: skip
            attend(native_case(0, k_fmt=KEY, v_fmt=VALUE, blocks=2, **extra), torch.ops.kvq.triton_decode_attention)
        for k_fmt, dtype in (((4, AXIS_CHANNEL, 16, False, 0, 16), torch.float32), ((2, AXIS_CHANNEL, FIXED, False, 0, 8), torch.float16)):
            attend(native_case(0, k_fmt=k_fmt, v_fmt=VALUE, blocks=2, dtype=dtype), torch.ops.kvq.triton_decode_attention)  # integer queries
        for k_fmt, v_fmt in [((2, AXIS_CHANNEL, False, 0), (4, AXIS_TOKEN, False, 0)), ((3, AXIS_CHANNEL, True, 1, FIXED),
                             (2, AXIS_TOKEN, True, 2)), ((0, AXIS_TOKEN, False, 0), (8, AXIS_CHANNEL, False, 0))]:  # fmt: skip
            for extra in (dict(), dict(per_query=True, pre_rope=True, softcap=2.0)):
                attend(streaming_case(0, 5, k_fmt, v_fmt, **extra), torch.ops.kvq.triton_chunk_attention)
        # 8-bit scale and zero, decoded in the kernels: one group a vector (values on the per-vector
        # path), groups of 32 with codebooks and outliers, and pre-RoPE keys; then chunk attention
        for k_fmt, v_fmt, extra in (((4, AXIS_TOKEN, 64, False, 0, 0, True), (3, AXIS_TOKEN, 64, True, 0, 0, True), {}),
                                    ((4, AXIS_TOKEN, 32, False, 1, 0, True), (3, AXIS_TOKEN, 32, True, 1, 0, True), {}),
                                    ((3, AXIS_TOKEN, 16, True, 0, 0, True), (2, AXIS_TOKEN, 16, False, 0, 0, True), dict(pre_rope=True))):  # fmt: skip
            attend(native_case(0, k_fmt=k_fmt, v_fmt=v_fmt, blocks=2, **extra), torch.ops.kvq.triton_decode_attention)
        attend(streaming_case(0, 5, (3, AXIS_TOKEN, True, 1, 32), (2, AXIS_TOKEN, False, 0), meta8=True, pre_rope=True),
               torch.ops.kvq.triton_chunk_attention)
        for bits in (8, 16):  # keys scored against an integer query
            attend(streaming_case(0, 5, (4, AXIS_CHANNEL, False, 0), (2, AXIS_TOKEN, False, 0), k_query_bits=bits, softcap=2.0),
                   torch.ops.kvq.triton_chunk_attention)
        x = torch.randn(1, 2, 32, 64)
        for bits in (2, 3, 4, 8):
            for axis, group in ((AXIS_TOKEN, 32), (AXIS_CHANNEL, 16)):
                for outliers in (0, 2):
                    lo, hi = (-torch.ones(2, 64), torch.ones(2, 64)) if outliers else (torch.zeros(0), torch.zeros(0))
                    torch.ops.kvq.triton_quantize(x, format_ints(bits, axis, group), torch.float16, torch.zeros(0), lo, hi, outliers)
            # 8-bit scale and zero: one group a vector and two, uniform and codebook levels
            for group, codebook in ((64, False), (32, bits <= 4)):
                meta = meta_ints(default_meta_exponent(bits, codebook))
                torch.ops.kvq.triton_quantize(x, format_ints(bits, AXIS_TOKEN, group, meta=meta), torch.float16,
                                              nf_codebook(bits) if codebook else torch.zeros(0), torch.zeros(0), torch.zeros(0), 0)  # fmt: skip
    return seen


@pytest.fixture(scope="module")
def launches():
    return unique(preset_launches(PRESETS) + matrix_launches())


def test_every_kernel_specialization_compiles_for_sm80_and_sm90(launches):
    kernels = {launch.kernel for launch in launches}
    assert kernels == {"_decode_split", "_decode_merge", "_chunk_attention", "_quantize"}, kernels
    results = compile_all(launches, CAPABILITIES)
    print(f"\n{len(launches)} specializations\n{'kernel':>64}  sm  regs  spill st/ld  stack  shared")
    for launch, capability, r in results:
        if isinstance(r, KernelReport):
            print(f"{launch.label()[:64]:>64}  {capability}  {r.registers:4d}  {r.spill_stores:5d}/{r.spill_loads:<5d}"
                  f"  {r.stack:5d}  {r.shared:6d}")  # fmt: skip
    assert_compiled_without_spills(results)


def assert_compiled_without_spills(results) -> None:
    failed = [f"{launch.label()} sm_{capability}: {r}" for launch, capability, r in results if not isinstance(r, KernelReport)]
    assert not failed, "\n".join(failed)
    spilled = [f"{launch.label()} sm_{capability}: {r.registers} registers, spill stores/loads {r.spill_stores}/{r.spill_loads} bytes"
               for launch, capability, r in results if r.spill_stores or r.spill_loads]  # fmt: skip
    assert not spilled, "\n".join(spilled)


def test_every_kernel_specialization_compiles_with_the_oldest_supported_triton(launches):
    """The same specializations compiled by triton 3.6 (torch 2.11's, the stock image of the GPU
    machines) in a subprocess: it compiles every one for sm_80 and sm_90 without spills too. The
    first run installs triton 3.6 into kvq_ao's cache (pip, from the package registry, ~190 MB)."""
    version, results = compile_all_with(triton_folder(OLDEST_TRITON), launches, CAPABILITIES)
    assert version == OLDEST_TRITON
    assert_compiled_without_spills(results)


def test_the_check_catches_what_only_a_gpu_compiler_refuses(tmp_path, monkeypatch):
    """A kernel that reads a plain module global runs in the interpreter and must fail here (what
    `ROUND_MAGIC` once did on an H200)."""
    import importlib

    from triton.runtime.interpreter import InterpretedFunction

    from kvq_ao.kernels.gpu import aot

    (tmp_path / "kernel_with_a_global.py").write_text(
        "import triton\nimport triton.language as tl\n\nSCALE = 2.0\n\n\n@triton.jit\n"
        "def scaled(x, n, BLOCK: tl.constexpr):\n    i = tl.arange(0, BLOCK)\n"
        "    tl.store(x + i, tl.load(x + i, mask=i < n) * SCALE, mask=i < n)\n"
    )  # fmt: skip
    monkeypatch.syspath_prepend(str(tmp_path))
    kernel = importlib.import_module("kernel_with_a_global").scaled
    x = torch.ones(8)
    InterpretedFunction(kernel.fn)[(1,)](x, 8, BLOCK=8)
    assert torch.equal(x, torch.full((8,), 2.0))  # the interpreter takes it
    with pytest.raises(Exception, match="Cannot access global variable SCALE"):
        aot.compile_launch(launch_of(kernel, "kernel_with_a_global", (x, 8), dict(BLOCK=8)), 90)


def test_the_launches_are_the_ones_the_ops_make():
    """The recorder sees the ops' real arguments: a bool mask reaches the kernels as int1, not as a
    uint8 view (a dtype view of a bool tensor is what CUDA lowering refused in a compiled step)."""
    with recorded_launches(run=False) as seen:
        attend(native_case(0, blocks=2), torch.ops.kvq.triton_decode_attention)
    split = next(launch for launch in seen if launch.kernel == "_decode_split")
    assert dict(split.signature)["mask"] == "*i1"
    assert dict(split.constexprs)["K_BITS"] == 4 and dict(split.constexprs)["V_AXIS"] == AXIS_TOKEN


def test_the_compiled_decode_step_asks_inductor_for_no_dtype_view_of_a_bool_tensor():
    """On an H200 the compiled decode step failed to lower: the Triton op's body viewed the bool
    mask as uint8, which AOTAutograd turns into `aten.view.dtype` of a bool tensor, and Inductor's
    CUDA lowering refuses that. The graph Inductor receives is the same on any device, so it is
    captured here, on CPU, after AOTAutograd (torch's analysis of the launches run for an sm_90
    target, as on a GPU), and searched for such a view."""
    from torch._dynamo.backends.common import aot_autograd

    from conftest import tiny_llama
    from kvq_ao import KVQuantConfig, make_cache, quantize_kv_

    import logging

    graphs, warnings = [], []

    class Captured(Exception):
        """Stops compilation once the graph is captured (running it would launch the kernels on a GPU)."""

    def capture(gm, _):
        graphs.append(gm)
        raise Captured

    backend = aot_autograd(fw_compiler=capture)

    class Collect(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    model = tiny_llama(seed=3)
    quantize_kv_(model, KVQuantConfig.preset("kivi-2"))
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    cache = make_cache(model, max_cache_len=64)
    with torch.no_grad():
        model(ids, cache=cache)
        torch._dynamo.reset()
        handler = Collect(logging.WARNING)
        logging.getLogger("torch._dynamo").addHandler(handler)
        try:
            with gpu.on_cpu(), traced_as_on_gpu(90), pytest.raises(Exception, match="Captured"):
                torch.compile(lambda token: model(token, cache=cache).logits, backend=backend, fullgraph=True)(ids[:, -1:])
        finally:
            logging.getLogger("torch._dynamo").removeHandler(handler)
    assert not [w for w in warnings if "assuming every input is mutated" in w], warnings  # torch's analysis ran
    nodes = [n for g in graphs for n in g.graph.nodes]
    assert any("triton_kernel_wrapper" in str(n.target) for n in nodes)  # the kernels' launches are in the graph
    bool_views = [n for n in nodes if n.target == torch.ops.aten.view.dtype
                  and n.args[0].meta["val"].dtype == torch.bool]  # fmt: skip
    assert not bool_views, [str(n) for n in bool_views]
