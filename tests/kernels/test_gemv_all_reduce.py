"""The GEMV's all-reduce epilogue (kernels/gemv_all_reduce.py) against the unfused path: each rank's
partial sums through the plain GEMV, added in float32 and rounded once, which the epilogue must give
bit for bit on every rank; through eager launches and CUDA-graph replays mixed, so the epoch that picks
the slots stays in step. On two GPUs for real (skipped with fewer); on CPU, in Triton's interpreter,
one rank of two whose peer has already written its partials and raised its flags."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from labkit.kernels import gemv, gemv_silu_and_mul
from labkit.kernels.gemv_all_reduce import EPOCH_WRAP, GemvAllReduce, tiles_cap

CUDA = torch.cuda.is_available()
# (outputs, inputs, rows, the activation in the prologue): Llama-3-8B's o_proj and down_proj at
# tp_size 2, a narrow weight, a row count past one.
CASES = [(4096, 2048, 1, False), (4096, 7168, 1, True), (200, 96, 2, False), (576, 768, 2, True)]


def _product(x: torch.Tensor, w: torch.Tensor, act: bool, epilogue: GemvAllReduce | None = None) -> torch.Tensor:
    return (gemv_silu_and_mul if act else gemv)(x, w, None, all_reduce=epilogue)


def _inputs(n: int, k: int, rows: int, act: bool, gen: torch.Generator, dtype: torch.dtype, device: torch.device):
    x = torch.randn(rows, 2 * k if act else k, generator=gen, device=device).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) / k**0.5).to(dtype)
    return x, w


def test_one_rank_adds_its_peers_partials_in_rank_order_slot_by_slot(gen, device):
    """Rank 1 of 2 (the peer, rank 0, comes first in the sum), three launches from just before the
    epoch wraps: the slots alternate, the flags raised on the peer count the slot's uses, and the
    epoch counts launches."""
    world, rank, rows_cap, n_cap = 2, 1, 2, 256
    flags_cap = tiles_cap(rows_cap, n_cap, 4)
    partials = [torch.zeros(2, rows_cap, n_cap, device=device) for _ in range(world)]
    flags = [torch.zeros(2, world, flags_cap, dtype=torch.int32, device=device) for _ in range(world)]
    addresses = [torch.tensor([t.data_ptr() for t in ts], device=device) for ts in (partials, flags)]
    wrap = EPOCH_WRAP.value
    epoch = torch.tensor([wrap - 2, 0], dtype=torch.int32, device=device)
    epilogue = GemvAllReduce(rank, world, *addresses, epoch, rows_cap, n_cap, flags_cap)
    n, k = 200, 96
    tiles = -(-n // 8)
    for launch in (wrap - 2, wrap - 1, 0):
        slot, raised = launch % 2, launch // 2 + 1
        x, w = _inputs(n, k, 2, False, gen, torch.float32, device)
        peer = torch.randn(2, n, generator=gen, device=device)
        partials[0][slot, :, :n] = peer
        flags[rank][slot, 0, : 2 * tiles] = raised  # rank 0 raised its flags for both rows' tiles
        out = gemv(x, w, None, all_reduce=epilogue)
        assert torch.equal(out, peer + gemv(x, w))  # float32: (0 + peer) + own, the kernel's order
        assert (flags[0][slot, rank, : 2 * tiles] == raised).all() and not flags[0][slot, rank, 2 * tiles :].any()
        assert epilogue.epoch.tolist() == [(launch + 1) % wrap, 0]


def test_a_launch_the_buffers_cannot_hold_is_refused(gen, device):
    unused = torch.zeros(2, dtype=torch.int64, device=device)
    epilogue = GemvAllReduce(0, 2, unused, unused, torch.zeros(2, dtype=torch.int32, device=device), 1, 64, 16)
    x, w = _inputs(128, 32, 1, False, gen, torch.float32, device)
    with pytest.raises(ValueError, match="holds 1 rows of 64 outputs"):
        gemv(x, w, None, all_reduce=epilogue)
    with pytest.raises(ValueError, match="no bias"):
        gemv(x, w[:64], torch.zeros(64, device=device), all_reduce=epilogue)


def _rank(rank: int, addr: str, failures: mp.Queue) -> None:
    from torch import distributed as dist

    from labkit.distributed.parallel_state import destroy_tp_group, init_tp_group

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    tp = init_tp_group(rank, 2, addr, device, 60)
    try:
        why = tp.enable_custom_all_reduce(device, torch.bfloat16)
        if why is not None:
            raise RuntimeError(why)
        gen = torch.Generator(device).manual_seed(rank)

        def expected(x: torch.Tensor, w: torch.Tensor, act: bool) -> torch.Tensor:
            total = _product(x, w, act).float()
            dist.all_reduce(total, group=tp.group)
            return total.to(x.dtype)

        problems = []
        cases = [(*c, _inputs(*c, gen, torch.bfloat16, device)) for c in CASES]
        for n, k, rows, act, (x, w) in cases:  # eager
            if not torch.equal(_product(x, w, act, tp.gemv_all_reduce(x, n)), expected(x, w, act)):
                problems.append(f"eager {n}x{k}, {rows} rows")
        graph, outs = torch.cuda.CUDAGraph(), []
        with torch.cuda.graph(graph):
            outs = [_product(x, w, act, tp.gemv_all_reduce(x, n)) for n, k, rows, act, (x, w) in cases]
        for replay in range(5):
            for _, _, _, _, (x, _) in cases:
                x.copy_(torch.randn(x.shape, generator=gen, device=device))
            graph.replay()
            for (n, k, rows, act, (x, w)), out in zip(cases, outs):
                if not torch.equal(out, expected(x, w, act)):
                    problems.append(f"replay {replay}, {n}x{k}, {rows} rows")
            n, k, rows, act, (x, w) = cases[replay % len(cases)]  # an eager launch in between
            if not torch.equal(_product(x, w, act, tp.gemv_all_reduce(x, n)), expected(x, w, act)):
                problems.append(f"eager after replay {replay}")
        failures.put((rank, problems))
    finally:
        destroy_tp_group(tp)


@pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_ranks_get_the_unfused_sum_bit_for_bit_eager_and_replayed():
    from labkit.distributed.tp_worker import free_local_addr

    addr, ctx = free_local_addr(), mp.get_context("spawn")
    failures = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, addr, failures), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(failures.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
    assert results == {0: [], 1: []}
