"""HostKVPool: the host tier of the KV cache, under the device's TokenToKVPool (SGLang's
MHATokenToKVPoolHost). HiRadixCache decides what lives here; this class owns the tensors, its own page
allocator and the copies between the tiers."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from labkit.mem_cache.allocator import TokenToKVPoolAllocator
from labkit.mem_cache.memory_pool import TokenToKVPool
from labkit.reprs import Summarized


def available_host_memory() -> int:
    """Bytes the host can still give out (MemAvailable: free memory plus reclaimable page cache)."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Byte view of one-byte (FP8) KV: index copies are not implemented for every FP8 dtype and device."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


class HostKVPool(Summarized):
    """K and V of every layer for `size` tokens in CPU memory, [num_layers, slots, kv_heads, head_dim],
    the device pool's storage dtype (FP8 KV stays FP8), pinned on CUDA so copies are DMA transfers.
    Host slots are this pool's own (allocated in whole pages, page 0 reserved like the device's).

    Guarantees of the copies: `backup` returns with the data in host memory; `load` returns once the
    copy is queued, and on CUDA it runs on a side stream that the compute stream waits for, so no
    forward queued afterwards reads a slot before its KV has arrived (the host keeps going: the copy
    overlaps the forward already running). `backup` also makes the compute stream wait, so device
    slots freed right after it are not rewritten while the copy still reads them."""

    def __init__(self, device_pool: TokenToKVPool, size: int):
        page = device_pool.page_size
        size = size // page * page
        if size < page:
            raise ValueError(f"the host KV pool must hold at least one page ({page} tokens), got {size}")
        self.device_pool = device_pool
        self.page_size = page
        self.size = size
        first = device_pool.k_buffer[0]
        self.device = first.device
        nbytes = 2 * (size + page) * first[0].numel() * first.element_size() * device_pool.num_layers
        available = available_host_memory()
        if nbytes > available:
            raise ValueError(
                f"the host KV pool needs {nbytes / 2**30:.2f} GiB but the host has {available / 2**30:.2f} GiB "
                "available: lower --hicache-size"
            )
        on_cuda = self.device.type == "cuda"
        shape = (device_pool.num_layers, size + page, *first.shape[1:])
        self.k = torch.zeros(shape, dtype=first.dtype, pin_memory=on_cuda)
        self.v = torch.zeros(shape, dtype=first.dtype, pin_memory=on_cuda)
        self.allocator = TokenToKVPoolAllocator(size, page)
        self.stream = torch.cuda.Stream(self.device) if on_cuda else None
        self._in_flight: list[tuple[torch.cuda.Event, torch.Tensor, torch.Tensor]] = []  # loads' host buffers

    def summary(self) -> dict[str, object]:
        return {
            "tokens": self.size,
            "free": self.allocator.available_size(),
            "page_size": self.page_size,
            "MiB": round(2 * self.k.numel() * self.k.element_size() / 2**20, 1),
            "pinned": self.k.is_pinned(),
        }

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Host slots for num_tokens (a multiple of page_size), or None when the pool is short."""
        return self.allocator.alloc_extend([0], [num_tokens], [-1])

    def free(self, host_indices: torch.Tensor) -> None:
        self.allocator.free(host_indices)

    def available_size(self) -> int:
        return self.allocator.available_size()

    # ---- copies --------------------------------------------------------------------------------
    def read_device(self, device_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of these device slots, [num_layers, n, kv_heads, head_dim], in host memory."""
        pool = self.device_pool
        dtype = self.k.dtype
        if self.stream is None:
            k, v = (torch.stack([_raw(b)[device_indices] for b in bufs]) for bufs in (pool.k_buffer, pool.v_buffer))
            return k.view(dtype), v.view(dtype)
        with torch.cuda.stream(self.stream):
            idx = device_indices.to(self.device, non_blocking=True)
            staged = [
                torch.stack([_raw(b).index_select(0, idx) for b in bufs]) for bufs in (pool.k_buffer, pool.v_buffer)
            ]
            out = [torch.empty(s.shape, dtype=s.dtype, pin_memory=True) for s in staged]
            for o, s in zip(out, staged):
                o.copy_(s, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        done.synchronize()
        return out[0].view(dtype), out[1].view(dtype)

    def backup(self, device_indices: torch.Tensor, host_indices: torch.Tensor) -> None:
        """Copy the KV of device slots into host slots (same length)."""
        k, v = self.read_device(device_indices)
        self.write_host(host_indices, k, v)

    def write_host(self, host_indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        _raw(self.k)[:, host_indices] = _raw(k)
        _raw(self.v)[:, host_indices] = _raw(v)

    def read_host(self, host_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, host_indices], self.v[:, host_indices]

    def load(self, device_indices: torch.Tensor, host_indices: torch.Tensor) -> None:
        """Copy host slots into device slots (same length)."""
        self.write_device(device_indices, *self.read_host(host_indices))

    def write_device(self, device_indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V ([num_layers, n, kv_heads, head_dim], host memory, storage dtype) into device slots."""
        pool = self.device_pool
        if self.stream is None:
            for layer in range(pool.num_layers):
                _raw(pool.k_buffer[layer])[device_indices] = _raw(k[layer])
                _raw(pool.v_buffer[layer])[device_indices] = _raw(v[layer])
            return
        self._in_flight = [f for f in self._in_flight if not f[0].query()]
        k, v = _raw(k).pin_memory(), _raw(v).pin_memory()
        with torch.cuda.stream(self.stream):
            idx = device_indices.to(self.device, non_blocking=True)
            dk, dv = k.to(self.device, non_blocking=True), v.to(self.device, non_blocking=True)
            for layer in range(pool.num_layers):
                _raw(pool.k_buffer[layer]).index_copy_(0, idx, dk[layer])
                _raw(pool.v_buffer[layer]).index_copy_(0, idx, dv[layer])
            done = torch.cuda.Event()
            done.record(self.stream)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self._in_flight.append((done, k, v))  # the pinned sources must outlive the transfer
