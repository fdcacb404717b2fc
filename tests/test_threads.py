"""Thread safety: concurrent `generate()` calls on one quantized model, each building its own cache
(what `quantize_kv_` makes generate do), give exactly the tokens the same calls give one after
another. The model's config is shared state: `quantize_kv_` while another thread generates is not
supported (the README says so)."""

from concurrent.futures import ThreadPoolExecutor

import dataclasses

import pytest
import torch

from conftest import tiny_llama
from kvq_ao import KVQuantConfig, quantize_kv_


@pytest.mark.parametrize("preset", ["kivi-4", "kivi-2"])
def test_concurrent_generate_calls_give_the_sequential_tokens(preset):
    model = tiny_llama(layers=2, seed=3)
    model.generation_config.eos_token_id = None  # random weights: every call runs all its steps
    model.generation_config.pad_token_id = 0
    # an 8-token window: prompts and generated tokens cross quantized block boundaries
    quantize_kv_(model, dataclasses.replace(KVQuantConfig.preset(preset), residual_length=8, name=f"{preset}-w8"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 120, (1, n), generator=g) for n in (5, 37, 64, 90, 121, 13)]

    @torch.no_grad()
    def run(ids):
        return model.generate(ids, max_new_tokens=40, do_sample=False)

    sequential = [run(p) for p in prompts]
    assert len({tuple(s[0, -40:].tolist()) for s in sequential}) > 1  # the prompts lead to different tokens
    for _ in range(3):  # a few rounds, threads interleaving differently
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            concurrent = list(pool.map(run, prompts))
        for ids, want, got in zip(prompts, sequential, concurrent):
            assert torch.equal(got, want), f"prompt of {ids.shape[1]} tokens: a concurrent call gave other tokens"
