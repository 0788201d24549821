"""The disk tier with tensor parallelism (CPU, gloo): each rank keeps its own heads' blocks, a restart
finds them on every rank, and a block that only one rank cannot read is a miss on both, so the
ranks' schedules stay the same and the outputs equal those of one rank without any tier."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from labkit.engine import Engine

# On CPU (gloo) even where a GPU is present.
COMMON = {
    "model_path": "tiny-llama",
    "load_format": "dummy",
    "random_seed": 3,
    "max_total_tokens": 384,
    "device": "cpu",
}
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def _prompts(vocab: int) -> list[list[int]]:
    """Five long system prompts, each with its own question: the device pool holds about two."""
    rng = random.Random(0)
    systems = [[rng.randrange(vocab) for _ in range(160)] for _ in range(5)]
    return [s + [rng.randrange(vocab) for _ in range(8)] for s in systems]


def _visit(engine: Engine, prompts: list[list[int]], rounds: int) -> list[tuple[list[int], int]]:
    out = []
    for _ in range(rounds):
        for p in prompts:
            res = engine.generate(input_ids=p, sampling_params=GREEDY)
            out.append((res["output_ids"], res["meta_info"]["cached_tokens"]))
    return out


@pytest.mark.slow
def test_tp2_disk_tier_restarts_and_a_block_one_rank_cannot_read_is_a_miss_on_both(tmp_path: Path):
    ref_engine = Engine(**COMMON)
    prompts = _prompts(ref_engine.model_runner.vocab_size)
    ref = [ids for ids, _ in _visit(ref_engine, prompts, rounds=2)]
    # A host tier of about 40 tokens per rank (half the heads): evicted prompts go on to disk only.
    host_gib = 40 * ref_engine.model_runner.token_to_kv_pool.bytes_per_token() / 2 / 2**30
    tiers = {
        "enable_hierarchical_cache": True,
        "hicache_size": host_gib,
        "hicache_storage_dir": str(tmp_path),
        "hicache_storage_block": 32,
    }

    with Engine(**COMMON, **tiers, tp_size=2) as first:
        assert [ids for ids, _ in _visit(first, prompts, rounds=2)] == ref
        assert first.tree_cache.stats.written_to_disk
    namespaces = sorted(d for d in tmp_path.iterdir() if d.is_dir())
    assert len(namespaces) == 2  # one per rank, each with its own heads' blocks
    assert all(any(d.rglob("*.pt")) for d in namespaces)

    with Engine(**COMMON, **tiers, tp_size=2) as restarted:
        got = _visit(restarted, prompts, rounds=1)
        assert [ids for ids, _ in got] == ref[: len(prompts)]
        assert all(cached >= 128 for _, cached in got)  # every prompt's blocks came back from disk
        assert restarted.tree_cache.stats.read_from_disk
        rank0_dir = restarted.tree_cache.storage.dir

    # Rank 1's blocks unreadable, rank 0's intact: rank 0 must not use its own either.
    [rank1_dir] = [d for d in namespaces if d != rank0_dir]
    for block in rank1_dir.rglob("*.pt"):
        block.write_bytes(block.read_bytes()[:100])
    with Engine(**COMMON, **tiers, tp_size=2) as corrupt:
        got = _visit(corrupt, prompts, rounds=1)
        assert [ids for ids, _ in got] == ref[: len(prompts)]
        assert corrupt.tree_cache.stats.read_from_disk == 0
        assert corrupt.tree_cache.storage.stats.read_hits  # rank 0 could read its own, and did not use them
