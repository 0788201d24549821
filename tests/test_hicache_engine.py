"""The hierarchical cache in the Engine (embedded model, CPU, greedy): outputs equal those without it,
across evictions to host and disk and loads back, and across a restart that finds the disk tier. On a
GPU a recomputed prefix rounds differently from a cached one, so there (and on CPU too) the last test
compares against a pool that never evicts: the same hits, bit-equal outputs."""

from __future__ import annotations

import pytest

from labkit import Engine
from labkit.viz.waiting import waiting_table

TOPICS = ["cooking", "astronomy", "gardening", "chess", "music"]
GREEDY = {"temperature": 0, "max_new_tokens": 6}


def conversations(engine: Engine, rounds: int = 2) -> list[tuple[str, int]]:
    """Each topic's long system prompt, visited round after round: the pool cannot keep them all."""
    out = []
    for r in range(rounds):
        for topic in TOPICS:
            res = engine.generate(
                f"You are an expert on {topic}. " * 24 + f"One fact, round {r}.", sampling_params=GREEDY
            )
            out.append((res["text"], res["meta_info"]["cached_tokens"]))
    return out


def assert_idle(engine: Engine) -> None:
    """Nothing held: every device slot is free or in the tree, every host slot free or in the tree."""
    usage = engine.pool_usage()
    assert usage.request_owned == 0 and usage.protected == 0
    assert usage.free + usage.evictable == usage.total
    host = engine.tree_cache.tier_usage()
    if host is not None:
        assert host.free + host.host_only + host.backed_up == host.total


@pytest.fixture(scope="module")
def without_tiers() -> dict[int, list[tuple[str, int]]]:
    return {page: conversations(Engine(max_total_tokens=512, page_size=page, device="cpu")) for page in (1, 16)}


@pytest.mark.slow
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_host_tier_gives_the_same_outputs_and_more_cache_hits(page, policy, without_tiers):
    engine = Engine(
        max_total_tokens=512, page_size=page, enable_hierarchical_cache=True, hicache_write_policy=policy, device="cpu"
    )
    got = conversations(engine)
    base = without_tiers[page]
    assert [t for t, _ in got] == [t for t, _ in base]
    second_round = slice(len(TOPICS), None)
    # Without the host tier the second round finds only the shared first tokens; with it, the system prompts.
    assert sum(c for _, c in got[second_round]) > 4 * sum(c for _, c in base[second_round])
    stats = engine.tree_cache.stats
    assert stats.written_to_host and stats.loaded_back
    assert_idle(engine)


@pytest.mark.slow
@pytest.mark.parametrize("page", [1, 16])
def test_disk_tier_survives_a_restart_and_a_corrupt_block_is_a_miss(page, tmp_path, without_tiers):
    options = dict(
        max_total_tokens=512,
        page_size=page,
        device="cpu",
        enable_hierarchical_cache=True,
        hicache_size=0.005,  # about 100 tokens: most evicted prefixes go on to disk only
        hicache_storage_dir=str(tmp_path),
        hicache_storage_block=32,
    )
    first = Engine(**options)
    assert [t for t, _ in conversations(first)] == [t for t, _ in without_tiers[page]]
    assert first.tree_cache.stats.written_to_disk

    restarted = Engine(**options)  # empty device and host tiers, same directory
    got = conversations(restarted, rounds=1)
    assert [t for t, _ in got] == [t for t, _ in without_tiers[page][: len(TOPICS)]]
    assert all(cached >= 128 for _, cached in got)  # each system prompt came back from disk
    assert restarted.tree_cache.stats.read_from_disk
    assert_idle(restarted)

    for block in tmp_path.rglob("*.pt"):
        block.write_bytes(block.read_bytes()[:100])  # truncated: every read fails
    corrupt = Engine(**options)
    got = conversations(corrupt, rounds=1)
    assert [t for t, _ in got] == [t for t, _ in without_tiers[page][: len(TOPICS)]]
    assert corrupt.tree_cache.stats.read_from_disk == 0
    assert_idle(corrupt)


@pytest.mark.slow
def test_traced_run_shows_the_host_tier():
    engine = Engine(max_total_tokens=512, enable_hierarchical_cache=True, enable_trace=True)
    conversations(engine)
    steps = engine.tracer.steps
    assert all(s.host_pool is not None for s in steps)
    assert max(s.host_pool.host_only for s in steps) > 0
    kinds = {e.kind for e in engine.tracer.tree_events}
    assert {"write_host", "offload", "load_back"} <= kinds
    tiers = {n.tier for snap in engine.tracer.snapshots if snap.tree for n in snap.tree.nodes}
    assert "host" in tiers


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"hicache_size": 1e6}, "hicache-size"),
        ({"hicache_write_policy": "sometimes"}, "write_policy"),
        ({"disable_radix_cache": True}, "radix cache"),
        ({"hicache_storage_dir": "/proc/labkit-kv"}, "not writable"),
        ({"hicache_storage_dir": "TMP", "hicache_storage_block": 12, "page_size": 16}, "multiple of page_size"),
    ],
)
def test_bad_tier_options_are_clear_errors_at_start(options, message, tmp_path):
    if options.get("hicache_storage_dir") == "TMP":
        options = options | {"hicache_storage_dir": str(tmp_path)}
    with pytest.raises(ValueError, match=message):
        Engine(max_total_tokens=512, enable_hierarchical_cache=True, **options)


def id_conversations(engine: Engine, rounds: int = 2) -> list[tuple[list[tuple[float, int]], int]]:
    """Token-id prompts (vocabularies of 256 and up): five 192-token system prompts, visited round after round."""
    out = []
    for r in range(rounds):
        for c in range(5):
            ids = [3 + (37 * c + 11 * i) % 200 for i in range(192)] + [210 + r, 220 + c]
            res = engine.generate(input_ids=ids, sampling_params=GREEDY | {"ignore_eos": True, "return_logprob": True})
            meta = res["meta_info"]
            out.append((meta["output_token_logprobs"], meta["cached_tokens"]))
    return out


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_loaded_back_kv_is_the_kv_that_was_evicted(device, kv_cache_dtype):
    """A small pool with the host tier against a pool that never evicts: the same prefix hits, so the
    same kernels over the same KV, hence bit-equal tokens and logprobs (on a GPU too, where recomputing
    a prefix instead would round differently)."""
    options = dict(model_path="tiny-qwen3", load_format="dummy", device=device, kv_cache_dtype=kv_cache_dtype)
    roomy = id_conversations(Engine(max_total_tokens=8192, **options))
    tiered = Engine(max_total_tokens=512, enable_hierarchical_cache=True, **options)
    assert id_conversations(tiered) == roomy
    assert tiered.tree_cache.stats.loaded_back >= 4 * 192
    assert_idle(tiered)


@pytest.mark.slow
def test_a_waiting_request_loads_nothing_back_until_it_is_admitted():
    engine = Engine(max_total_tokens=512, enable_hierarchical_cache=True, device="cpu", enable_trace=True)
    conversations(engine, rounds=1)  # five system prompts through a 512-token pool: the first ones on the host
    engine.add_request(
        input_ids=list(range(1000, 1300)), sampling_params={"temperature": 0, "max_new_tokens": 120, "ignore_eos": True}
    )
    engine.step()  # the hog is admitted and holds most of the pool
    again = engine.add_request(
        f"You are an expert on {TOPICS[0]}. " * 24 + "One fact, round 1.", sampling_params=GREEDY
    )
    loaded, waited = engine.tree_cache.stats.loaded_back, 0
    while again in (step := engine.step()).blocked:
        waited += 1
        assert engine.tree_cache.stats.loaded_back == loaded  # blocked: nothing copied for it
        # Why it waits, per tier: the part of its prompt the host holds for it.
        row = waiting_table(engine, step.step).set_index("rid").loc[again]
        assert "in the host or disk tier" in row["prefix_match"], row["prefix_match"]
    assert waited > 0  # it did wait for memory
    while engine.scheduler.has_work():
        engine.step()
    assert engine.tree_cache.stats.loaded_back > loaded  # admitted: its system prompt came back from the host
    assert_idle(engine)
