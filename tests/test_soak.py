"""The soak benchmark's loop, short (benchmarks/soak.py runs it for 10,000 steps): SmolLM2 decoding
held-out text one token at a time with the dynamic and the static kivi-4 cache; at every check
the stored bytes equal a cache built at once from the same keys and values, resident memory grows
by no more than the cache plus the stated constant, and top-1 agreement with fp stays high."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import soak  # noqa: E402

pytestmark = pytest.mark.slow  # SmolLM2


@pytest.fixture(scope="module")
def stream():
    ids = soak.token_stream(192, threads=2)
    return ids, soak.fp_top1(ids, threads=2)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_short_soak_keeps_bytes_memory_and_agreement(kind, stream):
    ids, fp = stream
    # kivi-4's 128-token window: from step 160 on, blocks of 32 leave it and are quantized
    row = soak.soak_kind(kind, "kivi-4", ids, fp, check_every=64, threads=2, log=lambda *a: None, warmup=64)
    assert [c["step"] for c in row["checks"]] == [64, 128, 192, 193]
    assert row["quantized_from_step"] == 128 + 32 - 1  # the 160th token pushes the first block out of the window
    assert row["all_bytes_equal"], [c["mismatched"] for c in row["checks"]]
    assert row["checks"][-1]["cache_mib"] > 0
    assert row["rss_always_within_bound"], [(c.get("rss_grown_mib"), c.get("cache_grown_mib")) for c in row["checks"]]
    assert row["recompiles_after_warmup"] == 0
    assert row["checks"][-1]["agreement_pct"] >= 90.0  # measured 97-99% over the first 512 steps


def test_the_byte_check_sees_a_changed_byte():
    """The comparison the soak relies on is not vacuous: one flipped code differs."""
    from common import smollm2
    from kvq_ao import KVQuantConfig, quantize_kv_

    model, _ = smollm2(2)
    cfg = KVQuantConfig.preset("kivi-4")
    quantize_kv_(model, cfg)
    g = torch.Generator().manual_seed(0)
    keys = [torch.randn(1, 3, 200, 64, generator=g) for _ in range(30)]
    a = soak.rebuild_at_once(model, cfg, None, keys, keys)
    b = soak.rebuild_at_once(model, cfg, None, keys, keys)
    assert soak.bytes_mismatch(a, b) == []
    b.layers[7].v_body.codes[0, 1, 5, 3] ^= 1
    assert soak.bytes_mismatch(a, b) == ["layer 7: v_codes"]
