"""Tensor-parallel process groups on torch.distributed (NCCL for CUDA tensors, gloo for CPU ones).

A `TPGroup` is passed explicitly to whatever needs it (parallel layers, ModelRunner, Scheduler):
labkit keeps no global "current group". Its size-1 form does nothing, so single-device code runs the
same layers. One torch.distributed world is one tensor-parallel group (one data-parallel replica)."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from labkit.distributed.custom_all_reduce import CustomAllReduce, available_in_this_process

# Followers wait in a collective for rank 0's next step, which a notebook may take hours to ask for;
# a rank that dies is noticed from its closed connections (and the server's watcher), not by this.
COLLECTIVE_TIMEOUT = datetime.timedelta(days=7)


@dataclass
class CommStats:
    """Counts of the group's collectives. Seconds are measured where collectives block (gloo on CPU);
    on CUDA they are queued asynchronously, so only calls and bytes count there (profile for time)."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def take(self) -> CommStats:
        """The counts since the last take (then zeroed)."""
        out = CommStats(self.calls, self.bytes, self.seconds)
        self.calls, self.bytes, self.seconds = 0, 0, 0.0
        return out


@dataclass
class TPGroup:
    """This process's place in its tensor-parallel group. `group` carries tensors (the backend follows
    the tensor's device); `cpu_group` (gloo) carries the scheduler's broadcast inputs."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    stats: CommStats = field(default_factory=CommStats)
    custom_all_reduce: CustomAllReduce | None = None  # small CUDA tensors, one machine (enable_custom_all_reduce)
    # Expert parallelism within this group: MoE experts split over ep_size ranks (labkit/layers/moe).
    ep_size: int = 1

    def __post_init__(self) -> None:
        if self.ep_size < 1 or self.size % self.ep_size:
            raise ValueError(f"ep_size must divide tp_size {self.size}, got {self.ep_size}")

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks: `x` itself, summed in place (NCCL, gloo), or a new tensor (the
        custom all-reduce). Use the returned tensor."""
        if self.size == 1:
            return x
        start = time.perf_counter()
        if self.custom_all_reduce is not None and self.custom_all_reduce.can_run(x):
            x = self.custom_all_reduce.all_reduce(x)
        else:
            dist.all_reduce(x, group=self.group)
        self._count(x, start)
        return x

    def gemv_all_reduce(self, x: torch.Tensor, n: int) -> Any:
        """The GEMV epilogue that sums a row-parallel product of x's rows and n outputs over the
        ranks (labkit.kernels.gemv_all_reduce.GemvAllReduce), counted as an all-reduce; None where
        the product must go through all_reduce instead."""
        custom = self.custom_all_reduce
        if custom is None or custom.gemv_epilogue is None or not custom.can_run(x):
            return None
        rows = x.numel() // x.shape[-1]
        if not custom.gemv_epilogue.takes(rows, n):
            return None
        self._tally(rows * n * x.element_size())
        return custom.gemv_epilogue

    def enable_custom_all_reduce(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Collective: route small all-reduces of `dtype` through CustomAllReduce. Returns why not
        (None when enabled): it needs CUDA and every rank on this machine."""
        if self.size == 1 or self.group is None or device.type != "cuda":
            return "it needs CUDA and more than one rank"
        # Rank 0 decides for all: only it may have made one before (the other ranks are new processes).
        refusal = "" if available_in_this_process() else "rank 0's process already made one (custom_all_reduce.py)"
        refusal = self.broadcast_bytes(refusal.encode() if self.is_leader else None).decode()
        if refusal:
            return refusal
        try:
            self.custom_all_reduce = CustomAllReduce(self.group, device, dtype)
        except RuntimeError as e:
            return f"symmetric memory is not available: {e}"
        return None

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' `x` concatenated along `dim`, in rank order (same on every rank)."""
        if self.size == 1:
            return x
        start = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        out = torch.cat(parts, dim=dim)
        self._count(out, start)
        return out

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's `data` on every rank (others pass None): a length, then the bytes, over gloo."""
        if self.size == 1:
            if data is None:
                raise ValueError("a group of one has only a leader, which must pass the data")
            return data
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.cpu_group)
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(size), dtype=torch.uint8)
        )
        if int(size):
            dist.broadcast(buf, src=0, group=self.cpu_group)
        return data if data is not None else buf.numpy().tobytes()

    def min_int(self, x: int) -> int:
        """The smallest of the ranks' `x`, on every rank (over gloo): how ranks agree on a count that
        each measured locally, such as the disk blocks each could read."""
        if self.size == 1:
            return x
        t = torch.tensor([x], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t)

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's `data` on rank 0, in rank order (other ranks get []), over gloo."""
        if self.size == 1:
            return [data]
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.cpu_group)
        longest = max(int(s) for s in sizes)
        buf = torch.zeros(longest, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
        bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)] if self.is_leader else None
        dist.gather(buf, bufs, dst=0, group=self.cpu_group)
        if bufs is None:
            return []
        return [b[: int(n)].numpy().tobytes() for b, n in zip(bufs, sizes)]

    def _count(self, t: torch.Tensor, start: float) -> None:
        self._tally(t.numel() * t.element_size())
        if t.device.type == "cpu":
            self.stats.seconds += time.perf_counter() - start

    def _tally(self, nbytes: int) -> None:
        """One all-reduce of nbytes, into the stats."""
        self.stats.calls += 1
        self.stats.bytes += nbytes


def split_evenly(total: int, size: int, what: str) -> int:
    """total // size; ValueError naming `what` when it does not divide."""
    if total % size:
        raise ValueError(f"tp_size {size} does not divide the model's {total} {what}")
    return total // size


def init_tp_group(
    rank: int,
    size: int,
    init_addr: str,
    device: torch.device,
    timeout_s: float,
    others_alive: Callable[[], str | None] | None = None,
    ep_size: int = 1,
) -> TPGroup:
    """Join the torch.distributed world of one tensor-parallel group at `init_addr` ("host:port";
    rank 0 listens there). RuntimeError with a clear message if the others do not come in time, or
    (rank 0) as soon as `others_alive()` names a rank process that died while starting."""
    if size == 1:
        return TPGroup(ep_size=ep_size)
    host, _, port = init_addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"dist_init_addr must be host:port, got {init_addr!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, int(port), size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
        if rank == 0:
            _wait_for_ranks(store, size, timeout_s, others_alive)
        else:
            store.add(_JOINED_KEY, 1)
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT, device_id=_device_id(device)
        )
    except (RuntimeError, dist.DistStoreError) as e:
        raise RuntimeError(
            f"rank {rank} of {size} could not join the tensor-parallel group at {init_addr}: {e}"
        ) from None
    cpu_group = dist.new_group(backend="gloo") if device.type == "cuda" else dist.group.WORLD
    return TPGroup(rank, size, dist.group.WORLD, cpu_group, ep_size=ep_size)


_JOINED_KEY = "labkit/ranks_joined"


def _wait_for_ranks(
    store: dist.TCPStore, size: int, timeout_s: float, others_alive: Callable[[], str | None] | None
) -> None:
    deadline = time.monotonic() + timeout_s
    while (joined := store.add(_JOINED_KEY, 0)) < size - 1:
        dead = others_alive() if others_alive is not None else None
        if dead:
            raise RuntimeError(dead)
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{joined + 1} of {size} ranks came within {timeout_s:.0f} s (is every rank started, and the "
                "address reachable from them?)"
            )
        time.sleep(0.05)


def _device_id(device: torch.device) -> torch.device | None:
    return device if device.type == "cuda" else None


def destroy_tp_group(tp: TPGroup) -> None:
    """Leave the group (the process can join another one afterwards)."""
    tp.custom_all_reduce = None
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
