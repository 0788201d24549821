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

_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TYPESTR = {torch.uint8: "|u1", torch.int16: "<i2", torch.int32: "<i4", torch.int64: "<i8"}


def available_host_memory() -> int:
    """Bytes the host can still give out (MemAvailable: free memory plus reclaimable page cache)."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The same bits as integers: copies move bits, and index kernels exist for every integer width
    (not for every FP8 dtype on every device)."""
    return t.view(_RAW[t.element_size()])


def cuda_view_of_pinned(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over pinned host memory, without a copy. With unified addressing a pinned host
    address is valid on the GPU, so index kernels gather from (and scatter to) the host pool over the
    host link directly: no gather on the CPU, no staging buffer."""
    raw = _raw(host)
    iface = {"shape": tuple(raw.shape), "typestr": _TYPESTR[raw.dtype], "data": (raw.data_ptr(), False), "version": 3}
    holder = type("PinnedHostMemory", (), {"__cuda_array_interface__": iface})()
    with torch.cuda.device(device):
        return torch.as_tensor(holder, device=device)


class HostKVPool(Summarized):
    """K and V of every layer for `size` tokens in CPU memory, [num_layers, slots, kv_heads, head_dim],
    the device pool's storage dtype (FP8 KV stays FP8). Host slots are this pool's own (allocated in
    whole pages, page 0 reserved like the device's).

    On CUDA the tensors are pinned and the copies are GPU kernels on a side stream reading or writing
    them in place (cuda_view_of_pinned). Guarantees: a copy starts after the work already queued on the
    compute stream (a write_through backup follows the forward, still in flight, that computes its KV;
    a load's fresh slots may still be written by a finished request's last step), and after `backup`
    or `load` returns, every forward the compute stream runs later sees the copy done (it waits for
    the side stream): the device slots a backup read can be reused, the slots a load filled can be
    read. The host goes on at once. `read_host` waits for the backups still writing."""

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
        if on_cuda:
            self._views = (cuda_view_of_pinned(self.k, self.device), cuda_view_of_pinned(self.v, self.device))
        self._writing: torch.cuda.Event | None = None  # the last backup on the side stream

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
    def _buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return self.device_pool.k_buffer, self.device_pool.v_buffer

    def backup(self, device_indices: torch.Tensor, host_indices: torch.Tensor) -> None:
        """Copy the KV of device slots into host slots (same length)."""
        if self.stream is None:
            self.write_host(host_indices, *self.read_device(device_indices))
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            src = device_indices.to(self.device, non_blocking=True)
            dst = host_indices.to(self.device, non_blocking=True)
            for bufs, view in zip(self._buffers(), self._views):
                view.index_copy_(1, dst, torch.stack([_raw(b).index_select(0, src) for b in bufs]))
            self._writing = torch.cuda.Event()
            self._writing.record(self.stream)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def load(self, device_indices: torch.Tensor, host_indices: torch.Tensor) -> None:
        """Copy host slots into device slots (same length)."""
        if self.stream is None:
            self.write_device(device_indices, *self.read_host(host_indices))
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst = device_indices.to(self.device, non_blocking=True)
            src = host_indices.to(self.device, non_blocking=True)
            for bufs, view in zip(self._buffers(), self._views):
                rows = view.index_select(1, src)  # read over the host link by the GPU
                for layer, buf in enumerate(bufs):
                    _raw(buf).index_copy_(0, dst, rows[layer])
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def read_device(self, device_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of these device slots, [num_layers, n, kv_heads, head_dim], in (pageable) host memory."""
        idx = device_indices.to(self.device)
        k, v = (torch.stack([_raw(b).index_select(0, idx) for b in bufs]).cpu() for bufs in self._buffers())
        return k.view(self.k.dtype), v.view(self.k.dtype)

    def read_host(self, host_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._writing is not None:
            self._writing.synchronize()
        return self.k[:, host_indices], self.v[:, host_indices]

    def write_host(self, host_indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._writing is not None:
            self._writing.synchronize()  # a backup in flight may target the same slots
        _raw(self.k)[:, host_indices] = _raw(k)
        _raw(self.v)[:, host_indices] = _raw(v)

    def write_device(self, device_indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V ([num_layers, n, kv_heads, head_dim], host memory, storage dtype) into device slots
        (in order on the compute stream: this is for blocks read from disk, small and rare)."""
        idx = device_indices.to(self.device)
        k, v = _raw(k).to(self.device), _raw(v).to(self.device)
        for layer, (kb, vb) in enumerate(zip(*self._buffers())):
            _raw(kb)[idx] = k[layer]
            _raw(vb)[idx] = v[layer]
