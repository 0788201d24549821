"""Tensor-parallel followers: the processes that hold ranks 1..N-1 of an Engine(tp_size=N). Rank 0
stays in the calling process (a notebook can step it and look at its pools); each follower loads its
share of the model and steps with rank 0 (labkit.scheduler.tp_sync) until told to stop."""

from __future__ import annotations

import logging
import multiprocessing as mp
import socket
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from labkit.config import EngineConfig, ranks_per_node
from labkit.distributed.parallel_state import TPGroup, destroy_tp_group, init_tp_group
from labkit.model_executor.model_runner import resolve_device
from labkit.models.registry import get_model_class
from labkit.scheduler.scheduler import Scheduler
from labkit.trace.recorder import Tracer

logger = logging.getLogger(__name__)
JOIN_TIMEOUT_S = 30.0


def free_local_addr() -> str:
    """127.0.0.1:<a port nothing listens on now>, for a one-machine rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def check_tp_shapes(hf_config: Any, tp_size: int, ep_size: int = 1) -> None:
    """ValueError, before any process starts, if the model cannot be split tp_size ways (its experts
    ep_size ways): the model is built on the meta device (no memory) as rank 0 would build it, so its
    parallel layers check."""
    with torch.device("meta"):
        try:
            tp = TPGroup(rank=0, size=tp_size, ep_size=ep_size)
            get_model_class(hf_config.architectures)(hf_config, torch.float32, tp)
        except ValueError as e:
            experts = f" with ep_size {ep_size}" if ep_size > 1 else ""
            raise ValueError(f"tp_size {tp_size} does not fit the model{experts}: {e}") from None


def run_tp_follower(config: EngineConfig, rank: int, init_addr: str) -> None:
    """A follower rank's whole life: join the group, load its share, follow rank 0, leave."""
    device = resolve_device(config.device, rank % ranks_per_node(config))
    tp = init_tp_group(rank, config.tp_size, init_addr, device, config.dist_timeout, ep_size=config.ep_size)
    try:
        tracer = Tracer(record_snapshots=False) if config.enable_trace else None
        Scheduler.from_config(config, tracer, tp).follow_leader()
    except Exception:
        traceback.print_exc()
        raise
    finally:
        destroy_tp_group(tp)


@dataclass
class TPFollowers:
    """The follower processes an Engine started on this machine."""

    procs: list[mp.process.BaseProcess] = field(default_factory=list)

    @classmethod
    def start(cls, config: EngineConfig, init_addr: str) -> TPFollowers:
        ctx = mp.get_context("spawn")  # a clean interpreter: no forked torch state
        procs: list[mp.process.BaseProcess] = []
        for rank in range(1, config.tp_size):
            proc = ctx.Process(
                target=run_tp_follower, args=(config, rank, init_addr), name=f"labkit-tp{rank}", daemon=True
            )
            proc.start()
            procs.append(proc)
        return cls(procs)

    def dead(self) -> str | None:
        """Which follower exited, if one did (while starting: a failure it printed)."""
        for proc in self.procs:
            if not proc.is_alive():
                return f"tensor-parallel worker {proc.name} exited (exit code {proc.exitcode}); see its output above"
        return None

    def join(self, timeout: float = JOIN_TIMEOUT_S) -> None:
        """Wait for them to exit (after rank 0 said stop); kill any that does not."""
        for proc in self.procs:
            proc.join(timeout)
            if proc.is_alive():
                logger.warning("tensor-parallel worker %s did not stop; killing it", proc.name)
                proc.kill()
                proc.join()
