"""Quality of a quantized cache, measured through the same cache code path generation uses.

Perplexity: the text is cut into windows; each window starts a fresh `QuantizedKVCache` and is
fed in chunks through `torch.ops.kvq.chunk_attention`, each query reading the cache as decoding at
its position would (older tokens from the quantized codes, the recent window in full precision),
so the figure does not depend on the chunk size. The fp reference runs each window in one pass
without any cache.

Reported: perplexity (quantized and fp), mean KL(fp || quantized) of the next-token
distribution, top-1 agreement with fp, and the cache's memory as held at the end of a window.
With two or more windows, also a 95% interval of the PPL ratio over the text: windows are
independent stretches of text, so the spread of their paired (quantized - fp) mean NLLs says how
much the ratio depends on which text was drawn (a difference smaller than that is not a finding).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from kvq_ao.api import make_cache, quantize_kv_
from kvq_ao.config import KVQuantConfig
from kvq_ao.memory import estimate
from kvq_ao.model_info import model_dims


@dataclass
class EvalResult:
    config: str
    ppl: float
    ppl_fp: float
    ppl_ratio: float
    kl: float
    token_agreement: float
    tokens: int
    avg_bits: float
    kv_bytes_per_token: float
    avg_bits_at_4096: float
    window: int
    chunk: int
    ppl_ratio_ci95: list[float] | None = None  # [low, high] over windows (None for one window)
    # Fractions of all cached key / value entries that were outliers but found their vector's
    # outlier slots full, so were clamped into the dense range instead of kept exact.
    clamped_key_outliers: float = 0.0
    clamped_value_outliers: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def ratio_interval(window_deltas: list[float], level: float = 0.95) -> list[float] | None:
    """Student-t interval of the PPL ratio from per-window mean NLL differences (quantized - fp).

    Windows have equal token counts, so the ratio is exp(mean difference); the interval is
    exp(mean +- t * standard error). None with fewer than two windows.
    """
    n = len(window_deltas)
    if n < 2:
        return None
    from scipy.stats import t  # scipy comes with scikit-learn, a dependency

    d = torch.tensor(window_deltas, dtype=torch.float64)
    half = float(t.ppf(0.5 + level / 2, n - 1)) * float(d.std(unbiased=True)) / math.sqrt(n)
    mean = float(d.mean())
    return [math.exp(mean - half), math.exp(mean + half)]


@dataclass
class _Tally:
    """One config's running sums over windows."""

    nll: float = 0.0
    nll_fp: float = 0.0
    kl: float = 0.0
    agree: float = 0.0
    counted: int = 0
    clamped_k: int = 0
    clamped_v: int = 0
    report: object = None
    deltas: list = None  # per window: mean NLL (quantized) - mean NLL (fp)


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, config: KVQuantConfig, chunk: int = 64, progress: bool = True) -> EvalResult:
    """Evaluate `config` on token windows [n, W] (see `kvq_ao.models.text_windows`)."""
    return evaluate_many(model, windows, [config], chunk, progress)[0]


@torch.no_grad()
def evaluate_many(model, windows: torch.Tensor, configs: list[KVQuantConfig], chunk: int = 64,
                  progress: bool = True) -> list[EvalResult]:  # fmt: skip
    """`evaluate` for several configs on the same windows, one result each: the fp reference of a
    window (a full forward pass) runs once for all configs instead of once per config."""
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    n, w = windows.shape
    tallies = [_Tally(deltas=[]) for _ in configs]
    bar = tqdm(total=n * math.ceil(w / chunk) * len(configs), desc="eval", disable=not progress, leave=False)
    for row in windows:
        ids = row.unsqueeze(0)
        target = row[1:]
        logp_fp = fp_logits = None
        for config, tally in zip(configs, tallies):
            quantize_kv_(model, config)
            if fp_logits is None:  # no cache: the model's own attention over the whole window
                fp_logits = model(ids).logits[0, :-1].float()
                logp_fp = F.log_softmax(fp_logits, -1)
                window_nll_fp = F.nll_loss(logp_fp, target, reduction="sum").item()
            bar.set_description(f"eval {config.name}")
            cache = make_cache(model, config)
            parts = []
            for start in range(0, w, chunk):
                parts.append(model(ids[:, start : start + chunk], cache=cache).logits[0].float())
                bar.update()
            q_logits = torch.cat(parts)[:-1]
            logp_q = F.log_softmax(q_logits, -1)
            window_nll = F.nll_loss(logp_q, target, reduction="sum").item()
            tally.deltas.append((window_nll - window_nll_fp) / target.numel())
            tally.nll += window_nll
            tally.nll_fp += window_nll_fp
            tally.kl += F.kl_div(logp_q, logp_fp, log_target=True, reduction="sum").item()
            tally.agree += (q_logits.argmax(-1) == fp_logits.argmax(-1)).sum().item()
            tally.counted += target.numel()
            tally.report = cache.memory_report()
            window_k, window_v = cache.clamped_by_kind
            tally.clamped_k += window_k
            tally.clamped_v += window_v
    bar.close()
    layers, heads, head_dim = model_dims(model)
    entries = n * w * layers * heads * head_dim  # per kind
    return [
        EvalResult(
            config=config.name,
            ppl=math.exp(t.nll / t.counted),
            ppl_fp=math.exp(t.nll_fp / t.counted),
            ppl_ratio=math.exp((t.nll - t.nll_fp) / t.counted),
            kl=t.kl / t.counted,
            token_agreement=t.agree / t.counted,
            tokens=t.counted,
            avg_bits=t.report.bits_per_element,
            kv_bytes_per_token=t.report.bytes_per_token,
            avg_bits_at_4096=estimate(config, layers, heads, head_dim, 4096).bits_per_element,
            window=w,
            chunk=chunk,
            ppl_ratio_ci95=ratio_interval(t.deltas),
            clamped_key_outliers=t.clamped_k / entries,
            clamped_value_outliers=t.clamped_v / entries,
        )
        for config, t in zip(configs, tallies)
    ]


@torch.no_grad()
def chat_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of `prompt` as one user turn of the tokenizer's chat template, ready to answer."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def greedy(model, tokenizer, prompt: str, max_new_tokens: int, cache=None, chat: bool = True) -> torch.Tensor:
    """Greedy continuation ids of `prompt` (chat template applied when the tokenizer has one)."""
    if chat and tokenizer.chat_template:
        ids = torch.tensor([chat_ids(tokenizer, prompt)])
    else:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    kwargs = {"cache": cache} if cache is not None else {}
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        min_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **kwargs,
    )  # fmt: skip
    return out[0, ids.shape[1] :]


@torch.no_grad()
def generation_agreement(model, tokenizer, prompts: list[str], config: KVQuantConfig, max_new_tokens: int = 32,
                         progress: bool = True) -> dict:  # fmt: skip
    """Greedy generation with the fp cache vs `config`: positional token agreement per prompt.

    Generation runs exactly `max_new_tokens` (EOS does not stop it) so every prompt contributes
    the same number of compared tokens.
    """
    from transformers import DynamicCache

    quantize_kv_(model, config)
    rows = []
    for prompt in tqdm(prompts, desc=f"generate {config.name}", disable=not progress, leave=False):
        fp = greedy(model, tokenizer, prompt, max_new_tokens, cache=DynamicCache(config=model.config))
        q = greedy(model, tokenizer, prompt, max_new_tokens)
        same = (fp == q).tolist()
        first_diff = same.index(False) if False in same else len(same)
        rows.append({"prompt": prompt, "agree": sum(same), "first_divergence": first_diff, "fp_ids": fp.tolist(),
                     "fp": tokenizer.decode(fp), "quantized": tokenizer.decode(q)})  # fmt: skip
    total = sum(r["agree"] for r in rows)
    return {"config": config.name, "agree": total, "compared": len(prompts) * max_new_tokens,
            "agreement": total / (len(prompts) * max_new_tokens), "prompts": rows}  # fmt: skip


CHAT_PROMPTS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "Give three tips for learning a new programming language.",
    "What is the difference between a list and a tuple in Python?",
]


def print_results(results: list[EvalResult]) -> None:
    """One rich table of quality and memory, a row per result."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="KV cache quality (through the quantized cache) and memory")
    for col in ("config", "PPL", "PPL fp", "ΔPPL %", "KL", "top-1 agree", "bits/elem", "bits@4096", "KV B/token",
                "clamped K/V %", "tokens"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(r.config, f"{r.ppl:.3f}", f"{r.ppl_fp:.3f}", f"{100 * (r.ppl_ratio - 1):+.2f}", f"{max(r.kl, 0.0):.4f}",
                      f"{r.token_agreement:.3f}", f"{r.avg_bits:.2f}", f"{r.avg_bits_at_4096:.2f}",
                      f"{r.kv_bytes_per_token:.0f}", f"{100 * r.clamped_key_outliers:.2f}/{100 * r.clamped_value_outliers:.2f}",
                      str(r.tokens))  # fmt: skip
    Console(width=max(Console().width, 140)).print(table)


__all__ = ["EvalResult", "chat_ids", "evaluate", "evaluate_many", "generation_agreement", "greedy", "print_results", "ratio_interval", "CHAT_PROMPTS"]
