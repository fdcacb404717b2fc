"""Generate with the quantized KV cache split over processes (context parallelism).

    torchrun --nproc-per-node 2 examples/context_parallel.py [--preset kivi-2] [--prompt-tokens 4096]

Every rank loads SmolLM2, calls `quantize_kv_`, builds the context-parallel cache (a collective:
the ranks' configs are compared) and runs the same `generate()`. Each rank keeps its share of
every layer's packed cache (segments of `--segment` tokens dealt round-robin) and the ranks merge
their partial attention exactly, so the answer is the single-process one. Rank 0 prints the
continuation and what each rank holds. Without torchrun it runs as one process (world size 1).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from kvq_ao import KVQuantConfig, load_model, quantize_kv_
from kvq_ao.models import pydoc_text
from kvq_ao.parallel import make_context_parallel_cache


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="kivi-2", help="see `kvq presets`")
    parser.add_argument("--prompt-tokens", type=int, default=4096, help="tokens of held-out pydoc text to read")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--segment", type=int, default=1024, help="tokens per segment dealt to a rank")
    args = parser.parse_args(argv)

    config = KVQuantConfig.preset(args.preset)
    launched = "WORLD_SIZE" in os.environ and not dist.is_initialized()
    if launched:
        dist.init_process_group("gloo")  # torchrun set the rendezvous; NCCL on GPUs
    rank = dist.get_rank() if dist.is_initialized() else 0
    model, tokenizer = load_model("smollm2")
    quantize_kv_(model, config)
    ids = tokenizer(pydoc_text("eval"), return_tensors="pt").input_ids[:, : args.prompt_tokens]
    cache = make_context_parallel_cache(model, segment=args.segment)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=args.max_new_tokens,
                         do_sample=False, prefill_chunk_size=512, pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1] :]  # fmt: skip
    held = [cache.tensor_bytes()]
    if dist.is_initialized():
        held = [None] * dist.get_world_size()
        dist.all_gather_object(held, cache.tensor_bytes())
    if rank == 0:
        print(f"{len(held)} rank(s), {args.preset}, {ids.shape[1]} prompt tokens: ...{tokenizer.decode(out)!r}")
        for r, n in enumerate(held):
            print(f"rank {r} holds {n / 2**20:.1f} MiB of the cache")
    if launched:
        dist.destroy_process_group()
    return dict(tokens=out.tolist(), held=held)


if __name__ == "__main__":
    main()
