"""Transform coding at 2.5 bits: a calibrated KLT with bits allocated per component, emulated on
development text.

Every layout tried at 2.5 bits spends the same bits on every channel, after a Hadamard rotation that
makes the channels' variances equal. Classic transform coding does better where a source's energy
is uneven across directions: rotate each vector into its covariance's eigenbasis (the KLT, from
calibration data), give the strong components more bits and the weak ones fewer or none (greedy
allocation: each next bit to the component whose error it cuts most, lambda_i * 4**-b_i), and code
each component with its own levels. For a Gaussian source at high rate this cuts the error against
equal bits on equal variances by the ratio of the eigenvalues' arithmetic to geometric mean (printed
per layer and kind). Keys after RoPE keep the structure a rotation of the query can undo at decode
time, as the rot-* presets' Hadamard does; values are rotated back after attention the same way.

What runs here, emulated (the kernels read no such format): per layer, kind and kv head, the
Fisher-weighted covariance of the calibration samples (`kvq calibrate`'s 16 x 512 tokens, sink left
out; post-RoPE keys and values as the cache's rotated presets receive them) and its eigenbasis U;
each vector y = U^T x divided by one gain, the RMS of y / sigma over components (kept as an 8-bit
log code, 0.125 bits an element), each component by its own sigma, and coded with its b_i bits by
levels from a Fisher-weighted 1-D k-means of that component on the calibration samples (b_i = 0:
the component is dropped). The cache then stores the reconstruction U y_hat at 8 bits (uniform per
vector, +0.02% on its own), beside a float16 sink token and a float16 window, as the other
emulations (experiments/vector_quant.py) did.

Bits at 4096 tokens: the 8-bit store's count with its codes replaced by the mean allocated bits and
its float16 scale and zero by the gain byte, plus the float16 levels and bases of every layer,
kind and head.

    python experiments/klt_codes.py [--windows 8] [--budgets 2/2,2.5/1.5] [--kinds key,value]
        [--metric vector|channel] [--levels kmeans|uniform] [--window 48]
        -> results/rotation/klt_codes_dev.json (docs/rotation.md, "Transform codes at 2.5 bits")
"""

import argparse
import dataclasses
import math

import torch
from dev_text import dev_row, post_rope_study, print_dev_table, save_dev_rows
from vector_quant import install_transform, rms_code, storage_config

from kvq_ao.memory import estimate
from kvq_ao.quant import rotation

OUT = "results/rotation/klt_codes_dev.json"
MAX_BITS = 6
FIT_POINTS = 60_000  # samples per component for its 1-D k-means


def allocate(eigenvalues: torch.Tensor, total_bits: int) -> list[int]:
    """Greedy integer allocation: each next bit to the component whose (Gaussian, high-rate) error
    lambda * 4**-b it cuts most; at most MAX_BITS a component."""
    bits = [0] * eigenvalues.numel()
    err = eigenvalues.double().clone()
    for _ in range(total_bits):
        gain = err * 0.75
        gain[torch.tensor(bits) >= MAX_BITS] = -1
        i = int(gain.argmax())
        bits[i] += 1
        err[i] /= 4
    return bits


def kmeans_1d(x: torch.Tensor, w: torch.Tensor, k: int, iters: int = 25) -> torch.Tensor:
    """Weighted Lloyd levels of 1-D samples, started at the weighted quantiles."""
    order = x.argsort()
    xs, cw = x[order], w[order].cumsum(0)
    at = ((torch.arange(k, dtype=torch.float64) + 0.5) / k * cw[-1]).to(cw.dtype)
    c = xs[torch.searchsorted(cw, at).clamp(max=xs.numel() - 1)].clone()
    for _ in range(iters):
        a = (x[:, None] - c[None]).abs().argmin(-1)
        mass = torch.zeros(k).index_add_(0, a, w)
        total = torch.zeros(k).index_add_(0, a, x * w)
        c = torch.where(mass > 0, total / mass.clamp(min=1e-30), c).sort().values
    return c


def level_set(x: torch.Tensor, w: torch.Tensor, bits: int, rule: str) -> torch.Tensor:
    """2**bits levels of one component: "kmeans" (Fisher-weighted Lloyd: the least weighted squared
    error, clipping the tails) or "uniform" (an even grid over the calibration samples' whole range:
    no value is clipped further than the range's ends)."""
    if rule == "kmeans":
        return kmeans_1d(x, w, 2**bits)
    return torch.linspace(float(x.min()), float(x.max()), 2**bits)


@dataclasses.dataclass
class HeadCode:
    basis: torch.Tensor  # [D, D] columns are eigenvectors, strongest first
    sigma: torch.Tensor  # [D] component standard deviations
    bits: list[int]
    levels: list[torch.Tensor | None]  # per component, in units of sigma * gain
    whiten: torch.Tensor | None = None  # [D, D]: M^(1/2) of the error metric M (None: Euclidean)
    unwhiten: torch.Tensor | None = None

    def reconstruct(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float() if self.whiten is None else x.float() @ self.whiten
        y = x @ self.basis / self.sigma  # [N, D] standardized components
        g = rms_code(y)
        u = y / g
        out = torch.zeros_like(u)
        for i, lv in enumerate(self.levels):
            if lv is not None:
                out[:, i] = lv[(u[:, i, None] - lv[None]).abs().argmin(-1)]
        z = (out * g * self.sigma) @ self.basis.T
        return (z if self.unwhiten is None else z @ self.unwhiten).to(x.dtype)


def channel_metric(f: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M^(1/2), M^(-1/2)) in the rotated basis of M = diag(mean Fisher information per channel):
    the error e^T M e is what the loss sees to second order (a channel's squared gradients), so
    whitening by M^(1/2) makes the transform code minimize it instead of the plain squared error."""
    m = f.reshape(-1, f.shape[-1]).double().mean(0)
    m = (m / m.mean()).clamp(min=1e-3)
    rd = r.double()
    return (rd.T @ torch.diag(m.sqrt()) @ rd).float(), (rd.T @ torch.diag(m.rsqrt()) @ rd).float()


def fit(acts, budgets: dict[str, float], head_dim: int, report: list, metric: str = "vector", levels_rule: str = "kmeans") -> dict:
    """Per (layer, kind): a HeadCode per kv head. metric "vector": squared error weighted by each
    vector's Fisher information; "channel": also by each channel's (channel_metric)."""
    r = rotation.rotation_matrix(head_dim)
    codes = {}
    g = torch.Generator().manual_seed(0)
    for kind in ("key", "value"):
        total = round(budgets[kind] * head_dim)
        xs, fs = acts.of(kind)
        for layer, (x, f) in enumerate(zip(xs, fs)):
            x = x[:, :, 1:].float() @ r  # [S, H, T-1, D] as the rotated store receives them, sink left out
            w_vec = f[:, :, 1:].float().sum(-1)  # a vector's Fisher information
            heads = []
            for h in range(x.shape[1]):
                v = x[:, h].reshape(-1, head_dim)
                whiten = unwhiten = None
                if metric == "channel":
                    whiten, unwhiten = channel_metric(f[:, h, 1:].float(), r)
                    v = v @ whiten
                w = w_vec[:, h].reshape(-1)
                w = w / w.mean()
                cov = (v * w[:, None]).T @ v / w.sum()
                lam, basis = torch.linalg.eigh(cov.double())
                lam, basis = lam.flip(0).clamp(min=1e-12).float(), basis.flip(1).float()
                bits = allocate(lam, total)
                sigma = lam.sqrt()
                y = v @ basis / sigma
                u = y / rms_code(y)
                pick = torch.randperm(u.shape[0], generator=g)[:FIT_POINTS]
                wg = (w * rms_code(y).squeeze(-1).square())[pick]
                levels = [level_set(u[pick, i], wg, b, levels_rule) if b else None for i, b in enumerate(bits)]
                heads.append(HeadCode(basis, sigma, bits, levels, whiten, unwhiten))
                am, gm = lam.mean().item(), math.exp(lam.log().mean().item())
                report.append(dict(layer=layer, kind=kind, head=h, am_over_gm=round(am / gm, 3),
                                   kept=sum(b > 0 for b in bits), top_bits=bits[0]))  # fmt: skip
            codes[(layer, kind)] = heads
    return codes


@dataclasses.dataclass
class ScaledRotation:
    """The control beside the KLT: the rotated presets' code (each vector rotated by the Hadamard
    matrix, uniform levels between its min and max) after each channel is scaled by the square root
    of its mean Fisher information (geometric mean 1), undone after decoding. A diagonal scale folds
    into the query's transform (q / s) or the output's, so a kernel would read it at no cost."""
    scale: torch.Tensor  # [D] per channel (unrotated)
    r: torch.Tensor
    bits: int

    def reconstruct(self, x: torch.Tensor) -> torch.Tensor:
        y = (x.float() @ self.r.T * self.scale) @ self.r
        lo, hi = y.amin(-1, keepdim=True), y.amax(-1, keepdim=True)
        step = ((hi - lo) / (2**self.bits - 1)).clamp(min=1e-12)
        y = torch.round((y - lo) / step) * step + lo
        return ((y @ self.r.T / self.scale) @ self.r).to(x.dtype)


def fit_scaled(acts, budgets: dict[str, float], head_dim: int, scaled: bool = True) -> dict:
    """Per (layer, kind): a ScaledRotation per kv head (scaled False: the plain rotated code)."""
    r = rotation.rotation_matrix(head_dim)
    codes = {}
    for kind in ("key", "value"):
        _, fs = acts.of(kind)
        for layer, f in enumerate(fs):
            heads = []
            for h in range(f.shape[1]):
                m = f[:, h, 1:].reshape(-1, head_dim).double().mean(0).clamp(min=1e-30).sqrt()
                m = m / m.log().mean().exp() if scaled else torch.ones_like(m)
                heads.append(ScaledRotation(m.float(), r, int(budgets[kind])))
            codes[(layer, kind)] = heads
    return codes


def transform_of(codes: dict):
    def transform(key, x):
        heads = codes.get(key)
        if heads is None:
            return x
        out = torch.empty_like(x)
        for h, code in enumerate(heads):
            part = x[:, h]
            out[:, h] = code.reconstruct(part.reshape(-1, part.shape[-1])).reshape(part.shape)
        return out

    return transform


def klt_bits(window: int, budget: float, codes: dict, layers: int = 30, heads: int = 3, head_dim: int = 64, tokens: int = 4096) -> float:
    """Bits per element at `tokens`: the 8-bit store's count, its codes replaced by `budget` bits on
    average and its float16 scale and zero by one gain byte, plus every head's float16 basis, sigmas
    and levels (a fixed cost: 0.25 bits an element at 4096 tokens for SmolLM2's bases alone)."""
    total = estimate(storage_config(window), layers, heads, head_dim, tokens).bits_per_element
    body_tokens = tokens - 1 - window
    saved = (8 - budget) + (32 - 8) / head_dim  # budget: the mean of the kinds' code bits
    side = sum(16 * (head_dim * head_dim + head_dim + sum(2**b for b in c.bits if b)) for hs in codes.values() for c in hs)
    return total - saved * body_tokens / tokens + side / (2 * layers * heads * head_dim * tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budgets", default="2.0", help="code bits an element, one number for both kinds or K/V pairs: 3/1,2.5/1.5")
    ap.add_argument("--window", type=int, default=48)
    ap.add_argument("--kinds", default="key,value", help="which kinds are coded (the others stay at the store's 8 bits)")
    ap.add_argument("--metric", default="vector", choices=["vector", "channel"], help="fit's error metric")
    ap.add_argument("--code", default="klt", choices=["klt", "scaled-rotation", "rotation"],
                    help="klt; or the rotated presets' per-vector code with (scaled-rotation) or without (rotation) the Fisher scale")
    ap.add_argument("--levels", default="kmeans", choices=["kmeans", "uniform"], help="each component's levels (level_set)")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    model, dev, acts, rows, done = post_rope_study(args)
    for pair in args.budgets.split(","):
        k_bits, v_bits = (float(x) for x in (pair.split("/") if "/" in pair else (pair, pair)))
        budget = (k_bits + v_bits) / 2
        kinds = args.kinds.split(",")
        name = f"klt K{k_bits:g}/V{v_bits:g} bits w{args.window}" + ("" if len(kinds) == 2 else f" {kinds[0]}s only") + (" channel-Fisher" if args.metric == "channel" else "") + (" uniform" if args.levels == "uniform" else "")
        if args.code != "klt":
            name = f"{args.code} K{k_bits:g}/V{v_bits:g} w{args.window}" + ("" if len(kinds) == 2 else f" {kinds[0]}s only")
        if name in done:
            continue
        report: list = []
        if args.code == "klt":
            codes = fit(acts, {"key": k_bits, "value": v_bits}, 64, report, args.metric, args.levels)
        else:
            codes = fit_scaled(acts, {"key": k_bits, "value": v_bits}, 64, scaled=args.code == "scaled-rotation")
        if report:
            ratio = [r["am_over_gm"] for r in report]
            print(f"{name}: AM/GM of eigenvalues median {sorted(ratio)[len(ratio) // 2]:.2f}, max {max(ratio):.2f}", flush=True)
        install_transform(transform_of({k: c for k, c in codes.items() if k[1] in kinds}))
        config = dataclasses.replace(storage_config(args.window), name=name)
        rows.append(dev_row(model, dev, config, budget=budget, fp_window=args.window, kinds=kinds, metric=args.metric, levels=args.levels,
                            bits_at_4096=round(klt_bits(args.window, budget, codes), 4) if len(kinds) == 2 and args.code == "klt" else None, code=args.code, allocation=report))  # fmt: skip
        install_transform(None)
        save_dev_rows(args.out, rows)
    print_dev_table(f"KLT transform codes, development text ({args.windows} windows)", rows,
                    {"config": lambda r: r["config"], "bits @4096": lambda r: "-" if r["bits_at_4096"] is None else f"{r['bits_at_4096']:.2f}"}, {})  # fmt: skip


if __name__ == "__main__":
    main()
