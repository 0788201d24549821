"""The disk tier's storage (labkit.mem_cache.storage): prefix-chained block keys, HiCacheFile's
guarantee that get() returns exactly what set() stored or None, across restarts and bad files, and
its size cap: least recently used blocks evicted, the order kept across restarts."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from typing import Any

import numpy as np
import pytest
import torch

from labkit import Engine
from labkit.mem_cache.storage import STORAGE_BACKENDS, HiCacheFile, block_keys

NS = "SmolLM2-135M-Instruct|kv=bfloat16|layers=30|kv_heads=3|head_dim=64"
BLOCK = 4
LAYOUT = (3, BLOCK, 2, 8)  # [num_layers, block, num_kv_heads, head_dim]


def kv(dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT, generator=g).to(dtype), torch.randn(LAYOUT, generator=g).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bitwise, so float8 (no torch.equal on CPU) and NaN payloads compare too.
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.fixture
def store(tmp_path) -> HiCacheFile:
    return HiCacheFile(tmp_path, NS)


def stored_block(store: HiCacheFile, seed: int = 0) -> tuple[str, list[int]]:
    tokens = list(range(seed, seed + BLOCK))
    key = block_keys(tokens, BLOCK, NS)[0]
    assert store.set(key, tokens, *kv(seed=seed))
    return key, tokens


def block_file(store: HiCacheFile, key: str):
    (path,) = store.dir.glob(f"*/{key}.pt")
    return path


# block_keys


def test_same_prefix_gives_same_keys():
    tokens = list(range(100, 110))
    assert block_keys(tokens, BLOCK, NS) == block_keys(tokens + [7, 8, 9], BLOCK, NS)[:2]


def test_change_in_block_0_changes_every_later_key():
    tokens = list(range(100, 116))
    changed = [101] + tokens[1:]
    assert all(a != b for a, b in zip(block_keys(tokens, BLOCK, NS), block_keys(changed, BLOCK, NS)))


def test_change_in_a_later_block_keeps_the_earlier_keys():
    tokens = list(range(100, 116))
    before, after = block_keys(tokens, BLOCK, NS), block_keys(tokens[:9] + [0] + tokens[10:], BLOCK, NS)
    assert before[:2] == after[:2] and before[2] != after[2] and before[3] != after[3]


def test_partial_block_has_no_key():
    assert len(block_keys(list(range(11)), BLOCK, NS)) == 2
    assert block_keys([1, 2, 3], BLOCK, NS) == []


def test_namespace_changes_keys():
    tokens = list(range(8))
    assert set(block_keys(tokens, BLOCK, NS)).isdisjoint(block_keys(tokens, BLOCK, NS + "|fp8"))


def test_keys_are_a_sha256_chain_over_little_endian_int32():
    # The keys name files on disk: pin the format so a change to it is a deliberate one.
    tokens = [1, 2, 3, 4, 70000, -1, 5, 6]
    ns_hex = hashlib.sha256(NS.encode()).hexdigest()
    key0 = hashlib.sha256(ns_hex.encode() + np.array(tokens[:4], "<i4").tobytes()).hexdigest()
    key1 = hashlib.sha256(key0.encode() + np.array(tokens[4:], "<i4").tobytes()).hexdigest()
    assert block_keys(tokens, BLOCK, NS) == [key0, key1]
    assert block_keys(torch.tensor(tokens), BLOCK, NS) == [key0, key1]


@pytest.mark.parametrize("block", [0, -4])
def test_block_keys_rejects_a_block_that_is_not_positive(block):
    with pytest.raises(ValueError, match="positive"):
        block_keys([1, 2, 3], block, NS)


def test_block_keys_rejects_an_empty_namespace_and_token_ids_beyond_int32():
    with pytest.raises(ValueError, match="namespace"):
        block_keys([1, 2, 3, 4], BLOCK, "")
    with pytest.raises(ValueError, match="int32"):
        block_keys([1, 2, 3, 2**40], BLOCK, NS)


# HiCacheFile


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_round_trip(store, dtype):
    tokens = [5, 6, 7, 8]
    key = block_keys(tokens, BLOCK, NS)[0]
    k, v = kv(dtype)
    assert store.set(key, tokens, k, v)
    got = store.get(key, tokens)
    assert got is not None and same_bits(got[0], k) and same_bits(got[1], v)
    assert (store.stats.reads, store.stats.read_hits, store.stats.writes) == (1, 1, 1)


def test_a_new_instance_on_the_same_dir_reads_the_blocks(tmp_path):
    first = HiCacheFile(tmp_path, NS)
    keys = [stored_block(first, seed) for seed in (0, 10)]
    restarted = HiCacheFile(tmp_path, NS)
    for seed, (key, tokens) in zip((0, 10), keys):
        got = restarted.get(key, tokens)
        assert got is not None and same_bits(got[0], kv(seed=seed)[0])
    assert restarted.summary()["blocks"] == 2


def test_another_namespace_never_sees_the_blocks(tmp_path):
    key, tokens = stored_block(HiCacheFile(tmp_path, NS))
    other = HiCacheFile(tmp_path, NS + "|fp8")
    assert not other.exists(key) and other.get(key, tokens) is None and other.summary()["blocks"] == 0


def test_a_block_sliced_from_a_pool_stores_only_the_block(store):
    pool = torch.randn(LAYOUT[0], 4096, *LAYOUT[2:])
    tokens = [1, 2, 3, 4]
    key = block_keys(tokens, BLOCK, NS)[0]
    k = pool[:, 100 : 100 + BLOCK]
    assert store.set(key, tokens, k, k)
    assert block_file(store, key).stat().st_size < pool.nbytes // 100
    got = store.get(key, tokens)
    assert got is not None and torch.equal(got[0], k)


def test_missing_key_is_a_miss_not_a_failure(store):
    tokens = [1, 2, 3, 4]
    assert store.get(block_keys(tokens, BLOCK, NS)[0], tokens) is None
    assert (store.stats.reads, store.stats.read_hits, store.stats.read_failures) == (1, 0, 0)


def truncate(path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def garbage(path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))


def flip_a_data_byte(path) -> None:
    # A byte inside the stored K: torch.load still succeeds, only the checksum can tell.
    data = bytearray(path.read_bytes())
    k_bytes = kv()[0].numpy().tobytes()
    at = data.find(k_bytes[:32])
    assert at >= 0
    data[at + 40] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, why", [(truncate, "unreadable"), (garbage, "unreadable"), (flip_a_data_byte, "checksum mismatch")]
)
def test_a_corrupt_file_is_a_counted_failure_logged_once(store, damage, why, caplog):
    key, tokens = stored_block(store)
    damage(block_file(store, key))
    with caplog.at_level(logging.WARNING, logger="labkit.mem_cache.storage"):
        assert store.get(key, tokens) is None
        assert store.get(key, tokens) is None
    assert store.stats.read_failures == 2 and store.stats.read_hits == 0
    (record,) = caplog.records
    assert key in record.getMessage() and why in record.getMessage()
    assert not store.exists(key)
    # A fresh write repairs it.
    assert store.set(key, tokens, *kv()) and store.exists(key) and store.get(key, tokens) is not None


def test_tokens_that_differ_from_the_stored_ones_are_not_returned(store):
    key, tokens = stored_block(store)
    assert store.get(key, tokens[:-1] + [999]) is None
    assert store.get(key, tokens + [99]) is None
    assert store.stats.read_failures == 2
    assert store.get(key, tokens) is not None


@pytest.mark.parametrize(
    "fields",
    [
        {"k": torch.zeros(LAYOUT)},  # no v, no checksum
        {"k": torch.zeros(LAYOUT).to_sparse(), "v": torch.zeros(LAYOUT).to_sparse(), "crc": 0},
        [1, 2, 3],
    ],
)
def test_a_file_that_is_not_a_kv_block_is_a_failure(store, fields):
    key, tokens = stored_block(store)
    ids = torch.tensor(tokens, dtype=torch.int32)
    torch.save({"tokens": ids, **fields} if isinstance(fields, dict) else fields, block_file(store, key))
    assert store.get(key, tokens) is None and store.stats.read_failures == 1


def test_exists_agrees_with_set(store):
    tokens = [9, 8, 7, 6]
    key = block_keys(tokens, BLOCK, NS)[0]
    assert not store.exists(key)
    assert store.set(key, tokens, *kv())
    assert store.exists(key)


def test_set_rejects_k_and_v_that_do_not_fit_the_block(store):
    tokens = [1, 2, 3, 4]
    key = block_keys(tokens, BLOCK, NS)[0]
    k, v = kv()
    with pytest.raises(ValueError, match="num_kv_heads"):
        store.set(key, tokens, k, v[:, :2])
    with pytest.raises(ValueError, match="num_kv_heads"):
        store.set(key, tokens, k, v.to(torch.bfloat16))
    with pytest.raises(ValueError, match="num_kv_heads"):
        store.set(key, tokens + [5], k, v)
    assert not store.exists(key)


@pytest.mark.parametrize("key", ["../" + "a" * 61, "A" * 64, "abc"])
def test_a_key_not_made_by_block_keys_is_rejected(store, key):
    with pytest.raises(ValueError, match="not a storage key"):
        store.exists(key)


def test_failing_replace_returns_false_and_leaves_nothing(store, monkeypatch):
    tokens = [1, 2, 3, 4]
    key = block_keys(tokens, BLOCK, NS)[0]

    def no_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_replace)
    assert store.set(key, tokens, *kv()) is False
    assert store.stats.write_failures == 1
    assert not store.exists(key) and store.get(key, tokens) is None
    assert [p for p in store.dir.rglob("*") if p.is_file()] == []  # the temp file is gone too


def test_removed_root_makes_set_return_false(tmp_path):
    store = HiCacheFile(tmp_path / "cache", NS)
    shutil.rmtree(tmp_path / "cache")
    tokens = [1, 2, 3, 4]
    key = block_keys(tokens, BLOCK, NS)[0]
    assert store.set(key, tokens, *kv()) is False
    assert store.stats.write_failures == 1 and store.get(key, tokens) is None
    assert not (tmp_path / "cache").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_unwritable_root_is_a_clear_value_error(tmp_path):
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o500)
    try:
        with pytest.raises(ValueError, match=r"--hicache-storage-dir .*ro: not writable \(PermissionError"):
            HiCacheFile(root, NS)
    finally:
        root.chmod(0o700)


def test_root_that_is_a_file_is_a_clear_value_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not writable"):
        HiCacheFile(tmp_path / "file", NS)


def test_summary_counts_blocks_bytes_and_stats(store):
    stored_block(store, 0)
    stored_block(store, 10)
    summary = store.summary()
    assert summary["backend"] == "file" and summary["dir"] == str(store.dir)
    assert summary["blocks"] == 2 and summary["writes"] == 2
    assert isinstance(summary["MiB"], float) and summary["MiB"] >= 0


def test_registry_builds_the_file_backend(tmp_path):
    assert isinstance(STORAGE_BACKENDS["file"](tmp_path, NS), HiCacheFile)
    assert STORAGE_BACKENDS["file"](tmp_path, NS, 1.5).max_bytes == 3 * 2**29


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_set_from_cuda_tensors_gets_them_back_on_the_cpu(store):
    tokens = [1, 2, 3, 4]
    key = block_keys(tokens, BLOCK, NS)[0]
    pool = torch.randn(LAYOUT[0], 64, *LAYOUT[2:], device="cuda", dtype=torch.bfloat16)
    k, v = pool[:, 8 : 8 + BLOCK], pool[:, 16 : 16 + BLOCK]
    assert store.set(key, tokens, k, v)
    got = store.get(key, tokens)
    assert got is not None and got[0].device.type == "cpu"
    assert same_bits(got[0], k.cpu()) and same_bits(got[1], v.cpu())


# The size cap (--hicache-storage-size): LRU eviction by write and read, across restarts


def block_size(tmp_path) -> int:
    """Bytes of one block file of LAYOUT (every block of it has this size)."""
    probe = HiCacheFile(tmp_path / "probe", NS)
    return block_file(probe, stored_block(probe)[0]).stat().st_size


def gib(num_bytes: float) -> float:
    return num_bytes / 2**30


def dir_bytes(root) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def blocks_kept(store: HiCacheFile, seeds) -> list[int]:
    return [seed for seed in seeds if store.exists(block_keys(list(range(seed, seed + BLOCK)), BLOCK, NS)[0])]


def read(store: HiCacheFile, seed: int) -> None:
    tokens = list(range(seed, seed + BLOCK))
    assert store.get(block_keys(tokens, BLOCK, NS)[0], tokens) is not None


@pytest.fixture
def capped(tmp_path):
    """capped(n, name="cache"): a store under tmp_path/name capped at n and a half blocks."""
    size = block_size(tmp_path)

    def make(blocks: int, name: str = "cache", namespace: str = NS) -> HiCacheFile:
        return HiCacheFile(tmp_path / name, namespace, gib((blocks + 0.5) * size))

    return make


def test_capped_directory_stays_under_the_cap_through_many_writes(capped, tmp_path):
    store = capped(3)
    seeds = range(0, 200, 10)
    for seed in seeds:
        stored_block(store, seed)
        assert dir_bytes(tmp_path / "cache") <= store.max_bytes
    assert blocks_kept(store, seeds) == [170, 180, 190]  # the newest
    assert store.stats.evictions == 17 and store.stats.too_large == 0
    assert store.summary()["blocks"] == 3 and store.summary()["cap_MiB"] == round(store.max_bytes / 2**20, 2)


def test_a_block_read_recently_survives_and_the_least_recently_used_goes(capped):
    store = capped(3)
    for seed in (0, 10, 20):
        stored_block(store, seed)
    read(store, 0)
    stored_block(store, 30)
    assert blocks_kept(store, (0, 10, 20, 30)) == [0, 20, 30]


def test_a_restart_keeps_the_lru_order(capped):
    first = capped(3)
    for seed in (0, 10, 20):
        stored_block(first, seed)
    read(first, 0)  # within the file clock's resolution of the writes: the order must still hold
    restarted = capped(3)
    stored_block(restarted, 30)
    assert blocks_kept(restarted, (0, 10, 20, 30)) == [0, 20, 30]


def test_a_restart_keeps_a_write_after_a_read_newest(capped, monkeypatch):
    first = capped(5)
    for seed in (0, 10):
        stored_block(first, seed)
    # A file system clock that lags the process's (coarse ticks): mtimes the kernel sets would
    # place the next write before the read.
    now_ns = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: now_ns() + 10**9)
    read(first, 0)
    stored_block(first, 20)
    monkeypatch.undo()
    assert blocks_kept(capped(1), (0, 10, 20)) == [20]


def test_a_restart_with_a_smaller_cap_evicts_down_to_it(capped):
    first = capped(5)
    for seed in range(0, 50, 10):
        stored_block(first, seed)
    restarted = capped(2)
    assert blocks_kept(restarted, range(0, 50, 10)) == [30, 40]
    assert restarted.stats.evictions == 3


def test_the_cap_covers_every_namespace_under_the_root(capped):
    old_model = capped(3)
    stored_block(old_model, 0)
    stored_block(old_model, 10)
    new_model = capped(3, namespace=NS + "|fp8")
    for seed in (100, 110):  # a block of another namespace
        tokens = list(range(seed, seed + BLOCK))
        assert new_model.set(block_keys(tokens, BLOCK, NS + "|fp8")[0], tokens, *kv())
    assert blocks_kept(old_model, (0, 10)) == [10]  # the oldest block of the root went


def test_a_block_bigger_than_the_cap_is_not_written_and_reading_it_is_a_miss(tmp_path, caplog):
    store = HiCacheFile(tmp_path / "cache", NS, gib(block_size(tmp_path) / 2))
    tokens = [1, 2, 3, 4]
    key = block_keys(tokens, BLOCK, NS)[0]
    with caplog.at_level(logging.WARNING, logger="labkit.mem_cache.storage"):
        assert store.set(key, tokens, *kv()) is False
    assert not store.exists(key) and store.get(key, tokens) is None
    assert (store.stats.too_large, store.stats.write_failures, store.stats.read_failures) == (1, 0, 0)
    assert [p for p in store.dir.rglob("*") if p.is_file()] == []  # its temp file is gone too
    assert "exceeds --hicache-storage-size" in caplog.text


def test_temp_files_of_killed_writes_are_removed_at_start(tmp_path):
    store = HiCacheFile(tmp_path, NS)
    key, _ = stored_block(store)
    folder = block_file(store, key).parent
    stale, fresh = folder / f".{key}.k1ll3d.tmp", folder / f".{key}.wr1t1ng.tmp"
    unrelated = [tmp_path / "notes.tmp", folder / "mine.tmp", store.dir / f".{key}.x.tmp"]
    for path in [stale, fresh, *unrelated]:
        path.write_bytes(b"partial block")
    long_ago = os.stat(stale).st_mtime - 3600
    for path in [stale, *unrelated]:
        os.utime(path, (long_ago, long_ago))
    HiCacheFile(tmp_path, NS)
    assert not stale.exists()
    assert fresh.exists()  # may be another live process's write in progress
    assert all(p.exists() for p in unrelated)  # not named as set() names its temp files
    assert block_file(store, key).exists()


@pytest.mark.parametrize("size", [0, -1.0, float("nan"), float("inf"), "1", True])
def test_a_cap_that_is_not_a_positive_number_is_a_value_error(tmp_path, size):
    with pytest.raises(ValueError, match=r"--hicache-storage-size must be a positive number of GiB"):
        HiCacheFile(tmp_path, NS, size)


def test_engine_gives_the_disk_tier_its_cap(tiny_engine_kwargs, tmp_path, caplog):
    tiers: dict[str, Any] = {"enable_hierarchical_cache": True, "hicache_storage_dir": str(tmp_path)}
    with caplog.at_level(logging.INFO, logger="labkit.mem_cache.factory"):
        engine = Engine(**tiny_engine_kwargs, **tiers, hicache_storage_size=0.5)
    assert engine.tree_cache.storage.max_bytes == 2**29
    assert "at most 0.5 GiB" in caplog.text
    with pytest.raises(ValueError, match="--hicache-storage-size"):
        Engine(**tiny_engine_kwargs, **tiers, hicache_storage_size=0.0)
