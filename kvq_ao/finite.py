"""Refusing NaN and Inf where keys and values are quantized.

A float cache stores a NaN or Inf key as it is, and it shows: every query that reads it gets NaN.
Quantized, the same entry would become codes and a scale silently (a NaN range clamps to some
code, an Inf range to a scale that erases the group). So every block is checked as it goes into
the quantized body, the one place each token passes through once: one sum over the block (NaN
and Inf survive a sum) and, only when that is not finite, a search for the first bad entry to
name (a sum that overflowed on finite entries finds none and is let through). Tokens still in
the full-precision window or the sink are held exactly, as a float cache would hold them, and
are checked when they leave the window.

On CPU with the native kernels loaded, the two writers (`kvq.quantize`, `kvq.quantize_fixed`) refuse
NaN/Inf input in their own pass over it, with an error starting with NATIVE_NON_FINITE, so the
eager CPU append runs no check of its own: the cache turns that error into NonFiniteKVError
(`QuantizedLayer._encode_finite`). The sum below serves every other writer (reference, Triton).

Compiled and exported code is not checked (a limit the README states). Raising needs a host read,
and both in-graph ways tried failed: an assert inside an inductor CPU kernel aborted the whole
process when it fired in a parallel loop, and a callback op into Python per layer and step cost
4-14% of the compiled append (one run of benchmarks/append.py while it had a compiled path).
"""

from __future__ import annotations

import math

import torch


NATIVE_NON_FINITE = "kvq: non-finite input"  # how the native CPU writers' refusal begins (quantize_core.h kNonFiniteInput)


class NonFiniteKVError(ValueError):
    """A key or value with NaN or Inf reached the quantized body."""


def _first_bad(x: torch.Tensor) -> tuple[int, ...] | None:
    bad = (~torch.isfinite(x)).nonzero()
    return tuple(int(i) for i in bad[0]) if bad.numel() else None


def _raise_first_bad(blocks: dict[str, torch.Tensor], first_position: int, layer: int) -> None:
    for kind, x in blocks.items():
        where = _first_bad(x)
        if where is not None:
            b, h, i, c = where
            bad = x[b, h, i, c].item()
            raise NonFiniteKVError(
                f"kvq: {kind} with {bad} at position {first_position + i} (layer {layer}, batch row {b}, "
                f"head {h}, stored channel {c}) cannot be quantized: a quantized cache does not store NaN or Inf. "
                "It came from the model's projections (a damaged checkpoint, or a float16 overflow: try bfloat16 "
                "or float32); an fp cache would return NaN for every query that reads it. (Stored channels are the "
                "model's unless keys are stored before RoPE or rotated, which mix channels.)"
            )
    # every entry finite: the sum itself overflowed (entries near the dtype's maximum); nothing to refuse


def refuse_non_finite(blocks: dict[str, torch.Tensor], first_position: int, layer: int | None) -> None:
    """Raise NonFiniteKVError if a block ({"key": [B, H, n, D], "value": ...}, those about to be
    quantized at positions first_position..) holds NaN or Inf: one sum and one host read per kind
    and block, the search for the entry to name only when a sum is not finite. Compiled and
    exported code skip the check (see above)."""
    if torch.compiler.is_compiling():
        return
    for x in blocks.values():  # a sum and a host read per kind (a Python sum of both cost 2x: one more op)
        if not math.isfinite(x.sum().item()):  # in x's dtype: a float16 sum may overflow, then the search finds nothing
            _raise_first_bad(blocks, first_position, -1 if layer is None else layer)
            return


__all__ = ["NATIVE_NON_FINITE", "NonFiniteKVError", "refuse_non_finite"]
