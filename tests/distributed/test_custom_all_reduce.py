"""Whether the custom all-reduce is made is decided by rank 0 for every rank: only rank 0's process
can have made one before (torch's symmetric-memory rendezvous then waits on keys new followers never
write), so a follower must not try on its own. Gloo on CPU; the all-reduce itself is measured on GPUs
(benchmarks/parallel_gpu.py)."""

from __future__ import annotations

import multiprocessing as mp

import torch

from labkit.distributed import custom_all_reduce
from labkit.distributed.parallel_state import destroy_tp_group, init_tp_group
from labkit.distributed.tp_worker import free_local_addr

CUDA = torch.device("cuda")  # only its type is looked at before rank 0's verdict


def _follower(addr: str, verdicts: mp.Queue) -> None:
    tp = init_tp_group(1, 2, addr, torch.device("cpu"), 60)
    try:
        verdicts.put(tp.enable_custom_all_reduce(CUDA, torch.bfloat16))
    finally:
        destroy_tp_group(tp)


def test_rank_0_having_made_one_turns_it_off_on_every_rank(monkeypatch):
    monkeypatch.setattr(custom_all_reduce, "_made_in_this_process", True)
    addr = free_local_addr()
    ctx = mp.get_context("spawn")
    verdicts = ctx.Queue()
    follower = ctx.Process(target=_follower, args=(addr, verdicts), daemon=True)
    follower.start()
    tp = init_tp_group(0, 2, addr, torch.device("cpu"), 60)
    try:
        mine = tp.enable_custom_all_reduce(CUDA, torch.bfloat16)
    finally:
        destroy_tp_group(tp)
    theirs = verdicts.get(timeout=60)
    follower.join(30)
    assert mine == theirs and mine is not None and "already made one" in mine
    assert tp.custom_all_reduce is None
