"""The disk tier's storage (labkit.mem_cache.storage): prefix-chained block keys, and HiCacheFile's
guarantee that get() returns exactly what set() stored or None, across restarts and bad files."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil

import numpy as np
import pytest
import torch

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
