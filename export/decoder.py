"""A one-token decode step with the static quantized cache, shaped for torch.export.

`DecodeStep(model, config, max_seq_len)` owns a `QuantizedKVCache` (static) and exposes
`forward(input_ids [1, 1], cache_position [1]) -> logits [1, 1, vocab]`. Prompts are fed one token
at a time (the same tensor-only append path `torch.compile` traces). The cache's packed tensors
are registered as buffers, so torch.export sees them as mutable buffers (ExecuTorch keeps them
in the program); `cache_tensors` / `load_cache_tensors` let the ONNX exporter pass them in and
out instead, since ONNX drops in-place buffer mutation.

Restarting at `cache_position == 0` reuses the buffers safely: the length is reset from the
position, stale side entries are either overwritten or at positions the causal mask hides.
"""

from __future__ import annotations

import torch

from kvq_ao.api import make_cache, quantize_kv_
from kvq_ao.model_info import check_model, model_dims
from kvq_ao.config import KVQuantConfig
from kvq_ao.kernels import reference
from kvq_ao.ops import run_reference

# Tensors of one layer, in a fixed order (names are used for buffers and ONNX inputs/outputs).
LAYER_TENSORS = ("k_codes", "k_scale", "k_zero", "k_out_val", "k_out_idx", "v_codes", "v_scale", "v_zero",
                 "v_out_val", "v_out_idx", "side_k", "side_v", "side_pos", "body_end", "length")  # fmt: skip
# Buffers whose initial value matters (ExecuTorch leaves other mutable buffers uninitialized):
# -1 marks empty side slots; outlier values are selected before masking, so must be finite.
INITIALIZED = ("side_pos", "out_val")

# Exported programs lower the reference kernels (core ATen), on every device.
DECOMPOSITIONS = {
    torch.ops.kvq.quantize.default: reference.quantize,
    torch.ops.kvq.quantize_fixed.default: reference.quantize_fixed,
    torch.ops.kvq.dequantize.default: reference.dequantize,
    torch.ops.kvq.decode_attention.default: lambda *args, **kwargs: run_reference(args, kwargs),
    torch.ops.kvq.chunk_attention.default: lambda *args, **kwargs: run_reference(args, kwargs),
}


def _layer_tensors(layer) -> dict[str, torch.Tensor]:
    kc, ks, kz = layer.k_body.tensors()
    vc, vs, vz = layer.v_body.tensors()
    kov, koi = layer.k_body.sparse()
    vov, voi = layer.v_body.sparse()
    return dict(k_codes=kc, k_scale=ks, k_zero=kz, k_out_val=kov, k_out_idx=koi, v_codes=vc, v_scale=vs, v_zero=vz,
                v_out_val=vov, v_out_idx=voi, side_k=layer.side_k, side_v=layer.side_v, side_pos=layer.side_pos,
                body_end=layer.body_end, length=layer.cumulative_length)  # fmt: skip


def _set_layer_tensors(layer, t: dict[str, torch.Tensor]) -> None:
    layer.k_body.codes, layer.k_body.scale, layer.k_body.zero = t["k_codes"], t["k_scale"], t["k_zero"]
    layer.v_body.codes, layer.v_body.scale, layer.v_body.zero = t["v_codes"], t["v_scale"], t["v_zero"]
    layer.k_body.out_val, layer.k_body.out_idx = t["k_out_val"], t["k_out_idx"]
    layer.v_body.out_val, layer.v_body.out_idx = t["v_out_val"], t["v_out_idx"]
    layer.side_k, layer.side_v, layer.side_pos = t["side_k"], t["side_v"], t["side_pos"]
    layer.body_end, layer.cumulative_length = t["body_end"], t["length"]


class DecodeStep(torch.nn.Module):
    def __init__(self, model, config: KVQuantConfig, max_seq_len: int):
        super().__init__()
        check_model(model, config)
        if model.dtype != torch.float32:
            raise ValueError(f"export supports float32 models, got {model.dtype}")
        quantize_kv_(model, config)
        self.model = model
        self.config = config
        self.max_seq_len = max_seq_len
        self.cache = make_cache(model, config, max_cache_len=max_seq_len)
        _, kv_heads, head_dim = model_dims(model)
        self.cache.early_initialization(1, kv_heads, head_dim, model.dtype, model.device)
        self.prefix_len = 0  # tokens already in the cache (fill)
        for i, layer in enumerate(self.cache.layers):
            for name, tensor in _layer_tensors(layer).items():
                self.register_buffer(f"layer{i}_{name}", tensor, persistent=False)

    @torch.no_grad()
    def fill(self, prefix_ids: list[int], chunk: int = 512) -> None:
        """Run the model over `prefix_ids` (chunks of `chunk` tokens) so the cache holds them: what an
        exported program whose buffers are initialized from this module starts from."""
        if not 0 < len(prefix_ids) < self.max_seq_len:
            raise ValueError(f"a prefix needs 1 to max_seq_len - 1 = {self.max_seq_len - 1} tokens, got {len(prefix_ids)}")
        ids = torch.tensor([prefix_ids], dtype=torch.long)
        for start in range(0, ids.shape[1], chunk):
            self.model(input_ids=ids[:, start : start + chunk], cache=self.cache, use_cache=True)
        for i, layer in enumerate(self.cache.layers):  # appends may have replaced tensors: re-register
            for name, tensor in _layer_tensors(layer).items():
                setattr(self, f"layer{i}_{name}", tensor)
        self.prefix_len = len(prefix_ids)

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        for layer in self.cache.layers:
            layer.cumulative_length.copy_(cache_position[0])
        return self.model(input_ids=input_ids, cache=self.cache, use_cache=True).logits

    # -- for exporters that carry the cache as inputs/outputs (ONNX)
    def cache_tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.cache.layers for t in _layer_tensors(layer).values()]

    def cache_names(self) -> list[str]:
        return [f"layer{i}_{n}" for i in range(len(self.cache.layers)) for n in LAYER_TENSORS]

    def load_cache_tensors(self, tensors: list[torch.Tensor]) -> None:
        it = iter(tensors)
        for layer in self.cache.layers:
            _set_layer_tensors(layer, {name: next(it) for name in LAYER_TENSORS})


def export_decode_step(step: torch.nn.Module, decompose: bool = True, native_attention: bool = False) -> torch.export.ExportedProgram:
    """torch.export a decode step (strict mode: non-strict failed in lowering on this stack).

    decompose: lower the kvq ops to the reference kernels (core ATen). native_attention keeps the
    decode attention a `kvq::decode_attention` call, for runtimes with the kvq kernel library.
    """
    example = (torch.tensor([[0]], dtype=torch.long), torch.tensor([0], dtype=torch.long))
    with torch.no_grad():
        program = torch.export.export(step, example, strict=True)
    if not decompose:
        return program
    table = dict(DECOMPOSITIONS)
    if native_attention:
        del table[torch.ops.kvq.decode_attention.default]
    return program.run_decompositions(table)


def check_prompt(prompt_len: int, max_new_tokens: int, max_seq_len: int, start: int = 0) -> None:
    if prompt_len == 0:
        raise ValueError("the prompt is empty")
    if start + prompt_len + max_new_tokens > max_seq_len:
        after = f" after a {start}-token prefix" if start else ""
        raise ValueError(
            f"prompt ({prompt_len} tokens) + {max_new_tokens} new tokens{after} exceeds the exported max_seq_len={max_seq_len}"
        )


def greedy_generate(step, prompt_ids: list[int], max_new_tokens: int, max_seq_len: int,
                    start: int = 0) -> tuple[list[int], list[torch.Tensor]]:  # fmt: skip
    """Feed the prompt one token at a time through `step(token, position) -> logits` from position
    `start` (after a prefix already in the cache), then greedy.

    Returns (new token ids, logits of every step: prompt tokens then generated ones).
    """
    check_prompt(len(prompt_ids), max_new_tokens, max_seq_len, start)
    logits, new = [], []
    for pos, tok in enumerate(prompt_ids):
        logits.append(step(tok, start + pos))
    for i in range(max_new_tokens):
        tok = int(logits[-1].argmax())
        new.append(tok)
        if i + 1 < max_new_tokens:
            logits.append(step(tok, start + len(prompt_ids) + i))
    return new, logits


__all__ = ["DecodeStep", "check_prompt", "export_decode_step", "greedy_generate"]
