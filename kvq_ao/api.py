"""`quantize_kv_(model, config)`: make a transformers model keep and read a quantized KV cache.

What it does, and nothing more:
1. validates that the model is a supported decoder (Llama-family attention, GQA/MQA, optional
   sliding-window layers) and that the config fits it (layer count, head_dim, groups);
2. switches the model's attention to "kvq", an attention function registered with
   transformers' `AttentionInterface` that sends `QuantizedKV` keys/values to
   `torch.ops.kvq.decode_attention` / `kvq.chunk_attention` (anything else goes to SDPA as before);
3. makes `model.generate()` build a `QuantizedKVCache` of the kind transformers would build
   (static for `cache_implementation="static"`, else dynamic) whenever the caller passes no cache
   and keeps `use_cache` on, with chunked prefill of long prompts by default.
No model code is patched; `model.kvq_config` records the config.
"""

from __future__ import annotations

import inspect
import sys
import types

import torch
from transformers.cache_utils import StaticCache
from transformers.generation.configuration_utils import GenerationMode
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from kvq_ao._torchao import register_quantize_module_handler
from kvq_ao.cache import QuantizedKVCache
from kvq_ao.calibration import for_model
from kvq_ao.config import KVQuantConfig
from kvq_ao.kernels import cpu as native_cpu
from kvq_ao.kernels import gpu as gpu_kernels
from kvq_ao.masks import dense as dense_mask
from kvq_ao.masks import interval_bounds, is_bounds
from kvq_ao.model_info import check_model, model_dims, rotary_of
from kvq_ao.ops import enable_inductor_fusion
from kvq_ao.parallel.attention import ShardedKV, sharded_attention
from kvq_ao.tensor import QuantizedKV
from kvq_ao.tensor import attention as quantized_attention

ATTN_NAME = "kvq"


DYNAMIC_COMPILE_ERROR = (
    "kvq_ao's quantized cache does not support torch.compile(dynamic=True): it makes the cache's format "
    "(bits, group size, sink length) symbolic, and the kvq ops need them fixed. The static cache's decode "
    "step has fixed shapes anyway: compile with dynamic=False or None (kvq_ao.api.compile_config() does)"
)


def kvq_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    """transformers attention function: quantized cache -> the kvq attention ops, else the float path.

    `softcap` (Gemma-2's attention logit soft-capping) is applied inside the kvq op. Without a
    quantized cache (e.g. `use_cache=False`) the float path is SDPA, or the model's own eager
    attention when logits are soft-capped, since SDPA cannot cap them.
    """
    if isinstance(key, ShardedKV):  # a context-parallel cache (kvq_ao.parallel): eager, every rank calls this
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        return sharded_attention(query, key, value, attention_mask, scaling, float(softcap or 0.0)).transpose(1, 2).contiguous(), None
    if not isinstance(key, QuantizedKV):
        if softcap:
            if attention_mask is not None and is_bounds(attention_mask):
                attention_mask = dense_mask(attention_mask, key.shape[2])
            eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
            if eager is None:
                raise ValueError(f"{type(module).__name__} soft-caps its attention logits but its module defines no "
                                 "eager_attention_forward to run them in float; SDPA cannot cap them")  # fmt: skip
            return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, softcap=softcap, **kwargs)
        if attention_mask is not None and is_bounds(attention_mask):  # float K/V: SDPA needs the dense mask
            attention_mask = dense_mask(attention_mask, key.shape[2])
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if torch.compiler.is_compiling() and not torch._dynamo.config.assume_static_by_default:
        raise RuntimeError(DYNAMIC_COMPILE_ERROR)
    if attention_mask is None or attention_mask.dtype not in (torch.bool, torch.int64):
        raise RuntimeError("kvq attention expects the mask built by the 'kvq' mask function (bool, or int64 key-position bounds)")
    if query.shape[2] == 1 and is_bounds(attention_mask):
        attention_mask = dense_mask(attention_mask, key.shape[2])
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = quantized_attention(query, key, value, attention_mask, scaling, float(softcap or 0.0))
    return out.transpose(1, 2).contiguous(), None


_SDPA_MASK_SIGNATURE = inspect.signature(sdpa_mask)


def kvq_mask(*args, **kwargs):
    """The mask the kvq ops read: for a chunk of queries, key-position bounds [batch, 1, q_len, 2]
    (`kvq_ao.masks`) wherever the mask is causal or sliding-window over left padding, so no
    [q_len, kv_len] tensor is built; otherwise, and for one query token, SDPA's boolean mask,
    never skipped (the kvq ops always need an explicit mask)."""
    kwargs["allow_is_causal_skip"] = False
    a = _SDPA_MASK_SIGNATURE.bind(*args, **kwargs)
    a.apply_defaults()
    a = a.arguments
    if a["q_length"] > 1 and not torch.compiler.is_compiling() and not a["use_vmap"]:
        bounds = interval_bounds(a["batch_size"], a["q_length"], a["q_offset"], a["kv_offset"], a["mask_function"],
                                 a["attention_mask"], a["local_size"], a["device"])  # fmt: skip
        if bounds is not None:
            return bounds
    return sdpa_mask(*args, **kwargs)


def register_attention() -> None:
    """Register the "kvq" attention and mask functions with transformers (idempotent).

    Called by `quantize_kv_`, never at import: importing kvq_ao leaves transformers' registries
    as they were (tested)."""
    if AttentionInterface._global_mapping.get(ATTN_NAME) is not kvq_attention_forward:
        AttentionInterface.register(ATTN_NAME, kvq_attention_forward)
    if AttentionMaskInterface._global_mapping.get(ATTN_NAME) is not kvq_mask:
        AttentionMaskInterface.register(ATTN_NAME, kvq_mask)


def make_cache(model, config: KVQuantConfig | None = None, max_cache_len: int | None = None,
               reserve: int | None = None) -> QuantizedKVCache:  # fmt: skip
    """A fresh quantized cache for `model`: static when max_cache_len is given, else dynamic with room
    for `reserve` tokens up front (it grows past them)."""
    config = config or getattr(model, "kvq_config", None)
    if config is None:
        raise ValueError("no config: pass one or call quantize_kv_(model, config) first")
    check_model(model, config)
    return QuantizedKVCache(config, model_dims(model)[0], max_cache_len=max_cache_len, reserve=reserve,
                            calibration=calibration_for(model, config), rope=rope_for(model, config))  # fmt: skip


def calibration_for(model, config: KVQuantConfig):
    """The config's calibration (loaded once per model and config), or None when it needs none."""
    if not config.needs_calibration:
        return None
    memo = model.__dict__.setdefault("_kvq_calibrations", {})
    key = (config.name, config.calibration, config.to_json_key())
    if key not in memo:
        memo[key] = for_model(model, config)
    return memo[key]


def rope_for(model, config: KVQuantConfig):
    if not config.pre_rope_keys:
        return None
    return rotary_of(model)


# ---------------------------------------------------------------------------- the one-liner
def quantize_kv_(model, config: KVQuantConfig):
    """Quantize `model`'s KV cache as `config` says; returns the model (modified in place)."""
    if not isinstance(config, KVQuantConfig):
        raise TypeError(f"config must be a KVQuantConfig, got {type(config).__name__}")
    check_model(model, config)
    register_attention()
    native_cpu.load()  # builds the native CPU kernels on first use (warns and keeps the reference without a compiler)
    if torch.cuda.is_available():
        gpu_kernels.load()  # the Triton decode attention for CUDA tensors (when triton is installed)
    enable_inductor_fusion()
    model.kvq_config = config
    if getattr(model, "_kvq_previous_attn", None) is None:
        model._kvq_previous_attn = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    if not hasattr(model, "_kvq_original_prepare_cache"):
        model._kvq_original_prepare_cache = model._prepare_cache_for_generation
        model._prepare_cache_for_generation = types.MethodType(_prepare_cache_for_generation, model)
        model._kvq_original_prefill = model._prefill
        model._prefill = types.MethodType(_prefill, model)
        _set_default_prefill_chunk(model)
    return model


PREFILL_CHUNK = 2048  # generate()'s default prefill chunk with a quantized cache (prefill_chunk_size= overrides)


def _set_default_prefill_chunk(model) -> None:
    """Make chunked prefill the model's default (its `generation_config`), so a caller's own
    `prefill_chunk_size=`, None included, overrides it the usual transformers way."""
    gc = getattr(model, "generation_config", None)
    if gc is not None and gc.prefill_chunk_size is None:
        gc.prefill_chunk_size = PREFILL_CHUNK
        model._kvq_default_prefill_chunk = PREFILL_CHUNK


def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length):
    """generate() hook: the quantized equivalent of the cache transformers would build.

    Nothing changes when the caller brings a cache or turns caching off (`use_cache=False`);
    otherwise `cache_implementation` None/"dynamic" gives a dynamic `QuantizedKVCache` with room
    reserved for the whole generation, "static" a static one of the length transformers would
    give a `StaticCache` (prompt + max_new_tokens, or `max_cache_len` if larger). The kind is
    never switched: `compile_config` compiles only with a static cache, as in transformers.
    The cache is not marked as user-supplied, so generate returns it only when asked to."""
    config = getattr(self, "kvq_config", None)
    if config is None or model_kwargs.get("cache") is not None or generation_config.use_cache is False:
        return self._kvq_original_prepare_cache(generation_config, model_kwargs, generation_mode, batch_size,
                                                max_cache_length)  # fmt: skip
    kind = generation_config.cache_implementation
    if kind not in (None, "dynamic", "static"):
        raise ValueError(f"cache_implementation={kind!r} conflicts with the kvq_ao cache; use None, 'dynamic' or 'static'")
    if kind == "static":
        if generation_config.compile_config is not None and generation_mode == GenerationMode.ASSISTED_GENERATION:
            raise ValueError(
                "compiled assisted decoding (assistant_model= or prompt_lookup_num_tokens= with a static cache and "
                "compile_config) is not supported with a quantized cache: the compiled step appends one token, and "
                "verifying a draft appends several. Drop compile_config (assisted decoding runs eagerly on the static "
                "or dynamic quantized cache) or the draft"
            )  # fmt: skip
        length = max(max_cache_length, generation_config.max_cache_len or 0)
        cache = make_cache(self, config, max_cache_len=length)
    else:
        cache = make_cache(self, config, reserve=max_cache_length)
    if generation_config.is_assistant:  # as transformers does: an assistant's cache gets cropped
        cache.activate_past_recording()
    model_kwargs["cache"] = cache


def _prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs):
    """generate() hook: chunked prefill where it applies, only when it is kvq_ao's default.

    The default chunk (PREFILL_CHUNK) applies to a dynamic cache fed token ids longer than a chunk;
    generating from `inputs_embeds` (which transformers cannot chunk) or with a static cache (a
    compiled prefill would compile a graph per chunk shape) prefills in one pass. A chunk size
    the caller chose is left to transformers as given."""
    chunk = generation_config.prefill_chunk_size
    if chunk is not None and chunk == getattr(self, "_kvq_default_prefill_chunk", None):
        cache = model_kwargs.get("cache")
        new_tokens = input_ids.shape[1] - (cache.get_seq_length() if cache is not None else 0)
        if (model_kwargs.get("inputs_embeds") is not None or new_tokens <= chunk or cache is None
                or isinstance(cache, StaticCache)):  # fmt: skip
            generation_config.prefill_chunk_size = None
    return self._kvq_original_prefill(input_ids, generation_config, model_kwargs, *args, **kwargs)


@register_quantize_module_handler(KVQuantConfig)
def _torchao_handler(module, config: KVQuantConfig):
    """torchao's `quantize_(model, cfg, filter_fn=...)` entry: applies to the matched model."""
    if not hasattr(module, "config") or not hasattr(module, "generate"):
        raise ValueError(
            "KVQuantConfig applies to a whole transformers model: use filter_fn=lambda m, fqn: fqn == '' "
            f"(it matched a {type(module).__name__})"
        )
    return quantize_kv_(module, config)


def compile_config(fullgraph: bool = True, mode: str = "default"):
    """A transformers `CompileConfig` for compiled `generate()` with the static quantized cache.

    transformers skips compilation on CPU unless the private `_compile_all_devices` flag is set;
    with it, generate compiles the decode step once (one graph, no recompiles across steps,
    caches or prompt lengths: `tests/test_compile.py`).
    """
    from transformers import CompileConfig

    cc = CompileConfig(fullgraph=fullgraph, mode=mode)
    cc._compile_all_devices = True
    return cc


__all__ = ["PREFILL_CHUNK", "compile_config", "make_cache", "quantize_kv_", "register_attention", "kvq_attention_forward", "kvq_mask", "ATTN_NAME"]
