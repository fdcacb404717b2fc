"""Real-model export check: SmolLM2 with kivi-4 and kivi-2, exported to ExecuTorch and ONNX.

For each (preset, runtime): export, greedy-generate 32 tokens after a 32-token chat prompt, and
compare every step's logits with the eager quantized decode step. Prints a table and writes
results/export_smollm2/export_smollm2.json.

`--noise-floor` adds a row per preset that exports nothing: the same eager step run a second time
with every linear layer computed in float64 and rounded to float32 (a GEMM that sums in another
order, as a runtime's does). Its distance to the plain eager run is how far two equally valid
float32 evaluations of the quantized model drift apart; a runtime cannot be expected to land closer.
Rows also count the packed code bytes that differ from the eager cache after the run (onnxruntime
and the noise floor; ExecuTorch does not hand its mutable buffers back).

    python benchmarks/export_smollm2.py [--out-dir /tmp/kvq-export] [--noise-floor]
"""

import argparse
import dataclasses
import json
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from kvq_ao import KVQuantConfig
from kvq_ao.export import EXECUTORCH_BACKENDS, KVQ_KERNELS, export_executorch, export_onnx
from kvq_ao.export.decoder import DecodeStep, greedy_generate
from kvq_ao.export.executorch import ExecuTorchRunner
from kvq_ao.export.onnx import OnnxRunner
from kvq_ao.eval import chat_ids

from common import save_json, smollm2, stamp

PROMPT = "Explain in two sentences why the sky is blue."
CODE_TENSORS = ("k_codes", "v_codes")


@contextmanager
def float64_linears():
    """Every nn.Linear computed in float64, rounded once to float32: a differently summed GEMM."""
    original = torch.nn.Linear.forward

    def forward(self, x):
        bias = None if self.bias is None else self.bias.double()
        return torch.nn.functional.linear(x.double(), self.weight.double(), bias).to(x.dtype)

    torch.nn.Linear.forward = forward
    try:
        yield
    finally:
        torch.nn.Linear.forward = original


def code_tensors(step: DecodeStep) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in zip(step.cache_names(), step.cache_tensors()) if n.endswith(CODE_TENSORS)}


def differing_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[int, int, int | None]:
    """(differing bytes, total bytes, first layer with a difference)."""
    diff = {n: int((a[n] != b[n]).sum()) for n in a}
    first = next((int(n.split("_")[0].removeprefix("layer")) for n in a if diff[n]), None)
    return sum(diff.values()), sum(t.numel() for t in a.values()), first


def eager_run(model, cfg, tokens: list[int]) -> tuple[list[torch.Tensor], DecodeStep]:
    step = DecodeStep(model, cfg, 128)
    with torch.no_grad():
        logits = [step(torch.tensor([[t]]), torch.tensor([i]))[0, -1] for i, t in enumerate(tokens)]
    return logits, step


def compare(logits: list[torch.Tensor], eager: list[torch.Tensor], n_prompt: int, new: list[int]) -> dict:
    eager_new = [int(x.argmax()) for x in eager[n_prompt - 1 :]]
    diff = max((a - b).abs().max().item() for a, b in zip(logits, eager))
    scale = max(b.abs().max().item() for b in eager)
    return dict(max_abs_diff=diff, relative=diff / scale, tokens_equal=sum(a == b for a, b in zip(new, eager_new)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", default="/tmp/kvq-export")
    parser.add_argument("--presets", default="kivi-4,kivi-2")
    parser.add_argument("--residual", type=int, default=None,
                        help="override the fp window (the presets' 128 tokens cover a whole 64-token run, "
                             "so no packed code is read unless this is smaller)")
    parser.add_argument("--sink", type=int, default=None, help="override sink_tokens")
    parser.add_argument("--runtimes", default="executorch,onnx", help="comma list; empty for none")
    parser.add_argument("--backend", default=EXECUTORCH_BACKENDS[0], choices=EXECUTORCH_BACKENDS, help="ExecuTorch backend")
    parser.add_argument("--kvq-kernels", default="native", choices=KVQ_KERNELS, help="ExecuTorch: kvq attention native or portable")
    parser.add_argument("--noise-floor", action="store_true", help="add the eager-vs-eager float64-linears row")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for preset in args.presets.split(","):
        cfg = KVQuantConfig.preset(preset)
        if args.residual is not None or args.sink is not None:
            residual = cfg.residual_length if args.residual is None else args.residual
            sink = cfg.sink_tokens if args.sink is None else args.sink
            cfg = dataclasses.replace(cfg, residual_length=residual, sink_tokens=sink, name=f"{preset}-r{residual}-s{sink}")
        model, tok = smollm2(args.threads)
        ids = chat_ids(tok, PROMPT)[:32]
        for runtime in [r for r in args.runtimes.split(",") if r]:
            path = out_dir / f"smollm2-{preset}.{'pte' if runtime == 'executorch' else 'onnx'}"
            t0 = time.perf_counter()
            if runtime == "executorch":
                pte = export_executorch(model, cfg, path, max_seq_len=128, backend=args.backend, kvq_kernels=args.kvq_kernels)
                runner = ExecuTorchRunner(path)
            else:
                export_onnx(model, cfg, path, max_seq_len=128)
                runner = OnnxRunner(path)
            export_s = time.perf_counter() - t0
            new, logits = runner.generate(ids, 32)
            eager, step = eager_run(model, cfg, ids + new[:-1])
            label = f"executorch-{args.backend}-{pte.kvq_kernels}-kvq" if runtime == "executorch" else runtime
            row = dict(preset=cfg.name, body_end_layer0=int(step.cache.layers[0].body_end), runtime=label,
                       export_s=round(export_s, 1), **compare(logits, eager, len(ids), new),
                       text=tok.decode(new, skip_special_tokens=True))  # fmt: skip
            if runtime == "onnx":
                names = [n for n in runner.names if n.endswith(CODE_TENSORS)]
                ours = {n: torch.from_numpy(runner.past[n]) for n in names}
                eager_codes = code_tensors(step)  # cloned once, not once per name
                theirs = {n: eager_codes[n] for n in names}
                row["code_bytes_differing"], row["code_bytes"], row["first_layer_differing"] = differing_bytes(ours, theirs)
            rows.append(row)
            print(json.dumps(row), flush=True)
        if args.noise_floor:
            step = DecodeStep(model, cfg, 128)
            with torch.no_grad():
                new, eager = greedy_generate(lambda t, p: step(torch.tensor([[t]]), torch.tensor([p]))[0, -1], ids, 32, 128)
            with float64_linears():
                other, other_step = eager_run(model, cfg, ids + new[:-1])
            other_new = [int(x.argmax()) for x in other[len(ids) - 1 :]]
            row = dict(preset=cfg.name, body_end_layer0=int(step.cache.layers[0].body_end),
                       runtime="eager, float64-rounded linears", **compare(other, eager, len(ids), other_new))  # fmt: skip
            row["code_bytes_differing"], row["code_bytes"], row["first_layer_differing"] = differing_bytes(
                code_tensors(other_step), code_tensors(step))
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path("results/export_smollm2/export_smollm2.json")
    previous = json.loads(out.read_text()) if out.exists() else []
    keep = [r for r in previous if (r["preset"], r["runtime"]) not in {(x["preset"], x["runtime"]) for x in rows}]
    for row in rows:
        row.update(stamp(threads=args.threads))
    save_json(out, keep + rows)


if __name__ == "__main__":
    main()
