"""The context-parallel cache (kvq_ao.parallel): one process and 2/4 gloo processes against the
single-process cache on a tiny model, prefill in chunks then greedy decode, for each preset family;
mismatched configs refused on every rank; a rank that dies makes the others fail clearly."""

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from kvq_ao import KVQuantConfig, make_cache, quantize_kv_
from kvq_ao.parallel import ContextParallelCache, ShardPlan, make_context_parallel_cache

from conftest import kvquant_config, tiny_llama

PROMPT, CHUNK, STEPS, SEGMENT = 330, 96, 12, 64  # body past several segments; chunks straddle them


def run(model, cache, ids: torch.Tensor, die_at: int | None = None) -> tuple[torch.Tensor, list[int]]:
    """Chunked prefill then greedy decode: (logits of the last prefill position and every step, tokens)."""
    logits = []
    with torch.no_grad():
        for s in range(0, ids.shape[1], CHUNK):
            out = model(ids[:, s : s + CHUNK], cache=cache).logits
        logits.append(out[:, -1])
        tokens = []
        for step in range(STEPS):
            if step == die_at:
                os._exit(3)  # a rank dies mid-generation, without a word to the others
            token = logits[-1].argmax(-1, keepdim=True)
            tokens.append(int(token))
            logits.append(model(token, cache=cache).logits[:, -1])
    return torch.stack(logits), tokens


def generate(model, cache) -> list[int]:
    ids = prompt()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=6, do_sample=False,
                         prefill_chunk_size=CHUNK, pad_token_id=0)  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


def prompt() -> torch.Tensor:
    return torch.randint(3, 128, (1, PROMPT), generator=torch.Generator().manual_seed(7))


def configs(folder: Path) -> dict[str, str]:
    """One config file per preset family (the tiny model's own calibrations for kvquant)."""
    model = tiny_llama()
    kvq = kvquant_config(3, 0.02, key_group=32, key_slots=1, key_ranges="calibrated", model=model, folder=folder)
    kvq_online = kvquant_config(2, 0.01, key_group=32, model=model, folder=folder)
    kivi, int4 = KVQuantConfig.preset("kivi-2"), KVQuantConfig.preset("int4-token")
    mixed = kivi.with_layers([KVQuantConfig.preset("kivi-4").default, int4.default], name="mixed")  # as kvq tune writes
    chosen = {"kivi-2": kivi, "int4-token": int4, "fp": KVQuantConfig.preset("fp"), "mixed-per-layer": mixed,
              "kvquant-3-calibrated": kvq, "kvquant-2-online": kvq_online}  # fmt: skip
    paths = {}
    for name, cfg in chosen.items():
        cfg = dataclasses.replace(cfg, residual_length=min(cfg.residual_length, 40))
        paths[name] = str(folder / f"{name}.json")
        cfg.save(paths[name])
    return paths


def single_process(path: str) -> tuple[torch.Tensor, list[int]]:
    model = tiny_llama()
    quantize_kv_(model, KVQuantConfig.load(path))
    return run(model, make_cache(model), prompt())


def _worker(rank: int, world: int, init: str, out: str, paths: dict, mode: str) -> None:
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))  # fmt: skip
    result = {}
    try:
        for name, path in paths.items():
            model = tiny_llama()
            config = KVQuantConfig.load(path)
            if mode == "mismatch" and rank == world - 1:
                config = dataclasses.replace(config, residual_length=config.residual_length + 32)
            quantize_kv_(model, config)
            try:
                cache = make_context_parallel_cache(model, segment=SEGMENT)
            except ValueError as e:
                result[name] = {"error": str(e)}
                continue
            started = time.monotonic()
            try:
                logits, tokens = run(model, cache, prompt(), die_at=5 if mode == "die" and rank == 1 else None)
            except Exception as e:  # noqa: BLE001  (reported to the test, which checks its type and text)
                result[name] = {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - started}
                continue
            torch.save(logits, f"{out}/{name}-{rank}.pt")
            result[name] = {"tokens": tokens, "bytes": cache.tensor_bytes()}
            if name == "kivi-2":  # generate() through the context-parallel cache, as users call it
                result["generate"] = generate(model, make_context_parallel_cache(model, segment=SEGMENT))
    finally:
        Path(f"{out}/rank{rank}.json").write_text(json.dumps(result))
    if mode != "die":
        dist.destroy_process_group()


def spawn(world: int, tmp_path: Path, paths: dict, mode: str = "normal") -> tuple[list[dict | None], Path]:
    """Run `world` gloo workers; each rank's report (None for a rank that died without one)."""
    out = tmp_path / f"w{world}-{mode}"
    out.mkdir()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, world, str(tmp_path / f"init-{world}-{mode}"), str(out), paths, mode))
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    deadline = time.monotonic() + 300
    for p in procs:
        p.join(timeout=max(deadline - time.monotonic(), 1))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    assert not hung, "context-parallel workers hung"
    reports = [out / f"rank{r}.json" for r in range(world)]
    return [json.loads(f.read_text()) if f.exists() else None for f in reports], out


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cp")
    paths = configs(folder)
    return folder, paths, {name: single_process(path) for name, path in paths.items()}


def test_shard_plan_deals_segments_round_robin():
    plans = [ShardPlan(r, 3, 16) for r in range(3)]
    assert [p.owns(40) for p in plans] == [False, False, True]  # segment 2
    assert plans[2].local(40) == 8 and plans[0].local(50) == 16 + 2  # segment 3 is rank 0's second
    assert [p.local_capacity(100) for p in plans] == [48, 32, 32]  # 7 segments: 3 / 2 / 2
    assert plans[1].segments(20, 100) == [(16, 0), (64, 16)]
    with pytest.raises(ValueError, match="rank 3 is not in a world of 3"):
        ShardPlan(3, 3, 16)


def test_segment_must_hold_whole_quantization_blocks(tiny_model):
    quantize_kv_(tiny_model, KVQuantConfig.preset("kivi-2"))  # key groups of 32 tokens
    with pytest.raises(ValueError, match="multiple of the layer's 32-token quantization block"):
        make_context_parallel_cache(tiny_model, segment=48)


def test_one_process_equals_the_ordinary_cache(cases):
    """World size 1 (no process group): every segment on this rank, side store and merge exercised."""
    _, paths, single = cases
    for name, path in paths.items():
        model = tiny_llama()
        quantize_kv_(model, KVQuantConfig.load(path))
        cache = make_context_parallel_cache(model, segment=SEGMENT)
        assert isinstance(cache, ContextParallelCache) and cache.plan.world == 1
        logits, tokens = run(model, cache, prompt())
        want, want_tokens = single[name]
        assert tokens == want_tokens, name
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()), msg=name)


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_ranks_equal_one_process(world, cases, tmp_path):
    _, paths, single = cases
    results, out = spawn(world, tmp_path, paths)
    for name in paths:
        want, want_tokens = single[name]
        per_rank_bytes = [r[name]["bytes"] for r in results]
        for rank in range(world):
            assert results[rank][name]["tokens"] == want_tokens, (name, rank)
            logits = torch.load(out / f"{name}-{rank}.pt")
            torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()), msg=f"{name} rank {rank}")
        if name == "kivi-2":
            model = tiny_llama()
            quantize_kv_(model, KVQuantConfig.load(paths[name]))
            assert all(r["generate"] == generate(model, make_cache(model)) for r in results)
        # the body is split: rank 0 does not hold it all (ranks hold about 1/world each)
        assert max(per_rank_bytes) < 0.8 * sum(per_rank_bytes), (name, per_rank_bytes)


def test_mismatched_configs_are_refused_on_every_rank(cases, tmp_path):
    _, paths, _ = cases
    results, _ = spawn(2, tmp_path, {"kivi-2": paths["kivi-2"]}, mode="mismatch")
    for rank in range(2):
        assert "context-parallel ranks disagree: rank(s) [1]" in results[rank]["kivi-2"]["error"]


def test_a_rank_that_dies_makes_the_others_fail_clearly(cases, tmp_path):
    _, paths, _ = cases
    results, _ = spawn(2, tmp_path, {"kivi-2": paths["kivi-2"]}, mode="die")
    survivor = results[0]["kivi-2"]
    assert survivor["error"].startswith("ContextParallelError: rank 0: merging attention across 2 context-parallel ranks failed")
    assert survivor["seconds"] < 60  # the group's timeout is 30 s; a closed connection is noticed sooner
