"""The all-reduce of a row-parallel GEMV in its epilogue: each program sums its tile over the ranks.

In a tensor-parallel decode step every o_proj and down_proj leaves a partial sum on each rank, and an
all-reduce adds them. As a kernel of its own that is a launch, a grid-wide barrier and a break in the
chain of programmatically dependent launches, per projection: on two H200s, Llama-3-8B's 65 one-shot
all-reduces took 0.45 ms of a 3.3 ms batch-1 step (docs/benchmarks.md). Here the GEMV's programs do it
as they finish their tiles, with nothing to wait for but the same tile on the other ranks:

1. write the tile's partial sums, rounded to the output dtype, into this rank's symmetric buffer;
2. raise this tile's flag on every other rank (a release store at system scope, after a barrier of
   the program's threads, so their stores are seen first);
3. wait until every other rank has raised its flag for the tile here (acquire), then add the ranks'
   partials in rank order, in float32, so every rank computes the same bits.

The buffers and flags live in torch's symmetric memory (labkit/distributed/custom_all_reduce.py
allocates them): each rank's are mapped into every other rank's address space, over NVLink.

A launch's flags and partials are those of one of two slots, by the parity of an epoch that counts
this rank's fused launches (modulo EPOCH_WRAP, so a server that decodes for days never overflows
it); a flag holds the number of times its slot was used, so nothing resets it, and that differs from
one use of a slot to the next, across the wrap too. Two slots suffice: a rank starts writing launch
e + 2's partials only after launch e + 1 has seen every other rank's flags for it, and a rank raises
those only after it has finished launch e (its kernels run in stream order, and a programmatically
dependent one writes only after its wait, which returns when the kernel ahead, and so every kernel
before it, has finished). The launch's last program to finish moves the epoch on (an arrival
counter, as the GEMV's split-K semaphores). Every rank must make the same sequence of fused
launches, which tensor parallelism's identical forwards do.

A program waits only for the programs of its own tile on the other ranks, which hold the same place
in the same grid; blocks are dispatched in order, so those are resident or finished when it waits."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

EPOCH_WRAP = tl.constexpr(1 << 30)  # even, so a launch's slot follows the parity across the wrap


@dataclass(frozen=True)
class GemvAllReduce:
    """What a GEMV launch needs to sum its outputs over the ranks of a tensor-parallel group on one
    machine: `buffers` and `flags` (int64 [world], on the device) hold the address of each rank's
    partials buffer (at least 2 x rows_cap x n_cap elements of 4 bytes) and flags buffer (int32,
    2 x world x tiles_cap, zero before the first launch) as mapped into this process; `epoch` (int32
    [2], zero at first) counts this rank's launches and the programs arrived in the current one."""

    rank: int
    world: int
    buffers: torch.Tensor
    flags: torch.Tensor
    epoch: torch.Tensor
    rows_cap: int
    n_cap: int
    tiles_cap: int

    def takes(self, rows: int, n: int) -> bool:
        """Whether a launch of `rows` rows of `n` outputs fits the buffers."""
        return rows <= self.rows_cap and n <= self.n_cap

    def launch_args(self, rows: int, n: int, tiles: int) -> tuple[list, dict]:
        """The kernel's arguments after its own and its constexprs, for rows x tiles programs."""
        if not self.takes(rows, n) or rows * tiles > self.tiles_cap:
            raise ValueError(
                f"the all-reduce epilogue holds {self.rows_cap} rows of {self.n_cap} outputs in "
                f"{self.tiles_cap} tiles, got {rows} rows of {n} in {tiles} tiles each"
            )
        args = [self.buffers, self.flags, self.epoch, self.rows_cap * self.n_cap, self.n_cap, self.tiles_cap]
        return args, {"RANK": self.rank, "WORLD": self.world}


def no_all_reduce(unused: torch.Tensor) -> tuple[list, dict]:
    """The arguments of a launch without the epilogue (`unused`, any tensor of the launch, is never read)."""
    return [unused, unused, unused, 0, 0, 0], {"RANK": 0, "WORLD": 1}


@triton.jit
def _flag(Flags, rank, slot, source, tile, tiles_cap, WORLD: tl.constexpr):
    """Rank `rank`'s flag for `tile` raised by rank `source`, in slot `slot`."""
    base = tl.load(Flags + rank).to(tl.pointer_type(tl.int32))
    return base + (slot * WORLD + source) * tiles_cap + tile


@triton.jit
def sum_over_ranks(
    part, offs_n, n_mask, Buffers, Flags, Epoch, slot_stride, row_stride, tiles_cap,
    RANK: tl.constexpr, WORLD: tl.constexpr,
):  # fmt: skip
    """This program's finished tile `part` (its outputs in the output dtype) summed over the ranks,
    in float32 (module docstring). Called once per (tile, row) program of the launch, after the
    program's wait for the kernel ahead."""
    row, tiles = tl.program_id(2), tl.num_programs(0)
    tile = row * tiles + tl.program_id(0)
    epoch = tl.load(Epoch, cache_modifier=".cg")
    slot = epoch % 2
    raised = epoch // 2 + 1  # the flag's value once its slot has been used this many times
    at = slot * slot_stride + row * row_stride
    tl.store(tl.load(Buffers + RANK).to(tl.pointer_type(part.dtype)) + at + offs_n, part, mask=n_mask)
    tl.debug_barrier()  # every thread's partials are written before the flags go up
    for r in tl.static_range(WORLD):
        if r != RANK:
            tl.atomic_xchg(_flag(Flags, r, slot, RANK, tile, tiles_cap, WORLD), raised, sem="release", scope="sys")
    for r in tl.static_range(WORLD):
        if r != RANK:
            flag = _flag(Flags, RANK, slot, r, tile, tiles_cap, WORLD)
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            while seen != raised:
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    tl.debug_barrier()  # every thread reads the other ranks' partials after the flags were seen
    total = part.to(tl.float32) * 0.0
    for r in tl.static_range(WORLD):
        if r == RANK:
            total += part.to(tl.float32)
        else:
            theirs = tl.load(Buffers + r).to(tl.pointer_type(part.dtype)) + at + offs_n
            total += tl.load(theirs, mask=n_mask, other=0.0, cache_modifier=".cv").to(tl.float32)
    tl.debug_barrier()
    if tl.atomic_add(Epoch + 1, 1, sem="acq_rel") == tiles * tl.num_programs(2) - 1:  # the launch's last
        tl.store(Epoch + 1, 0)
        tl.store(Epoch, (epoch + 1) % EPOCH_WRAP)
    return total


def tiles_cap(rows_cap: int, n_cap: int, min_block_n: int) -> int:
    """Flags a rank needs per slot and source for launches of up to rows_cap rows of n_cap outputs in
    tiles of at least min_block_n."""
    return rows_cap * triton.cdiv(n_cap, min_block_n)
