"""What kvq_ao reads from a transformers model: whether it is supported, its KV shape, its RoPE.

Its own module because the one-liner (`api`), calibration and export all ask these questions,
and none of them should import another just to ask.
"""

from __future__ import annotations

import torch

from kvq_ao.config import KVQuantConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "phi3", "granite", "olmo2", "gemma", "gemma2", "gemma3_text")


def text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_model(model, config: KVQuantConfig) -> None:
    """Raise a clear ValueError when the model or the config does not fit."""
    cfg = text_config(model)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model type {model_type!r} ({type(model).__name__}); kvq_ao supports decoder-only "
            f"Llama-family attention: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if getattr(cfg, "is_encoder_decoder", False):
        raise ValueError("encoder-decoder models are not supported")
    n_layers = cfg.num_hidden_layers
    config.resolve(n_layers)  # raises on a layer-count mismatch
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for i, spec in enumerate(config.resolve(n_layers)):
        try:
            spec.key.check_head_dim(head_dim)
            spec.value.check_head_dim(head_dim)
        except ValueError as e:
            raise ValueError(f"config {config.name!r}, layer {i}: {e}") from None
    if config.pre_rope_keys:
        rotary_of(model)  # raises when the model's RoPE cannot be undone and redone per position
    layer_types = getattr(cfg, "layer_types", None) or []
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"unsupported attention layer types {unknown}; kvq_ao handles full and sliding-window attention")


def model_dims(model) -> tuple[int, int, int]:
    """(num_layers, kv_heads, head_dim) of a supported model."""
    cfg = text_config(model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads, head_dim


def rotary_of(model) -> list[tuple[torch.Tensor, float]]:
    """(inv_freq, attention_scaling) of the rotary embedding of each layer, for pre-RoPE keys: one
    embedding for all layers (Llama, Qwen, ...), or one per layer type where the model rotates its
    layer types with different frequencies (Gemma-3's local and global layers: `<type>_inv_freq`
    buffers, picked by `config.layer_types`)."""
    n_layers = model_dims(model)[0]
    for m in model.modules():
        if hasattr(m, "inv_freq") and hasattr(m, "attention_scaling"):
            _check_rope_type(getattr(m, "rope_type", "default"))
            one = (m.inv_freq.detach().float().clone(), float(m.attention_scaling))
            return [one] * n_layers
        per_type = {n[: -len("_inv_freq")]: b for n, b in m.named_buffers(recurse=False) if n.endswith("_inv_freq")
                    and not n.endswith("original_inv_freq")}  # fmt: skip
        if per_type:
            layer_types = getattr(text_config(model), "layer_types", None)
            if not layer_types or len(layer_types) != n_layers or set(layer_types) - set(per_type):
                raise ValueError(f"pre-RoPE keys: {type(m).__name__} rotates layer types {sorted(per_type)}, but the "
                                 f"config's layer_types {layer_types} do not name one of them for every layer")  # fmt: skip
            rope_types = getattr(m, "rope_type", {})
            out = []
            for kind in layer_types:
                _check_rope_type(rope_types.get(kind, "default") if isinstance(rope_types, dict) else rope_types)
                out.append((per_type[kind].detach().float().clone(), float(getattr(m, f"{kind}_attention_scaling", 1.0))))
            return out
    raise ValueError("pre-RoPE keys: the model has no rotary embedding module (inv_freq, attention_scaling)")


def _check_rope_type(rope_type: str) -> None:
    if rope_type in ("dynamic", "longrope"):
        raise ValueError(f"pre-RoPE keys need a position-independent rotary embedding; {rope_type!r} RoPE "
                         "changes its frequencies with the sequence length")  # fmt: skip


__all__ = ["check_model", "model_dims", "rotary_of", "text_config", "SUPPORTED_MODEL_TYPES"]
