"""ExecuTorch and ONNX export: the artifacts run, match eager, and hold the packed cache."""

import dataclasses

import numpy as np
import pytest
import torch

from conftest import kvquant_config, tiny_llama
from kvq_ao import KVQuantConfig
from kvq_ao.export import export_executorch, export_onnx
from kvq_ao.export.decoder import DecodeStep

pytest.importorskip("executorch", reason="export tests need executorch (installed by the test extra)")
pytest.importorskip("onnxruntime", reason="export tests need onnxruntime (installed by the test extra)")

MAX_LEN = 96
# kivi-2 with its keys scored against an int8 query and kivi-4 (an int16 query), each with a short fp
# window and a sink, so 64 tokens really go through packed codes.
SHORT_WINDOW = dataclasses.replace(KVQuantConfig.preset("kivi-2-q8"), residual_length=8, sink_tokens=1, name="kivi-2-q8-r8")
KIVI4_SHORT_WINDOW = dataclasses.replace(KVQuantConfig.preset("kivi-4"), residual_length=8, sink_tokens=1, name="kivi-4-r8")


def _eager_logits(config, tokens):
    step = DecodeStep(tiny_llama(), config, MAX_LEN)
    with torch.no_grad():
        return [step(torch.tensor([[t]]), torch.tensor([i]))[0, -1] for i, t in enumerate(tokens)], step


def _generate_and_compare(runner, cfg, prompt, runtime: str):
    """Greedy 32 tokens with the artifact; logits within 1e-3 relative of eager, same tokens."""
    new, logits = runner.generate(prompt, 32)
    eager, step = _eager_logits(cfg, prompt + new[:-1])
    diff = max((a - b).abs().max().item() for a, b in zip(logits, eager))
    scale = max(b.abs().max().item() for b in eager)
    print(f"{runtime} {cfg.name}: max |logit diff| {diff:.2e} (relative {diff / scale:.2e})")
    assert diff / scale < 1e-3
    assert new == [int(x.argmax()) for x in eager[len(prompt) - 1 :]]
    return step


def _half_value_outliers(cfg):
    value = dataclasses.replace(cfg.default.value, outlier_dtype="float16")
    return dataclasses.replace(cfg, default=dataclasses.replace(cfg.default, value=value))


@pytest.fixture(scope="module", params=["kivi-2-q8-r8", "kivi-4-r8", "kvquant-nuq3-2pct"])
def exported(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("export")
    cfg = {
        "kivi-2-q8-r8": SHORT_WINDOW,
        "kivi-4-r8": KIVI4_SHORT_WINDOW,
        # calibrated codebooks and key ranges (keys coded on arrival against fixed per-channel ranges),
        # outlier slots (keys' judged by calibrated channel thresholds and kept in the model's dtype,
        # values' per vector online and kept in float16), pre-RoPE keys, a sink and a float16 side store
        # in the float32 model (per-block key ranges: kivi-*)
        "kvquant-nuq3-2pct": dataclasses.replace(_half_value_outliers(kvquant_config(
            bits=3, outliers=0.02, value_outlier_rule="vector", folder=folder, key_ranges="calibrated")), side_dtype="float16"),  # fmt: skip
    }[request.param]
    pte = export_executorch(tiny_llama(), cfg, folder / "m.pte", max_seq_len=MAX_LEN)
    onnx_path = export_onnx(tiny_llama(), cfg, folder / "m.onnx", max_seq_len=MAX_LEN)
    return cfg, pte, onnx_path


def test_executorch_generation_matches_eager_over_prompt_and_decode(exported):
    """The program calls the native kvq attention (the kvq ExecuTorch kernel library) and matches eager."""
    from kvq_ao.export.executorch import ExecuTorchRunner, program_operators

    cfg, pte, _ = exported
    assert pte.kvq_kernels == "native"
    kvq_ops = {op for op in program_operators(pte.path) if op.startswith("kvq::")}
    appends = {"kvq::quantize.out"} | ({"kvq::quantize_fixed.out"} if cfg.default.key.calibrated_ranges else set())
    assert kvq_ops == {"kvq::decode_attention.out"} | appends  # the attention and the append, native
    runner = ExecuTorchRunner(pte.path)
    prompt = torch.randint(3, 128, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    for _ in range(2):  # a second generation reuses the loaded program from position 0
        step = _generate_and_compare(runner, cfg, prompt, "executorch")
    assert int(step.cache.layers[0].body_end) > 0  # the packed codes were really read


def test_onnx_generation_matches_eager_over_prompt_and_decode(exported):
    """End to end in onnxruntime: eager's greedy tokens; then every step again from the cache
    state onnxruntime read (loaded into eager's cache first), comparing logits and stored cache.

    Stepping from the same state keeps one step's float rounding from being blamed on, or hidden
    behind, an earlier step's. That matters because stored codes may legitimately differ by one
    level (below), and a free-running comparison carries such a difference forward: in the KVQuant
    case one 3-bit value code flipped at position 47 and moved every later logit by up to 1.3e-3
    relative with one thread (8e-4 with two), so a free-running 1e-3 bound held only by luck.

    The code check guards the float16 metadata rounding: onnxruntime once dropped an
    f32->f16->f32 cast pair around an fp16 `Where` and stored different scales (see
    `kvq_ao.quant.uniform._rounded`), which flipped 2-bit codes and drifted logits by 1e-2.
    Codes must be identical wherever a group's scale and zero are; where those legitimately differ
    by an ulp (inputs differ in the last bits), a code may sit on the other side of a level
    boundary (seen once a per-vector outlier narrowed a value group).
    """
    from kvq_ao.export.onnx import OnnxRunner

    cfg, _, onnx_path = exported
    runner = OnnxRunner(onnx_path)
    prompt = torch.randint(3, 128, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    new, _ = runner.generate(prompt, 32)
    eager, _ = _eager_logits(cfg, prompt + new[:-1])
    assert new == [int(x.argmax()) for x in eager[len(prompt) - 1 :]]

    runner.reset()
    step = DecodeStep(tiny_llama(), cfg, MAX_LEN)
    names = step.cache_names()
    worst, boundary_steps = 0.0, 0
    for pos, tok in enumerate(prompt + new[:-1]):
        step.load_cache_tensors([torch.from_numpy(runner.past[n]).clone() for n in names])
        theirs = runner.step(tok, pos)
        with torch.no_grad():
            ours = step(torch.tensor([[tok]]), torch.tensor([pos]))[0, -1]
        relative = ((theirs - ours).abs().max() / ours.abs().max()).item()
        if _assert_same_cache(cfg, dict(zip(names, step.cache_tensors())), runner.past):
            worst = max(worst, relative)
        else:  # this step stored a code one level apart (allowed above), and read it at once
            boundary_steps += 1
            assert relative < 1e-2, f"position {pos}: relative logit difference {relative:.1e}"
    print(f"onnx {cfg.name}: per-step relative logit difference {worst:.1e}; {boundary_steps} steps stored a code "
          "one level apart")  # fmt: skip
    assert worst < 1e-5
    assert boundary_steps <= 2
    assert int(step.cache.layers[0].body_end) > 0  # the packed codes were really read


def _assert_same_cache(cfg, ours: dict, past: dict) -> bool:
    """Check onnxruntime's stored cache against eager's (see the test above); True when every code,
    scale, zero and outlier index is identical, False when a code legitimately moved one level."""
    identical = True
    specs = cfg.resolve(len({name.split("_")[0] for name in ours}))  # names are layer<i>_<k|v>_<field>
    for name, t in ours.items():
        got = torch.from_numpy(past[name])
        if name.endswith("_out_idx"):
            assert torch.equal(got, t), name
        if name.endswith("_codes"):
            prefix = name.removesuffix("codes")
            theirs = {m: torch.from_numpy(past[prefix + m]) for m in ("scale", "zero")}
            _assert_codes_agree(specs, name, got, t, theirs, {m: ours[prefix + m] for m in ("scale", "zero")})
        # Float16 metadata of inputs that differ by float rounding (pre-RoPE keys pass through
        # cos/sin, the GEMMs sum in another order): a group minimum near a float16 value can round
        # down on one side and not the other, and the step down is one or two ulps (`_step`), so
        # zero (and scale = range / levels with it) may differ by two float16 ulps, never more.
        if name.endswith(("_scale", "_zero")):
            assert _float16_ulps_apart(got, t).max() <= 2, name
        if name.endswith("_out_val"):
            torch.testing.assert_close(got, t, rtol=1e-5, atol=1e-6)
        if name.endswith(("_codes", "_scale", "_zero")):
            identical = identical and torch.equal(got, t)
    return identical


def _assert_codes_agree(specs, name: str, got: torch.Tensor, want: torch.Tensor, got_meta: dict, want_meta: dict) -> None:
    """Stored codes identical in every group whose float16 scale and zero are identical; in a group
    whose metadata differ by their allowed ulp or two (below), a code near a level boundary may
    move to the neighbouring level, never further."""
    from kvq_ao.quant.packing import unpack_float

    layer, kind = int(name.split("_")[0].removeprefix("layer")), name.split("_")[1]
    spec = getattr(specs[layer], {"k": "key", "v": "value"}[kind])
    if not spec.is_quantized:
        assert torch.equal(got, want), name
        return
    a, b = unpack_float(got, spec.bits), unpack_float(want, spec.bits)
    same = (got_meta["scale"] == want_meta["scale"]) & (got_meta["zero"] == want_meta["zero"])
    if spec.axis == "token":
        same = same.repeat_interleave(spec.group_size, dim=-1)
    else:  # per-channel: a row per block of tokens, or one for all (calibrated ranges)
        same = same.repeat_interleave(a.shape[-2] // same.shape[-2], dim=-2)
    assert torch.equal(a[same], b[same]), f"{name}: codes differ where scale and zero are identical"
    assert (a - b).abs().max() <= 1, f"{name}: a code moved more than one level"


def _float16_ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the float16 ulp at the larger magnitude (2^-24 for subnormals)."""
    a, b = a.double(), b.double()
    _, exponent = torch.frexp(torch.maximum(a.abs(), b.abs()))
    ulp = torch.pow(2.0, (exponent - 11).clamp(min=-24).double())
    return (a - b).abs() / ulp


def test_pte_delegates_its_linear_layers_to_xnnpack_by_default(exported):
    _, pte, _ = exported
    # per layer: q, k and v in one XNNPACK call (same input), o, gate and up in one, down; then the lm head
    assert pte.delegate_calls == 2 * 4 + 1


def test_without_the_kvq_kernel_library_auto_falls_back_to_a_portable_pte_that_matches_eager(tmp_path, monkeypatch):
    """Where the kvq ExecuTorch kernel library cannot be built, "auto" says so and exports the
    attention decomposed into portable ops (here with no XNNPACK delegate either): it runs anywhere."""
    from kvq_ao.export.executorch import ExecuTorchRunner, program_operators
    from kvq_ao.kernels.cpu import executorch_library

    monkeypatch.setitem(executorch_library._state, "loaded", None)
    monkeypatch.setitem(executorch_library._state, "failed", executorch_library.KernelLibraryError("no g++ here"))
    with pytest.raises(executorch_library.KernelLibraryError, match="kvq_kernels='native' needs the kvq ExecuTorch kernel library: no g"):
        export_executorch(tiny_llama(), SHORT_WINDOW, tmp_path / "n.pte", max_seq_len=MAX_LEN, kvq_kernels="native")
    with pytest.warns(RuntimeWarning, match=r"kernel library is not available here \(no g\+\+ here\); the .pte runs"):
        pte = export_executorch(tiny_llama(), SHORT_WINDOW, tmp_path / "p.pte", max_seq_len=MAX_LEN, backend="portable")
    assert pte.delegate_calls == 0 and pte.kvq_kernels == "portable"
    assert not any(op.startswith("kvq::") for op in program_operators(pte.path))
    monkeypatch.undo()  # the runner may load the library again: the program does not need it
    prompt = torch.randint(3, 128, (32,), generator=torch.Generator().manual_seed(1)).tolist()
    _generate_and_compare(ExecuTorchRunner(pte.path), SHORT_WINDOW, prompt, "executorch-portable")


def test_a_native_pte_without_the_kvq_kernel_library_says_what_to_load(exported):
    """In a fresh process that does not load the library, loading the program fails with a
    message naming the op, the library, how to load it and the portable alternative."""
    import subprocess
    import sys

    _, pte, _ = exported
    code = (
        "from kvq_ao.export.executorch import ExecuTorchRunner\n"
        f"ExecuTorchRunner({str(pte.path)!r}, load_kvq_kernels=False)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode != 0
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith("RuntimeError:") and "calls kvq::decode_attention.out" in message, done.stderr[-2000:]
    assert "kvq_ao.kernels.cpu.executorch_library.load()" in message and "kvq_kernels='portable'" in message


def test_pte_cache_is_packed_and_its_bytes_match_the_memory_report(exported):
    cfg, pte, _ = exported
    step = DecodeStep(tiny_llama(), cfg, MAX_LEN)
    codes = {n: v for n, v in pte.mutable_buffers.items() if n.endswith("_codes")}
    assert codes and all(dtype == torch.uint8 for dtype, _ in codes.values())
    assert all(pte.mutable_buffers[n][0] == torch.float16 for n in pte.mutable_buffers if n.endswith(("_scale", "_zero")))
    with torch.no_grad():
        step(torch.tensor([[5]]), torch.tensor([0]))
    report = step.cache.memory_report()
    lengths = 8 * len(step.cache.layers)  # the int64 length counter per layer is not cache data
    assert pte.cache_bytes - lengths + _codebook_bytes(step, fixed_ranges=True) == report.bytes


def test_onnx_past_tensors_are_packed_and_match_the_memory_report(exported):
    import onnxruntime

    cfg, _, onnx_path = exported
    session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    past = {i.name: i for i in session.get_inputs() if i.name.startswith("past.")}
    assert all(i.type == "tensor(uint8)" for n, i in past.items() if n.endswith("_codes"))
    size = {"tensor(uint8)": 1, "tensor(float16)": 2, "tensor(float)": 4, "tensor(int64)": 8}
    total = sum(int(np.prod(i.shape)) * size[i.type] for i in past.values())
    step = DecodeStep(tiny_llama(), cfg, MAX_LEN)
    with torch.no_grad():
        step(torch.tensor([[5]]), torch.tensor([0]))
    assert total - 8 * len(step.cache.layers) + _codebook_bytes(step) == step.cache.memory_report().bytes


def _codebook_bytes(step, fixed_ranges: bool = False) -> int:
    """Codebooks are counted by the memory report but are program constants, not cache buffers; so
    are calibrated key ranges in a .pte (`fixed_ranges`: never written, ExecuTorch keeps them with
    the constants, while ONNX passes them with the other cache tensors)."""
    total = 0
    for layer in step.cache.layers:
        for body in (layer.k_body, layer.v_body):
            total += 4 * body.codebook.numel()
            if fixed_ranges and body.spec.calibrated_ranges:
                total += sum(t.numel() * t.element_size() for t in (body.scale, body.zero))
    return total


def test_running_past_max_seq_len_or_a_too_long_prompt_is_a_clear_error(exported):
    from kvq_ao.export.executorch import ExecuTorchRunner
    from kvq_ao.export.onnx import OnnxRunner

    _, pte, onnx_path = exported
    for runner in (ExecuTorchRunner(pte.path), OnnxRunner(onnx_path)):
        with pytest.raises(ValueError, match="exceeds the exported max_seq_len=96"):
            runner.generate([5] * 90, 10)
        with pytest.raises(ValueError, match="past the exported max_seq_len=96"):
            runner.step(5, 96)


def test_exporting_an_unsupported_model_or_config_is_a_clear_error(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="unsupported model type 'gpt2'"):
        export_executorch(gpt2, KVQuantConfig.preset("kivi-4"), tmp_path / "x.pte")
    with pytest.raises(ValueError, match="ExecuTorch backend must be one of"):
        export_executorch(tiny_llama(), KVQuantConfig.preset("kivi-4"), tmp_path / "x.pte", backend="vulkan")
    bad = KVQuantConfig(layers=(KVQuantConfig.preset("int8").default,) * 5, name="five")
    with pytest.raises(ValueError, match="has 5 layer specs but the model has 2 layers"):
        export_onnx(tiny_llama(), bad, tmp_path / "x.onnx")
    with pytest.raises(ValueError, match="max_cache_len must be positive"):
        export_onnx(tiny_llama(), KVQuantConfig.preset("kivi-4"), tmp_path / "x.onnx", max_seq_len=0)


def test_cli_export_then_talk_generates_what_eager_generates(tmp_path, capsys):
    """`kvq export --prompt` and `kvq talk` on a model folder answer with eager quantized greedy tokens."""
    from transformers import AutoTokenizer

    from kvq_ao.cli import main
    from kvq_ao.eval import chat_ids
    from kvq_ao.export.decoder import greedy_generate
    from kvq_ao.models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2"))
    model = tiny_llama(vocab_size=len(tokenizer))
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out, prompt, n_new, max_len = tmp_path / "tiny.onnx", "Why is the sky blue?", 8, 80
    common = ["--prompt", prompt, "--max-new-tokens", str(n_new)]
    assert main(["export", "--format", "onnx", "--model", str(folder), "--preset", "kivi-2",
                 "--max-seq-len", str(max_len), "--out", str(out), *common]) == 0  # fmt: skip
    exported = capsys.readouterr().out.strip()
    assert main(["talk", str(out), "--model", str(folder), *common]) == 0
    talked = capsys.readouterr().out.strip()

    ids = chat_ids(tokenizer, prompt)  # the CLI's own prompt formatting
    step = DecodeStep(model, KVQuantConfig.preset("kivi-2"), max_len)
    with torch.no_grad():
        new, _ = greedy_generate(lambda t, p: step(torch.tensor([[t]]), torch.tensor([p]))[0, -1], ids, n_new, max_len)
    expected = f"[{out.name}] {tokenizer.decode(new, skip_special_tokens=True).strip()}"
    assert exported == talked == expected


def test_runtime_log_lines_go_to_the_logger_not_the_terminal(exported):
    """ExecuTorch's runtime writes lines like "[cpuinfo_utils.cpp:87] Failed to open midr file"
    while loading; `kvq talk` must print only the answer. Fresh processes: the runtime logs once."""
    import subprocess
    import sys

    _, pte, _ = exported
    load = f"from kvq_ao.export.executorch import ExecuTorchRunner; ExecuTorchRunner({str(pte.path)!r})"
    quiet = subprocess.run([sys.executable, "-W", "ignore", "-c", load], capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0, quiet.stderr
    assert ".cpp:" not in quiet.stdout + quiet.stderr
    routed = subprocess.run([sys.executable, "-W", "ignore", "-c", "import logging; logging.basicConfig(level=logging.INFO); " + load],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    native = [line for line in routed.stderr.splitlines() if ".cpp:" in line]
    assert native, "the runtime logged nothing on load here: this check needs its log lines to route"
    assert all(line.startswith("INFO:kvq_ao.executorch:") for line in native), native


def test_a_pte_exported_with_a_prefix_starts_from_its_cache_and_matches_eager(tmp_path):
    """The cache of a 40-token prefix is stored in the program; generation continues at position 40
    and matches an eager decode step filled the same way; a second generation is refused."""
    from kvq_ao.export.executorch import ExecuTorchRunner

    tokens = torch.randint(3, 128, (56,), generator=torch.Generator().manual_seed(2)).tolist()
    prefix, prompt = tokens[:40], tokens[40:]
    pte = export_executorch(tiny_llama(), SHORT_WINDOW, tmp_path / "prefix.pte", max_seq_len=MAX_LEN, prefix_ids=prefix)
    runner = ExecuTorchRunner(pte.path)
    assert runner.prefix_len == 40
    new, logits = runner.generate(prompt, 12)
    step = DecodeStep(tiny_llama(), SHORT_WINDOW, MAX_LEN)
    step.fill(prefix)
    assert int(step.cache.layers[0].body_end) > 0  # the prefix went into packed codes
    with torch.no_grad():
        eager = [step(torch.tensor([[t]]), torch.tensor([40 + i]))[0, -1] for i, t in enumerate(prompt + new[:-1])]
    diff = max((a - b).abs().max().item() / b.abs().max().item() for a, b in zip(logits, eager))
    assert diff < 1e-3
    assert new == [int(x.argmax()) for x in eager[len(prompt) - 1 :]]
    with pytest.raises(RuntimeError, match="generates once per load"):
        runner.generate(prompt, 4)
    with pytest.raises(ValueError, match="after a 40-token prefix exceeds the exported max_seq_len=96"):
        ExecuTorchRunner(pte.path).generate(prompt, 50)


def test_runners_refuse_programs_of_another_format_version_another_config_or_damaged(tmp_path, monkeypatch):
    """An exported program records kvq_ao's cache format version and its config; the runners refuse
    another version (the buffers would be read with another layout), another config when given one,
    a file that differs from the checksum recorded at export (one flipped byte), and, unchecked, a
    truncated file, each naming the file and what is wrong."""
    import random

    from kvq_ao.files import checksum_path, record_checksum
    import onnx

    from kvq_ao.export import executorch as et_export
    from kvq_ao.export import onnx as onnx_export
    from kvq_ao.export.executorch import ExecuTorchRunner
    from kvq_ao.export.onnx import OnnxRunner

    cfg, other = KVQuantConfig.preset("kivi-4"), KVQuantConfig.preset("kivi-2")
    pte = export_executorch(tiny_llama(), cfg, tmp_path / "m.pte", max_seq_len=32).path
    model = export_onnx(tiny_llama(), cfg, tmp_path / "m.onnx", max_seq_len=32)
    assert ExecuTorchRunner(pte, config=cfg).max_seq_len == 32 and OnnxRunner(model, config=cfg).config == cfg
    for runner, path in ((ExecuTorchRunner, pte), (OnnxRunner, model)):
        with pytest.raises(ValueError, match="exported with .*config"):
            runner(path, config=other)
        damaged = tmp_path / f"damaged{path.suffix}"
        if path.suffix == ".onnx":
            for f in (damaged.with_suffix(".cache_init.npz"), checksum_path(damaged.with_suffix(".cache_init.npz"))):
                f.write_bytes((path.parent / f.name.replace("damaged", path.stem)).read_bytes())
        data = bytearray(path.read_bytes())
        data[random.Random(7).randrange(len(data))] ^= 0x10  # one flipped bit anywhere (a weight, most likely)
        damaged.write_bytes(bytes(data))
        checksum_path(damaged).write_text(checksum_path(path).read_text().replace(path.name, damaged.name))
        with pytest.raises(ValueError, match=f"{damaged.name}: differs from the sha256 recorded in {damaged.name}.sha256"):
            runner(damaged)
        damaged.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
        with pytest.raises(ValueError, match=f"{damaged.name}: not a loadable"):
            runner(damaged, verify=False)
        checksum_path(damaged).unlink()
        with pytest.raises(ValueError, match=f"{damaged.name}: no recorded checksum"):
            runner(damaged)
    # another format version: a .pte exported by a kvq_ao whose format differs, an .onnx edited to say so
    monkeypatch.setattr(et_export, "FORMAT_VERSION", 999)
    future = export_executorch(tiny_llama(), cfg, tmp_path / "future.pte", max_seq_len=32).path
    monkeypatch.undo()
    from kvq_ao.format import FORMAT_VERSION

    with pytest.raises(ValueError, match=f"future.pte: exported for kvq_ao cache format 999, this kvq_ao reads format {FORMAT_VERSION}"):
        ExecuTorchRunner(future)
    proto = onnx.load(str(model))
    for p in proto.metadata_props:
        if p.key == "kvq_format_version":
            p.value = "999"
    onnx.save(proto, str(tmp_path / "future.onnx"))
    (tmp_path / "future.cache_init.npz").write_bytes(model.with_suffix(".cache_init.npz").read_bytes())
    for f in ("future.onnx", "future.cache_init.npz"):
        record_checksum(tmp_path / f)  # as a future kvq_ao's export would
    with pytest.raises(ValueError, match="future.onnx: exported for kvq_ao cache format 999"):
        OnnxRunner(tmp_path / "future.onnx")
    assert onnx_export.FORMAT_VERSION == FORMAT_VERSION  # the edit above changed the file, not the module
