"""CustomAllReduce: the all-reduce of small CUDA tensors through torch's symmetric memory, for ranks
on one machine (SGLang and vLLM keep a custom all-reduce beside NCCL for the same reason).

Each rank holds one buffer that every other rank of the group can read over NVLink. A "one-shot"
all-reduce copies the local tensor into it and, once all ranks have (a barrier in the kernel), every
rank reads all the buffers and sums them. For the few-kilobyte tensors of a decode step that is
latency, not bandwidth: measured on two H200s, about 8 us per all-reduce replayed from a CUDA graph,
against 19 us for NCCL's captured all-reduce. It also keeps NCCL out of the decode graphs: after
torch had captured NCCL collectives, leaving the process group hung (pytorch/pytorch#115388; seen
here too, docs/benchmarks.md).

Tensors larger than the buffer (prefill chunks) go to NCCL, eagerly.

Where a row-parallel layer's product runs through labkit's GEMV kernel (one or two rows), the sum
over the ranks is instead the kernel's epilogue (kernels/gemv_all_reduce.py), through buffers and
flags of its own here: no all-reduce launch at all. LABKIT_GEMV_ALL_REDUCE=0 in the environment (read
at import) keeps those on the all-reduce kernel, for A/B runs.

One per process: torch's symmetric-memory rendezvous numbers its exchanges with a counter of the
process, so a second group made in the same process (a notebook's second Engine(tp_size=2): rank 0
stays, the followers are new processes) would wait on keys the new followers never write. That
group runs on NCCL alone (and without decode graphs), as the warning says."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

MAX_BYTES = 8 << 20  # a decode batch of 1024 at hidden size 4096 in bf16; more goes to NCCL
GEMV_EPILOGUE = os.environ.get("LABKIT_GEMV_ALL_REDUCE", "1") != "0"
EPILOGUE_MAX_N = 16384  # outputs of a row-parallel layer (the hidden size) the GEMV epilogue takes


_made_in_this_process = False


def available_in_this_process() -> bool:
    """False once a CustomAllReduce was made here (see the module docstring)."""
    return not _made_in_this_process


class CustomAllReduce:
    """All-reduce (sum) of tensors of one dtype up to `max_bytes`, on the group's ranks of one machine.
    Construction is collective (every rank, same arguments) and raises RuntimeError when the devices
    cannot map each other's memory."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, max_bytes: int = MAX_BYTES):
        from torch.distributed import _symmetric_memory as symm_mem

        global _made_in_this_process
        _made_in_this_process = True
        self.group_name = group.group_name
        self.buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        self.gemv_epilogue = self._gemv_epilogue(symm_mem, group, device) if GEMV_EPILOGUE else None

    def can_run(self, x: torch.Tensor) -> bool:
        return x.device == self.buffer.device and x.dtype == self.buffer.dtype and x.numel() <= self.buffer.numel()

    def _gemv_epilogue(self, symm_mem: Any, group: dist.ProcessGroup, device: torch.device) -> Any:
        """The GEMV epilogue's partials and flags (labkit.kernels.gemv_all_reduce.GemvAllReduce)."""
        from labkit.kernels import gemv_max_rows
        from labkit.kernels.gemv_all_reduce import GemvAllReduce, tiles_cap

        world, rows = dist.get_world_size(group), gemv_max_rows()
        # 4: the narrowest tile gemv picks (its TALL_TILE); a launch of narrower ones is refused.
        flags_per_source = tiles_cap(rows, EPILOGUE_MAX_N, min_block_n=4)
        partials = symm_mem.empty(2 * rows * EPILOGUE_MAX_N, dtype=torch.float32, device=device)
        flags = symm_mem.empty(2 * world * flags_per_source, dtype=torch.int32, device=device).zero_()
        torch.cuda.synchronize(device)  # zero before any other rank can learn where they are
        self._epilogue_memory = (partials, flags)  # the kernel holds only their addresses
        addresses = [symm_mem.rendezvous(t, group.group_name).buffer_ptrs for t in (partials, flags)]
        buffers, flag_buffers = (torch.tensor(a, dtype=torch.int64, device=device) for a in addresses)
        epoch = torch.zeros(2, dtype=torch.int32, device=device)
        rank = dist.get_rank(group)
        return GemvAllReduce(rank, world, buffers, flag_buffers, epoch, rows, EPILOGUE_MAX_N, flags_per_source)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks, as a new tensor of x's shape (x is left as it was)."""
        flat = x.reshape(-1)
        out = torch.ops.symm_mem.one_shot_all_reduce_copy(self.buffer[: flat.numel()], flat, "sum", self.group_name)
        return out.view(x.shape)
