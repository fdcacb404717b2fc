"""Passkey retrieval (a needle in filler text) on SmolLM2, as KVQuant reports it, per cache config.

A random 5-digit key is hidden at a depth of 0-100% of `length` tokens of filler; the model reads
the whole prompt through the cache (prefilled in chunks) and answers greedily. A trial passes when
the key's digits appear in the first `--answer-tokens` generated tokens.

    <intro> <filler up to the depth> The pass key is 48213. Remember it. 48213 is the pass key.
    <rest of the filler> What is the pass key? The pass key is

The intro and the question follow the passkey prompt of Landmark Attention / LongLoRA that KVQuant
uses. Filler: the held-out half of pydoc's topics (the text every quality figure here uses),
from its start, the same for every trial; it was fixed before any result was seen. `--filler dev`
takes the development text instead (pydoc's calibration half after the calibration tokens, as the
preset-layout experiments use), for choices that must not be made on the held-out prompts. Trials of one
cell share the filler before the needle: that prefix is prefilled once and its cache copied.

Rows are appended to the results file as they finish; `--resume` skips the cells already there,
so a long grid can be run in pieces.

    python benchmarks/passkey.py --lengths 2048,4096,8192 --depths 0,25,50,75,100 --trials 20 \\
        --configs fp,kivi-4,kivi-2,kvquant-4-1pct,kvquant-3-1pct,kvquant-2-1pct,results/tune/tuned-3bit.json --resume
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from pathlib import Path

import torch

from common import preset_config, smollm2, stamp

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n\n")  # fmt: skip
NEEDLE = "\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"


def _config(name: str):
    """A config file (.json), a preset, or "<preset>/<scores>" (`common.preset_config`)."""
    from kvq_ao import KVQuantConfig

    return KVQuantConfig.load(name) if name.endswith(".json") else preset_config(name)


def _label(name: str) -> str:
    return Path(name).stem if name.endswith(".json") else name


class Prompts:
    """Token ids of the prompt's pieces; the filler is cut so the whole prompt is `length` tokens."""

    def __init__(self, tokenizer, filler: str = "eval"):
        from kvq_ao.models import CALIBRATION_TOKENS, pydoc_text

        self.tok = tokenizer
        self.intro = self._ids(INTRO)
        self.question = self._ids(QUESTION)
        if filler == "eval":
            self.filler = self._ids(pydoc_text("eval"))
        elif filler == "dev":
            self.filler = self._ids(pydoc_text("calib"))[CALIBRATION_TOKENS:]
        else:
            raise ValueError(f"filler must be 'eval' or 'dev', got {filler!r}")

    def _ids(self, text: str) -> torch.Tensor:
        return self.tok(text, return_tensors="pt", add_special_tokens=False).input_ids[0]

    def parts(self, length: int, depth: float, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(the prefix before the needle, the rest of the prompt), as [1, n] ids."""
        needle = self._ids(NEEDLE.format(key=key))
        n_filler = length - len(self.intro) - len(needle) - len(self.question)
        if n_filler <= 0 or n_filler > len(self.filler):
            raise ValueError(f"cannot build a {length}-token prompt from {len(self.filler)} filler tokens")
        cut = round(n_filler * depth)
        prefix = torch.cat([self.intro, self.filler[:cut]])
        rest = torch.cat([needle, self.filler[cut:n_filler], self.question])
        return prefix.unsqueeze(0), rest.unsqueeze(0)


@torch.no_grad()
def _feed(model, cache, ids: torch.Tensor, chunk: int):
    out = None
    for s in range(0, ids.shape[1], chunk):
        out = model(ids[:, s : s + chunk], cache=cache, logits_to_keep=1)
    return out


@torch.no_grad()
def _answer(model, cache, last_logits: torch.Tensor, n: int) -> list[int]:
    token = last_logits[:, -1:].argmax(-1)
    tokens = [int(token)]
    for _ in range(n - 1):
        token = model(token, cache=cache).logits[:, -1:].argmax(-1)
        tokens.append(int(token))
    return tokens


def run_config(name: str, args, done: set, out_path: Path) -> None:
    from transformers import DynamicCache

    from kvq_ao import make_cache, quantize_kv_

    model, tokenizer = smollm2(args.threads)
    if name != "fp":
        quantize_kv_(model, _config(name))
    prompts = Prompts(tokenizer, args.filler)
    label = _label(name)
    for length in [int(x) for x in args.lengths.split(",")]:
        for depth in [int(x) for x in args.depths.split(",")]:
            trials = [t for t in range(args.trials) if (label, length, depth, t) not in done]
            if not trials:
                continue
            rng = random.Random(f"{length}-{depth}")  # the same keys for every config
            keys = [str(rng.randint(10000, 99999)) for _ in range(args.trials)]
            prefix, _ = prompts.parts(length, depth / 100, keys[0])
            base = DynamicCache(config=model.config) if name == "fp" else make_cache(model, reserve=length + args.answer_tokens)
            t0 = time.perf_counter()
            if prefix.shape[1]:
                _feed(model, base, prefix, args.chunk)
            for t in trials:
                _, rest = prompts.parts(length, depth / 100, keys[t])
                cache = copy.deepcopy(base)
                out = _feed(model, cache, rest, args.chunk)
                answer = tokenizer.decode(_answer(model, cache, out.logits, args.answer_tokens))
                row = dict(config=label, length=length, depth=depth, trial=t, key=keys[t], answer=answer,
                           correct=keys[t] in answer.replace(" ", ""))  # fmt: skip
                with out_path.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            seconds = time.perf_counter() - t0
            print(f"{label} {length} {depth}%: {len(trials)} trials in {seconds:.0f} s", file=sys.stderr, flush=True)


def _table(rows: list[dict], configs: list[str]) -> str:
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["config"], r["length"], r["depth"]), []).append(r["correct"])
    lengths = sorted({k[1] for k in cells})
    depths = sorted({k[2] for k in cells})
    head = "| config | " + " | ".join(f"{n // 1024}k @{d}%" for n in lengths for d in depths) + " |"
    lines = [head, "|---|" + "---:|" * (len(lengths) * len(depths))]
    for c in configs:
        vals = []
        for n in lengths:
            for d in depths:
                got = cells.get((c, n, d), [])
                vals.append(f"{sum(got)}/{len(got)}" if got else "-")
        lines.append(f"| {c} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2048,4096,8192")
    p.add_argument("--depths", default="0,25,50,75,100", help="needle depths, percent of the filler")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--configs", default="fp,kivi-4,kivi-2,kvquant-4-1pct,kvquant-3-1pct,kvquant-2-1pct,results/tune/tuned-3bit.json")
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--answer-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="results/passkey/passkey.jsonl")
    p.add_argument("--filler", choices=["eval", "dev"], default="eval",
                   help="eval: pydoc's held-out half (every reported table); dev: development text for choices")
    p.add_argument("--resume", action="store_true", help="keep the rows already in --out and skip their cells")
    args = p.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists() and not args.resume:
        out.unlink()
    if not out.exists():
        out.write_text(json.dumps(dict(**stamp(command=" ".join(sys.argv), threads=args.threads), header=True)) + "\n")
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    done = {(r["config"], r["length"], r["depth"], r["trial"]) for r in rows if "trial" in r}
    configs = args.configs.split(",")
    for name in configs:
        run_config(name, args, done, out)
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    print(_table([r for r in rows if "trial" in r], [_label(c) for c in configs]))


if __name__ == "__main__":
    main()
