"""HiRadixCache under random workloads: every slot of every tier has exactly one owner, every node's KV
is the KV of its tokens in whichever tier it is, and what comes back from the host or disk is what went
there."""

from __future__ import annotations

import random

import pytest
import torch

from labkit.mem_cache.allocator import TokenToKVPoolAllocator
from labkit.mem_cache.hiradix_cache import HiRadixCache, on_device
from labkit.mem_cache.host_pool import HostKVPool
from labkit.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from labkit.mem_cache.storage import HiCacheFile

LAYERS = 2


def expected_kv(key: list[int], start: int, end: int) -> torch.Tensor:
    """The KV this test writes for tokens [start, end) of key: (token id, position) per slot."""
    return torch.tensor([[key[i], i] for i in range(start, end)], dtype=torch.float32).view(-1, 1, 2)


class World:
    """A HiRadixCache over small device and host pools, driven like the scheduler drives it."""

    def __init__(self, page: int, device_tokens: int, host_tokens: int, policy: str, storage_dir=None, device="cpu"):
        self.page = page
        self.pool = TokenToKVPool(device_tokens, page, torch.float32, LAYERS, 1, 2, device)
        self.allocator = TokenToKVPoolAllocator(device_tokens, page)
        self.host = HostKVPool(self.pool, host_tokens)
        storage = HiCacheFile(storage_dir, "test") if storage_dir is not None else None
        self.cache = HiRadixCache(
            ReqToTokenPool(2, 8), self.allocator, page, self.host, policy, storage, 2 * page, "test"
        )
        self.held: list[tuple[torch.Tensor, object]] = []  # (request-owned slots, locked node)

    def request(self, key: list[int], hold: bool) -> list[int]:
        """Match (with load back), compute the rest, cache it all; `hold` keeps it running (locked)."""
        cache = self.cache
        match = cache.load_back(key, cache.match_prefix(key))
        prefix = match.device_indices
        assert torch.equal(self.device_kv(prefix), expected_kv(key, 0, len(prefix)))
        cache.inc_lock_ref(match.last_node)
        need = len(key) - len(prefix)
        if need > self.allocator.available_size():
            cache.evict(need - self.allocator.available_size())
        new = self.allocator.alloc_extend([0], [need], [-1]) if need else prefix[:0]
        if new is None:  # no room even after evicting: the request waits (nothing held)
            cache.dec_lock_ref(match.last_node)
            return []
        kv = expected_kv(key, len(prefix), len(key)).to(self.pool.k_buffer[0].device)
        for layer in range(LAYERS):
            self.pool.set_kv_buffer(layer, new.to(kv.device), kv, kv * (layer + 1))
        value = torch.cat((prefix, new))
        already = cache.insert(key, value)
        if already > len(prefix):
            self.allocator.free(value[len(prefix) : already])  # duplicates of cached slots
        node = cache.match_prefix(key).last_node
        cache.inc_lock_ref(node)
        cache.dec_lock_ref(match.last_node)
        if hold:
            self.held.append((node,))
        else:
            cache.dec_lock_ref(node)
        return value.tolist()

    def device_kv(self, slots: torch.Tensor) -> torch.Tensor:
        return self.pool.k_buffer[0][slots.to(self.pool.k_buffer[0].device)].cpu()

    def release_one(self) -> None:
        (node,) = self.held.pop(0)
        self.cache.dec_lock_ref(node)

    def check(self) -> None:
        cache, page = self.cache, self.page
        device_pages: list[int] = []
        host_pages: list[int] = []
        device_tokens = 0
        for node in cache.nodes():
            if node.parent is None:
                continue
            key = [t for n in cache._path(node) for t in n.key]
            start = len(key) - len(node.key)
            assert on_device(node) or node.host_value is not None, "a node with its KV nowhere"
            if on_device(node):
                assert on_device(node.parent), "a device node under a host-only parent"
                device_pages += (node.value[::page] // page).tolist()
                device_tokens += len(node.key)
                assert torch.equal(self.device_kv(node.value), expected_kv(key, start, len(key)))
            if node.host_value is not None:
                host_pages += (node.host_value[::page] // page).tolist()
                k, v = self.host.read_host(node.host_value)
                want = expected_kv(key, start, len(key))
                assert torch.equal(k[1], want) and torch.equal(v[0], want) and torch.equal(v[1], 2 * want)
        free = self.allocator.free_pages.tolist()
        assert len(device_pages) == len(set(device_pages)), "a device page in two nodes"
        assert not set(device_pages) & set(free), "a device page both free and in the tree"
        assert len(device_pages) + len(free) == self.allocator.num_pages, "a device page lost"
        host_free = self.host.allocator.free_pages.tolist()
        assert len(host_pages) == len(set(host_pages)) and not set(host_pages) & set(host_free)
        assert len(host_pages) + len(host_free) == self.host.allocator.num_pages, "a host page lost"
        assert cache.evictable_size() + cache.protected_size() == device_tokens
        usage = cache.tier_usage()
        assert usage is not None and usage.free + usage.host_only + usage.backed_up == usage.total


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("policy", ["write_back", "write_through"])
@pytest.mark.parametrize("disk", [False, True])
def test_every_slot_of_every_tier_has_one_owner_and_the_right_kv(page, policy, disk, device, tmp_path):
    rng = random.Random(f"{page}{policy}{disk}")
    world = World(page, 48 * page, 32 * page, policy, tmp_path if disk else None, device)
    stems = [[rng.randrange(100, 120) for _ in range(rng.randrange(1, 8) * page)] for _ in range(6)]
    for _ in range(300):
        op = rng.random()
        if op < 0.7:
            key = rng.choice(stems) + [rng.randrange(100, 104) for _ in range(rng.randrange(0, 4) * page)]
            world.request(key, hold=rng.random() < 0.2 and len(world.held) < 3)
        elif op < 0.85 and world.held:
            world.release_one()
        elif op < 0.95:
            world.cache.evict(rng.randrange(1, 32))
        elif not world.held:
            world.cache.reset()
        world.check()
    stats = world.cache.stats
    assert stats.written_to_host and stats.loaded_back  # the workload did go through the host tier
    if disk:
        assert stats.written_to_disk


def test_disk_blocks_come_back_after_a_restart_and_a_bad_file_is_a_miss(tmp_path):
    key = list(range(200, 232))  # 4 blocks of 8 at page 4
    first = World(4, 64, 32, "write_back", tmp_path)
    first.request(key, hold=False)
    assert first.cache.stats.written_to_disk == 32
    again = World(4, 64, 32, "write_back", tmp_path)  # a new process: empty tree, same directory
    match = again.cache.load_back(key, again.cache.match_prefix(key))
    assert len(match.device_indices) == 32
    assert torch.equal(again.device_kv(match.device_indices), expected_kv(key, 0, 32))
    # Corrupt the third block: the read stops there, and the rest is recomputed, not wrong.
    files = sorted(tmp_path.rglob("*.pt"), key=lambda p: p.stat().st_mtime_ns)
    assert len(files) == 4
    files[2].write_bytes(b"garbage")
    third = World(4, 64, 32, "write_back", tmp_path)
    match = third.cache.load_back(key, third.cache.match_prefix(key))
    assert len(match.device_indices) == 16
    third.request(key, hold=False)
    third.check()


def test_host_pool_larger_than_the_hosts_memory_is_an_error():
    pool = TokenToKVPool(16, 1, torch.float32, 1000, 8, 128)
    with pytest.raises(ValueError, match="hicache-size"):
        HostKVPool(pool, 10**9)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_host_pool_round_trip_moves_the_bits(device, dtype):
    """backup then load puts back exactly the bits (random slots both ways, every layer, K and V)."""
    pool = TokenToKVPool(64, 1, dtype, 3, 2, 8, device)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.copy_(torch.randn(buf.shape, device=device).to(dtype))
    host = HostKVPool(pool, 48)
    src = torch.randperm(64)[:20] + 1
    slots = host.alloc(20)
    assert slots is not None
    host.backup(src, slots)
    k, v = host.read_host(slots)
    for layer in range(3):
        assert torch.equal(k[layer].view(torch.uint8), pool.k_buffer[layer][src.to(device)].cpu().view(torch.uint8))
        assert torch.equal(v[layer].view(torch.uint8), pool.v_buffer[layer][src.to(device)].cpu().view(torch.uint8))
    dst = torch.randperm(64)[:20] + 1  # may overlap src: compare with the bits backed up
    host.load(dst, slots)
    for layer in range(3):
        for buf, saved in ((pool.k_buffer[layer], k[layer]), (pool.v_buffer[layer], v[layer])):
            assert torch.equal(buf[dst.to(device)].cpu().view(torch.uint8), saved.view(torch.uint8))
