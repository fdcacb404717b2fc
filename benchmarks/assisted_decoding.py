"""Assisted decoding on SmolLM2 through the quantized cache: tokens, acceptance and speed.

For each cache (fp, and each --presets entry) and prompt, greedy generation runs three ways:
plain, prompt lookup (draft tokens copied from the prompt, `prompt_lookup_num_tokens`) and the
model as its own draft (`assistant_model=model`, so a draft has its own quantized cache). Every
assisted run must give plain greedy's tokens with the same cache (checked, a mismatch is an
error). Printed and saved per (cache, mode): tokens/s over the new tokens (mean over prompts,
after one untimed warm-up run), the acceptance rate (draft tokens the model kept / draft tokens
proposed) and the verification rounds. The prompts ask the model to work over a pydoc passage
they quote, the case prompt lookup is made for. Rows: results/assisted_decoding/<presets>.json.

    python benchmarks/assisted_decoding.py --presets kivi-4,kvquant-3-1pct --new-tokens 128
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import save_json, smollm2, stamp

MODES = ("plain", "prompt-lookup", "self-draft")
TASKS = (
    "Copy the first two sentences of the text above word for word.",
    "Summarize the text above in three sentences.",
    "Which Python statements or keywords does the text above mention? Quote them.",
)


def prompts(tokenizer, count: int, passage_tokens: int) -> list[torch.Tensor]:
    """Chat prompts: a held-out pydoc passage of about `passage_tokens` tokens, then a task."""
    from kvq_ao.models import pydoc_text

    words = pydoc_text("eval").split()
    out = []
    for i in range(count):
        passage = " ".join(words[i * 2000 : i * 2000 + passage_tokens * 3 // 4])
        text = f"{passage}\n\n{TASKS[i % len(TASKS)]}"
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt")  # fmt: skip
        out.append(ids if torch.is_tensor(ids) else ids["input_ids"])
    return out


class DraftStats:
    """Counts what the candidate generators propose and what the model keeps, per generate call."""

    def __init__(self):
        from transformers.generation import candidate_generator as cg

        self.proposed = self.accepted = self.rounds = 0
        self._patched = []
        for cls in (cg.AssistedCandidateGenerator, cg.PromptLookupCandidateGenerator):
            real = cls.update_candidate_strategy

            def record(gen, input_ids, scores, num_matches, real=real):
                self.rounds += 1
                self.proposed += scores.shape[1] - 1
                self.accepted += int(num_matches)
                return real(gen, input_ids, scores, num_matches)

            self._patched.append((cls, real))
            cls.update_candidate_strategy = record

    def reset(self) -> None:
        self.proposed = self.accepted = self.rounds = 0


def run(model, ids: torch.Tensor, mode: str, new_tokens: int) -> tuple[torch.Tensor, float]:
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if mode == "prompt-lookup":
        kw.update(prompt_lookup_num_tokens=10)
    elif mode == "self-draft":
        kw.update(assistant_model=model)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, **kw)
    return out[0, ids.shape[1] :], time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="kivi-4,kvquant-3-1pct", help="comma-separated presets (fp is always run)")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--passage-tokens", type=int, default=400)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="results file (default results/assisted_decoding/<presets>.json)")
    args = parser.parse_args()

    from kvq_ao import KVQuantConfig, quantize_kv_

    presets = [p for p in args.presets.split(",") if p]
    for p in presets:
        KVQuantConfig.preset(p)  # unknown names fail before the model loads
    model, tokenizer = smollm2(args.threads)
    model.generation_config.eos_token_id = None  # every run generates --new-tokens (min_new_tokens alone would mask EOS logits)
    batch = prompts(tokenizer, args.prompts, args.passage_tokens)
    stats = DraftStats()
    rows = []
    for cache in ["fp", *presets]:
        if cache != "fp":
            quantize_kv_(model, KVQuantConfig.preset(cache))
        run(model, batch[0], "plain", 8)  # warm-up (kernel build, calibration load)
        for mode in MODES:
            stats.reset()
            speeds = []
            for i, ids in enumerate(batch):
                tokens, seconds = run(model, ids, mode, args.new_tokens)
                if mode == "plain":
                    rows.append(dict(cache=cache, prompt=i, plain_tokens=tokens.tolist()))
                else:
                    plain = next(r for r in rows if r.get("cache") == cache and r.get("prompt") == i and "plain_tokens" in r)
                    if tokens.tolist() != plain["plain_tokens"]:
                        raise AssertionError(f"{cache} {mode} prompt {i}: tokens differ from plain greedy")
                speeds.append(len(tokens) / seconds)
            rate = stats.accepted / stats.proposed if stats.proposed else None
            row = dict(cache=cache, mode=mode, tokens_per_s=statistics.mean(speeds), per_prompt_tokens_per_s=speeds,
                       proposed=stats.proposed, accepted=stats.accepted, rounds=stats.rounds, acceptance=rate,
                       equal_to_plain=True)  # fmt: skip
            rows.append(row)
            print(f"{cache:>16} {mode:>14}: {row['tokens_per_s']:6.1f} tok/s"
                  + (f", acceptance {rate:.3f} ({stats.accepted}/{stats.proposed}), {stats.rounds} rounds" if rate is not None else ""),
                  flush=True)  # fmt: skip
    summary = [r for r in rows if "mode" in r]
    print("\n| cache | mode | tokens/s | vs plain | acceptance | verification rounds |\n|---|---|---:|---:|---:|---:|")
    for r in summary:
        base = next(s for s in summary if s["cache"] == r["cache"] and s["mode"] == "plain")["tokens_per_s"]
        acc = f"{r['acceptance']:.3f}" if r["acceptance"] is not None else "-"
        print(f"| {r['cache']} | {r['mode']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f}x | {acc} | {r['rounds'] or '-'} |")
    out = args.out or f"results/assisted_decoding/{'_'.join(presets) or 'fp'}.json"
    save_json(out, dict(**stamp(threads=args.threads, new_tokens=args.new_tokens, prompts=args.prompts,
                                passage_tokens=args.passage_tokens), rows=summary))  # fmt: skip
    print(f"rows: {out}")


if __name__ == "__main__":
    main()
