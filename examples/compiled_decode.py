"""Compiled greedy decoding with a static quantized cache, gpt-fast style.

    python examples/compiled_decode.py [--preset kivi-4] [--max-new-tokens 64]

Prefill runs eagerly; each decode step is one `torch.compile`d call (fullgraph) on a static
quantized cache, so dequantization, scores, softmax and the weighted sum fuse into the compiled
step and the cache never turns back into float K/V. The same tokens are then generated eagerly
with the quantized cache, and the two are compared token by token.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvq_ao import KVQuantConfig, make_cache, quantize_kv_
from kvq_ao.models import load_model


@torch.no_grad()
def generate(model, ids: torch.Tensor, cache, max_new_tokens: int, step=None) -> tuple[list[int], float]:
    """Greedy tokens after `ids`, and the median seconds of a decode step."""
    step = step or (lambda token: model(token, cache=cache).logits)
    logits = model(ids, cache=cache).logits
    tokens, times = [], []
    for _ in range(max_new_tokens):
        token = logits[:, -1:].argmax(-1)
        tokens.append(int(token))
        t0 = time.perf_counter()
        logits = step(token)
        times.append(time.perf_counter() - t0)
    return tokens, sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--preset", default="kivi-4")
    parser.add_argument("--prompt", default="Write a short poem about the sea.")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    config = KVQuantConfig.preset(args.preset)  # a bad name fails here, before the model loads
    model, tokenizer = load_model(args.model)
    quantize_kv_(model, config)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True, return_tensors="pt")
    ids = ids if torch.is_tensor(ids) else ids["input_ids"]

    cache = make_cache(model, config, max_cache_len=ids.shape[1] + args.max_new_tokens)  # static: fixed shapes
    step = torch.compile(lambda token: model(token, cache=cache).logits, fullgraph=True)
    compiled, compiled_s = generate(model, ids, cache, args.max_new_tokens, step)
    eager, eager_s = generate(model, ids, make_cache(model, config), args.max_new_tokens)

    print(tokenizer.decode(compiled, skip_special_tokens=True).strip())
    print(f"compiled vs eager quantized: {sum(a == b for a, b in zip(compiled, eager))}/{len(eager)} tokens equal; "
          f"median decode step {1000 * compiled_s:.1f} ms compiled (first step includes compilation), "
          f"{1000 * eager_s:.1f} ms eager")  # fmt: skip
    return dict(compiled=compiled, eager=eager)


if __name__ == "__main__":
    main()
