"""Tensor-parallel linear layers (Megatron's split, SGLang's names).

A column-parallel layer splits the output features over the ranks (each rank computes its slice,
no communication); a row-parallel layer splits the input features (each rank computes a partial sum,
then an all-reduce adds them). Attention is column (q/k/v heads) then row (o_proj); the MLP is
column (gate/up) then row (down): one all-reduce per block.

Every weight is loaded through its layer's `load(param, full, shard_id)`, which takes the full,
unsharded tensor (a HF checkpoint tensor, or a random one for dummy weights) and copies this rank's
slice, so no rank ever holds more than one full tensor at a time. With one rank they are plain
linear layers."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from labkit.distributed.parallel_state import TPGroup, split_evenly
from labkit.layers.activation import SiluAndMul
from labkit.layers.fused import triton_kernels, use_triton_kernels
from labkit.layers.rmsnorm import RMSNorm


class LinearBase(nn.Module):
    """y = x W^T (+ b) with this rank's W [out_local, in_local]. `full_shape` is the unsharded
    weight's shape; subclasses say which slice of it this rank holds."""

    def __init__(self, in_local: int, out_local: int, bias: bool, tp: TPGroup, full_shape: tuple[int, int]):
        super().__init__()
        self.tp = tp
        self.full_shape = full_shape
        self.weight = nn.Parameter(torch.empty(out_local, in_local), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False) if bias else None
        self._gemv_split: Any = None  # labkit.kernels.gemv.Split with this layer's semaphores

    def gemv_split(self, x: torch.Tensor) -> Any:
        """This layer's split-K state for the GEMV kernel (labkit.kernels.gemv.Split): semaphores
        of its own, made zero on first use on x's device and left zero by every launch."""
        split = self._gemv_split
        if split is None or split.semaphores.device != x.device:
            kernels = triton_kernels()
            count = kernels.gemv_semaphore_count(self.weight.shape[0])
            split = kernels.GemvSplit(semaphores=torch.zeros(count, dtype=torch.int32, device=x.device))
            self._gemv_split = split
        return split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def gemv_takes(self, x: torch.Tensor, width: int) -> bool:
        """Whether x goes through labkit's GEMV kernel: up to its MAX_ROWS 16-bit rows (of `width`
        features) on CUDA. On an H200 the kernel beat cuBLAS on every batch-1 decode projection
        measured, and at two rows on seven of the eight SmolLM2 and Qwen3-0.6B projections timed (the
        eighth fuses the norm cuBLAS runs apart; docs/benchmarks.md). Tall weights such as Qwen2.5's
        down_proj, 4864 -> 896, split along K at one row."""
        if x.shape[-1] != width or x.dtype == torch.float32 or self.weight.stride(1) != 1:
            return False
        return width <= x.numel() <= width * triton_kernels().gemv_max_rows() and use_triton_kernels(x)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, act: SiluAndMul | None = None) -> torch.Tensor:
        """act(x) W^T (+ bias) (act: the gated MLP's activation, or none): through the GEMV kernel
        where it takes the row (with the activation in its prologue), else through F.linear."""
        in_features = self.weight.shape[1]
        if act is not None:
            if self.gemv_takes(x, 2 * in_features):
                return self.gemv(x, bias, act)
            x = act(x)
        if self.gemv_takes(x, in_features):
            return self.gemv(x, bias, None)
        return F.linear(x, self.weight, bias)

    def gemv(
        self, x: torch.Tensor, bias: torch.Tensor | None, act: SiluAndMul | None, all_reduce: Any = None
    ) -> torch.Tensor:
        """act(x) W^T (+ bias) through the GEMV kernel (gemv_takes said yes), with the activation in
        its prologue and, given `all_reduce` (TPGroup.gemv_all_reduce's), summed over the ranks."""
        kernels = triton_kernels()
        fn = kernels.gemv if act is None else kernels.gemv_silu_and_mul
        return fn(x, self.weight, bias, self.gemv_split(x), all_reduce)

    def load(self, param: nn.Parameter, full: torch.Tensor, shard_id: int | None = None) -> None:
        """Copy this rank's slice of `full` (the whole parameter, or block `shard_id` of a fused one)."""
        raise NotImplementedError


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: checkpoint slice shape {tuple(src.shape)} != {tuple(dst.shape)}")
    dst.copy_(src)


class ColumnParallelLinear(LinearBase):
    """Output features split over the ranks, in blocks: a fused layer (gate|up, q|k|v) is several
    blocks, each split on its own so that every rank holds a slice of each. `block_slices[i]` is
    (start, length) of this rank's rows within full block i; they are stacked in block order."""

    def __init__(self, in_features: int, block_sizes: list[int], bias: bool, tp: TPGroup):
        slices = self.rank_slices(block_sizes, tp)
        super().__init__(in_features, sum(n for _, n in slices), bias, tp, (sum(block_sizes), in_features))
        self.block_sizes = block_sizes
        self.block_slices = slices

    def rank_slices(self, block_sizes: list[int], tp: TPGroup) -> list[tuple[int, int]]:
        """Even split of each block (ValueError if a block does not divide)."""
        out = []
        for size in block_sizes:
            n = split_evenly(size, tp.size, "output features")
            out.append((tp.rank * n, n))
        return out

    def load(self, param: nn.Parameter, full: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None and len(self.block_sizes) > 1:  # the whole fused tensor: block by block
            for i, block in enumerate(full.split(self.block_sizes, dim=0)):
                self.load(param, block, i)
            return
        i = shard_id or 0
        offset = sum(n for _, n in self.block_slices[:i])
        start, n = self.block_slices[i]
        if full.shape[0] != self.block_sizes[i]:
            raise ValueError(f"block {i}: checkpoint rows {full.shape[0]} != {self.block_sizes[i]}")
        _copy(param.data.narrow(0, offset, n), full.narrow(0, start, n), type(self).__name__)

    def forward_normed(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual) W^T (+ b), x + residual), or (norm(x) W^T (+ b), x) without a
        residual: a decoder layer's norm and the projection after it. Where the GEMV kernel takes
        the row, one kernel (the norm in its prologue) instead of two."""
        if self.gemv_takes(x, self.weight.shape[1]):
            kernels = triton_kernels()
            return kernels.gemv_rmsnorm(x, residual, norm.weight, norm.eps, self.weight, self.bias, self.gemv_split(x))
        normed, residual = norm.add_and_norm(x, residual)
        return self(normed), residual


class MergedColumnParallelLinear(ColumnParallelLinear):
    """gate_proj and up_proj as one matmul: blocks [gate, up], each split over the ranks."""


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections as one matmul. The query heads are split over the ranks; the KV heads
    too when there are at least as many as ranks, otherwise each is replicated on tp_size / num_kv_heads
    ranks (each rank keeps the one KV head its query heads attend to)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, tp: TPGroup):
        self.num_heads = split_evenly(num_heads, tp.size, "query heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = split_evenly(num_kv_heads, tp.size, "KV heads")
            kv_head = tp.rank * self.num_kv_heads
        else:
            if tp.size % num_kv_heads:
                raise ValueError(
                    f"tp_size {tp.size} is neither a divisor nor a multiple of the {num_kv_heads} KV heads"
                )
            self.num_kv_heads = 1
            kv_head = tp.rank * num_kv_heads // tp.size
        self.head_dim = head_dim
        self._kv_start = kv_head * head_dim
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden, [q, kv, kv], bias, tp)

    def rank_slices(self, block_sizes: list[int], tp: TPGroup) -> list[tuple[int, int]]:
        q_n, kv_n = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [(tp.rank * q_n, q_n), (self._kv_start, kv_n), (self._kv_start, kv_n)]


class RowParallelLinear(LinearBase):
    """Input features split over the ranks; the partial products are summed by an all-reduce (the
    bias is added once, after it)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup):
        self.in_local = split_evenly(in_features, tp.size, "input features")
        super().__init__(self.in_local, out_features, bias, tp, (out_features, in_features))

    def forward(self, x: torch.Tensor, act: SiluAndMul | None = None) -> torch.Tensor:
        """act(x) W^T (+ b), act applied to this rank's slice of x (see matmul). Where the GEMV kernel
        takes the rows, the sum over the ranks is its epilogue (no all-reduce launch) when the group
        has one for them."""
        if self.tp.size == 1:
            return self.matmul(x, self.bias, act)
        width = self.in_local * (1 if act is None else 2)
        epilogue = self.tp.gemv_all_reduce(x, self.weight.shape[0]) if self.gemv_takes(x, width) else None
        if epilogue is not None:
            out = self.gemv(x, None, act, epilogue)
        else:
            out = self.tp.all_reduce(self.matmul(x, None, act))
        return out if self.bias is None else out + self.bias

    def load(self, param: nn.Parameter, full: torch.Tensor, shard_id: int | None = None) -> None:
        if param.dim() == 1:  # the bias is whole on every rank
            _copy(param.data, full, type(self).__name__)
            return
        _copy(param.data, full.narrow(1, self.tp.rank * self.in_local, self.in_local), type(self).__name__)
