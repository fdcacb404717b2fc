"""Real-model export check: SmolLM2 with kivi-4 and kivi-2, exported to ExecuTorch and ONNX.

For each (preset, runtime): export, greedy-generate 32 tokens after a 32-token chat prompt, and
compare every step's logits with the eager quantized decode step. Prints a table and writes
results/export_smollm2.json.

    python benchmarks/export_smollm2.py [--out-dir /tmp/kvq-export]
"""

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

import kvq_ao  # noqa: F401
from kvq_ao import KVQuantConfig
from kvq_ao.export import export_executorch, export_onnx
from kvq_ao.export.decoder import DecodeStep
from kvq_ao.export.executorch import ExecuTorchRunner
from kvq_ao.export.onnx import OnnxRunner
from kvq_ao.models import load_model

PROMPT = "Explain in two sentences why the sky is blue."


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", default="/tmp/kvq-export")
    parser.add_argument("--presets", default="kivi-4,kivi-2")
    parser.add_argument("--residual", type=int, default=None,
                        help="override the fp window (the presets' 128 tokens cover a whole 64-token run, "
                             "so no packed code is read unless this is smaller)")
    parser.add_argument("--sink", type=int, default=None, help="override sink_tokens")
    parser.add_argument("--runtimes", default="executorch,onnx")
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
        model, tok = load_model("smollm2")
        ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
        ids = list(ids if isinstance(ids, list) else ids["input_ids"])[:32]
        for runtime in args.runtimes.split(","):
            path = out_dir / f"smollm2-{preset}.{'pte' if runtime == 'executorch' else 'onnx'}"
            t0 = time.perf_counter()
            if runtime == "executorch":
                export_executorch(model, cfg, path, max_seq_len=128)
                runner = ExecuTorchRunner(path)
            else:
                export_onnx(model, cfg, path, max_seq_len=128)
                runner = OnnxRunner(path)
            export_s = time.perf_counter() - t0
            new, logits = runner.generate(ids, 32)
            step = DecodeStep(model, cfg, 128)
            with torch.no_grad():
                eager = [step(torch.tensor([[t]]), torch.tensor([i]))[0, -1] for i, t in enumerate(ids + new[:-1])]
            eager_new = [int(x.argmax()) for x in eager[len(ids) - 1 :]]
            diff = max((a - b).abs().max().item() for a, b in zip(logits, eager))
            scale = max(b.abs().max().item() for b in eager)
            row = dict(preset=cfg.name, body_end_layer0=int(step.cache.layers[0].body_end), runtime=runtime, export_s=round(export_s, 1), max_abs_diff=diff,
                       relative=diff / scale, tokens_equal=sum(a == b for a, b in zip(new, eager_new)),
                       text=tok.decode(new, skip_special_tokens=True))  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path("results/export_smollm2.json")
    out.parent.mkdir(exist_ok=True)
    previous = json.loads(out.read_text()) if out.exists() else []
    keep = [r for r in previous if (r["preset"], r["runtime"]) not in {(x["preset"], x["runtime"]) for x in rows}]
    out.write_text(json.dumps(keep + rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
