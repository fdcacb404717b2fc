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
from kvq_ao.format import OPERAND_TENSORS
from kvq_ao.ops import decompositions

# Tensors of one layer, in a fixed order (names are used for buffers and ONNX inputs/outputs): each
# operand's fields (`kvq_ao.format`) but the codebook, a constant of the layer, then the shared state.
_STORED = tuple(name for name in OPERAND_TENSORS if name != "codebook")
LAYER_TENSORS = (*(f"{kind}_{name}" for kind in "kv" for name in _STORED), "side_pos", "body_end", "length")
# Buffers whose initial value matters (ExecuTorch leaves other mutable buffers uninitialized):
# -1 marks empty side slots; outlier values are selected before masking, so must be finite.
INITIALIZED = ("side_pos", "out_val")



def _layer_tensors(layer) -> dict[str, torch.Tensor]:
    out = {}
    for kind in "kv":
        body = getattr(layer, f"{kind}_body")
        for name in _STORED:
            out[f"{kind}_{name}"] = getattr(layer, f"side_{kind}") if name == "side" else getattr(body, name)
    return dict(out, side_pos=layer.side_pos, body_end=layer.body_end, length=layer.cumulative_length)


def _set_layer_tensors(layer, t: dict[str, torch.Tensor]) -> None:
    for kind in "kv":
        body = getattr(layer, f"{kind}_body")
        for name in _STORED:
            if name == "side":
                setattr(layer, f"side_{kind}", t[f"{kind}_{name}"])
            else:
                setattr(body, name, t[f"{kind}_{name}"])
    layer.side_pos, layer.body_end, layer.cumulative_length = t["side_pos"], t["body_end"], t["length"]


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
    decode attention and the append's quantizers `kvq::decode_attention`, `kvq::quantize` and
    `kvq::quantize_fixed` calls, for runtimes with the kvq kernel library.
    """
    example = (torch.tensor([[0]], dtype=torch.long), torch.tensor([0], dtype=torch.long))
    with torch.no_grad():
        program = torch.export.export(step, example, strict=True)
    if not decompose:
        return program
    table = decompositions("export")  # the reference kernels (core ATen), on every device
    if native_attention:
        del table[torch.ops.kvq.decode_attention.default]
        del table[torch.ops.kvq.quantize.default]
        del table[torch.ops.kvq.quantize_fixed.default]
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
