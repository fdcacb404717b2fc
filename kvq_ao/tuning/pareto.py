"""Candidate (key bits, value bits) pairs and Pareto pruning of a layer's (bits, error) table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

Pair = tuple[int, int]
KVTUNER_WIDTHS: tuple[int, ...] = (2, 4, 8)  # KVTuner's candidate widths, the default
TUNABLE_WIDTHS: tuple[int, ...] = (2, 3, 4, 8)  # every width the cache stores


def candidate_pairs(widths: Sequence[int] = KVTUNER_WIDTHS) -> tuple[Pair, ...]:
    """Every (key bits, value bits) pair over `widths`, key-major and ascending."""
    ws = sorted(set(widths))
    if not ws or any(isinstance(w, bool) or w not in TUNABLE_WIDTHS for w in ws):
        raise ValueError(f"candidate widths must be a non-empty subset of {TUNABLE_WIDTHS}, got {tuple(widths)!r}")
    return tuple((k, v) for k in ws for v in ws)


CANDIDATES: tuple[Pair, ...] = candidate_pairs()


def pair_bits(pair: Pair) -> float:
    """Average nominal bits per K/V element of a (key bits, value bits) pair."""
    check_pair(pair)
    return (pair[0] + pair[1]) / 2


def check_pair(pair: Pair, allowed: Sequence[Pair] | None = None) -> None:
    """`pair` is one of `allowed` (default: any pair of widths the cache stores)."""
    allowed = candidate_pairs(TUNABLE_WIDTHS) if allowed is None else allowed
    if tuple(pair) not in allowed:
        raise ValueError(f"unknown candidate pair {tuple(pair)!r}; candidates are {list(allowed)}")


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates (both coordinates minimized).

    A point is dominated when another is <= in both coordinates and < in at least one; exact
    duplicates keep the first. Returned in order of increasing first coordinate.
    """
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1], i))
    front, best = [], float("inf")
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def prune(errors: Mapping[Pair, float]) -> list[Pair]:
    """A layer's candidate pairs that are Pareto-optimal in (bits, error), cheapest first."""
    if not errors:
        raise ValueError("prune needs at least one candidate")
    pairs = list(errors)
    for p in pairs:
        check_pair(p)
    front = pareto_front([(pair_bits(p), errors[p]) for p in pairs])
    return [pairs[i] for i in front]


__all__ = ["CANDIDATES", "KVTUNER_WIDTHS", "TUNABLE_WIDTHS", "candidate_pairs", "check_pair", "pair_bits", "pareto_front", "prune"]
