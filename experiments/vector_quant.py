"""Would vector quantization reach issue 47's 2.5-bit target? A screening on development text.

At 2.5 bits per element every scalar layout tried so far loses too much (best on development text:
KVQuant's keys without outliers beside rotated values, +8.30%; rotated K2V2 with 8-bit metadata
+14.03%; the target on held-out text is +4.0%). A scalar code spends its 2 bits on each channel
alone; a vector code of d channels with 2**(2d) centroids spends the same bits on their joint
distribution (coupled quantization, Zhang et al. 2024; the gain of a lattice or trained codebook
over a scalar grid, larger where channels correlate).

What runs here, emulated (the kernels read no such format): keys (post-RoPE) and values rotated
by the randomized Hadamard matrix as the rot-* presets store them; each vector divided by its RMS,
the RMS kept as an 8-bit code on a 16-steps-an-octave log grid (one byte a vector, 0.125 bits an
element at head_dim 64); the normalized vector cut into sub-vectors of `d` channels, each replaced
by the nearest of 2**(bits * d) centroids per layer and kind, fitted by Fisher-weighted k-means on
the calibration samples (`kvq calibrate`'s 16 x 512 tokens, sink token left out), each
sub-vector weighted by its Fisher information times its RMS squared, so that the error counts in
the model's units (a vector's information spread evenly over its rotated channels: the gradients'
signs, which a rotation of the per-channel split needs, are not kept). The cache then stores the
reconstruction at 8 bits (uniform per vector, +0.02% on its own), so what attention reads is the
vector code's reconstruction up to that rounding. One float16 sink token and a float16 window as the
rotated presets keep them.

Candidates at one layout, a 48-token window (the largest multiple of 16 with which the 4-channel
code fits 2.5 bits at 4096 tokens, counting codes, the RMS byte, the float16 centroids of every
layer and kind, sink and window, as `kvq_ao.memory` counts the rest; rotated K2V2 with 8-bit
metadata takes the same window at 2.5 bits: +14.03% on development text, results/rotation/lean_metadata_dev.json):
* `vq d=4`: 2 bits an element as 4-channel codes of 8 bits (256 centroids);
* `vq d=2`: 2 bits as 2-channel codes of 4 bits (16 centroids);
* `scalar d=1`: the same path with 1-channel codes (4 levels), the control that isolates what
  coupling channels buys.

    python experiments/vector_quant.py [--windows 8] [--dims 4,2,1] [--window 48]
        -> results/rotation/vector_quant_dev.json
"""

import argparse
import dataclasses

import torch
from dev_text import dev_row, post_rope_study, print_dev_table, save_dev_rows

from kvq_ao import KVQuantConfig, LayerKV, QuantSpec
from kvq_ao.cache import QuantizedLayer, _BodyStore
from kvq_ao.memory import estimate
from kvq_ao.quant import rotation

STEPS_PER_OCTAVE = 16
FIT_POINTS = 120_000  # sub-vectors per layer and kind for k-means
OUT = "results/rotation/vector_quant_dev.json"


def rms_code(x: torch.Tensor) -> torch.Tensor:
    """Each vector's RMS over its last dim, rounded to the nearest step of the 8-bit log grid."""
    rms = x.square().mean(-1, keepdim=True).sqrt().clamp(min=1e-12)
    return torch.exp2(torch.round(torch.log2(rms) * STEPS_PER_OCTAVE) / STEPS_PER_OCTAVE)


def kmeans(points: torch.Tensor, weights: torch.Tensor, k: int, iters: int = 30, seed: int = 0) -> torch.Tensor:
    """Weighted Lloyd iterations from k-means++-style seeding on a subsample; [k, d] centroids."""
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(points.shape[0], (1,), generator=g)
    centroids = [points[first]]
    dist = (points - centroids[0]).square().sum(-1)
    for _ in range(1, k):  # k-means++: each next seed drawn by weighted distance
        p = (dist * weights).clamp(min=0)
        i = torch.multinomial(p / p.sum(), 1, generator=g)
        centroids.append(points[i])
        dist = torch.minimum(dist, (points - points[i]).square().sum(-1))
    c = torch.cat(centroids)
    for _ in range(iters):
        assign = torch.cdist(points, c).argmin(-1)
        total = torch.zeros_like(c).index_add_(0, assign, points * weights[:, None])
        mass = torch.zeros(k).index_add_(0, assign, weights)
        c = torch.where(mass[:, None] > 0, total / mass.clamp(min=1e-30)[:, None], c)
    return c


def fit_codebooks(acts, bits: int, d: int, head_dim: int) -> dict[tuple[int, str], torch.Tensor]:
    """Per (layer, kind): the [2**(bits*d), d] centroids of RMS-normalized rotated sub-vectors."""
    r = rotation.rotation_matrix(head_dim)
    books = {}
    g = torch.Generator().manual_seed(0)
    for kind in ("key", "value"):
        xs, fs = acts.of(kind)
        for layer, (x, f) in enumerate(zip(xs, fs)):
            x = x[:, :, 1:] @ r  # [S, H, T-1, D], sink token left out
            # A vector's Fisher information summed over its channels is what rotation keeps (the
            # per-channel split is lost with the gradients' signs): spread evenly over its channels.
            per_channel = f[:, :, 1:].sum(-1, keepdim=True) / head_dim
            s = rms_code(x)
            u = (x / s).reshape(-1, d)
            w = (per_channel * s.square()).expand_as(x).reshape(-1, d).sum(-1)
            pick = torch.randperm(u.shape[0], generator=g)[:FIT_POINTS]
            books[(layer, kind)] = kmeans(u[pick], w[pick] / w[pick].mean(), 2 ** (bits * d))
    return books


def quantize_vectors(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> its reconstruction: RMS byte times the nearest centroid of each sub-vector."""
    d = centroids.shape[1]
    s = rms_code(x.float())
    u = (x.float() / s).reshape(-1, d)
    nearest = torch.cdist(u, centroids).argmin(-1)
    return (centroids[nearest].reshape(x.shape) * s).to(x.dtype)


def install_transform(transform) -> None:
    """Route every body write through transform((layer, kind), x) before the plain encode (None:
    plain writes): how an emulated code replaces what the cache stores."""
    if not hasattr(_BodyStore, "_plain_encode"):
        _BodyStore._plain_encode = _BodyStore._encode
        QuantizedLayer._plain_init = QuantizedLayer.lazy_initialization

        def lazy_initialization(self, key_states, value_states):
            QuantizedLayer._plain_init(self, key_states, value_states)
            self.k_body._vq_key = (self.layer_idx, "key")
            self.v_body._vq_key = (self.layer_idx, "value")

        def encode(self, x):
            key = getattr(self, "_vq_key", None)
            return _BodyStore._plain_encode(self, x if _BodyStore._transform is None or key is None else _BodyStore._transform(key, x))

        QuantizedLayer.lazy_initialization = lazy_initialization
        _BodyStore._encode = encode
    _BodyStore._transform = transform


def install(books: dict | None) -> None:
    """Route every body write through the vector code of its (layer, kind) (None: plain writes)."""
    install_transform(None if books is None else lambda key, x: quantize_vectors(x, books[key]) if key in books else x)


def storage_config(window: int) -> KVQuantConfig:
    """What the cache holds for the emulation: rotated 8-bit per-vector codes of the reconstruction."""
    spec = QuantSpec(8, "token", 64, rotation="hadamard")
    return KVQuantConfig(default=LayerKV(spec, spec), sink_tokens=1, residual_length=window, side_dtype="float16",
                         name=f"vq-store w{window}")  # fmt: skip


def vq_bits(window: int, bits: int, d: int, layers: int = 30, heads: int = 3, head_dim: int = 64, tokens: int = 4096) -> float:
    """Bits per element at `tokens` of the emulated format: the 8-bit store's count, its codes
    replaced by `bits`-bit ones and its two float16 scale/zero by one RMS byte, plus float16 centroids."""
    store = storage_config(window)
    total = estimate(store, layers, heads, head_dim, tokens).bits_per_element
    body_tokens = tokens - 1 - window
    per_element = (8 - bits) + (32 - 8) / head_dim  # codes and metadata saved per body element
    centroid_bits = 2 * layers * (2 ** (bits * d)) * d * 16
    return total - per_element * body_tokens / tokens + centroid_bits / (2 * layers * heads * head_dim * tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dims", default="4,2,1")
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--window", type=int, default=48)
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    model, dev, acts, rows, done = post_rope_study(args)
    for d in [int(x) for x in args.dims.split(",")]:
        name = f"{'scalar' if d == 1 else 'vq'} d={d} K{args.bits}V{args.bits} w{args.window}"
        if name in done:
            continue
        install(fit_codebooks(acts, args.bits, d, head_dim=64))
        config = dataclasses.replace(storage_config(args.window), name=name)
        rows.append(dev_row(model, dev, config, dims=d, bits=args.bits,
                            bits_at_4096=round(vq_bits(args.window, args.bits, d), 4)))  # fmt: skip
        install(None)
        save_dev_rows(args.out, rows)
    print_dev_table(f"vector codes, development text ({args.windows} windows)", rows,
                    {"config": lambda r: r["config"], "bits @4096": lambda r: f"{r['bits_at_4096']:.2f}"}, {})  # fmt: skip


if __name__ == "__main__":
    main()
