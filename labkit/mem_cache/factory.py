"""make_prefix_cache: the scheduler's prefix cache as the config asks for it (none, radix tree, or the
radix tree over device, host and disk tiers), with the start-up log line of each tier's capacity."""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING

from labkit.config import EngineConfig
from labkit.mem_cache.base_prefix_cache import BasePrefixCache, EventHook
from labkit.mem_cache.chunk_cache import ChunkCache
from labkit.mem_cache.hiradix_cache import HiRadixCache
from labkit.mem_cache.host_pool import HostKVPool
from labkit.mem_cache.memory_pool import is_fp8
from labkit.mem_cache.radix_cache import RadixCache
from labkit.mem_cache.storage import STORAGE_BACKENDS, HiCacheStorage

if TYPE_CHECKING:
    from labkit.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def storage_namespace(config: EngineConfig, runner: ModelRunner) -> str:
    """What KV blocks on disk depend on: the model (and its weights' seed when random), the KV layout
    and dtype (with a float8 pool's scales unless all 1.0: they decide what the stored values mean),
    and the tensor-parallel rank whose heads they hold."""
    pool = runner.token_to_kv_pool
    weights = config.model_path or "embedded"
    if config.load_format == "dummy":
        weights += f":dummy:{config.random_seed}"
    layout = f"{pool.num_layers}x{pool.num_kv_heads}x{pool.head_dim}:{pool.k_buffer[0].dtype}"
    scales = pool.k_scale + pool.v_scale
    if is_fp8(pool.dtype) and any(x != 1.0 for x in scales):
        layout += ":scales=" + hashlib.sha256(repr(scales).encode()).hexdigest()[:16]
    return f"{weights}|{config.dtype}|{layout}|tp{runner.tp.rank}/{runner.tp.size}"


def make_prefix_cache(config: EngineConfig, runner: ModelRunner, on_event: EventHook | None) -> BasePrefixCache:
    """ValueError for options that do not go together, a host tier that does not fit the host's
    memory, or a disk directory that cannot be written."""
    req_pool, allocator, page = runner.req_to_token_pool, runner.token_to_kv_pool_allocator, config.page_size
    if not config.enable_hierarchical_cache:
        if config.disable_radix_cache:
            return ChunkCache(req_pool, allocator, page)
        return RadixCache(req_pool, allocator, page, on_event=on_event)
    if config.disable_radix_cache:
        raise ValueError("--enable-hierarchical-cache needs the radix cache: drop --disable-radix-cache")
    if config.hicache_size < 0:
        raise ValueError(f"hicache_size must be >= 0 GiB, got {config.hicache_size}")
    device_pool = runner.token_to_kv_pool
    per_token = device_pool.bytes_per_token()
    host_tokens = int(config.hicache_size * 2**30 // per_token) if config.hicache_size else 2 * device_pool.size
    host_pool = HostKVPool(device_pool, host_tokens)
    storage: HiCacheStorage | None = None
    if config.hicache_storage_dir is not None:
        storage = STORAGE_BACKENDS["file"](
            config.hicache_storage_dir, storage_namespace(config, runner), config.hicache_storage_size
        )
    cache = HiRadixCache(
        req_pool,
        allocator,
        page,
        host_pool,
        write_policy=config.hicache_write_policy,
        storage=storage,
        storage_block=config.hicache_storage_block,
        storage_namespace=storage_namespace(config, runner),
        on_event=on_event,
        agree=runner.tp.min_int,  # a group of one returns its own count
    )
    cap = config.hicache_storage_size
    logger.info(
        "hierarchical cache: device %d tokens, host %d tokens (%.2f GiB%s, %s)%s",
        device_pool.size,
        host_pool.size,
        host_pool.size * per_token / 2**30,
        ", pinned" if host_pool.k.is_pinned() else "",
        config.hicache_write_policy,
        f", disk {config.hicache_storage_dir} (blocks of {config.hicache_storage_block}, "
        f"{'unbounded' if cap is None else f'at most {cap} GiB'})"
        if storage
        else "",
    )
    return cache
