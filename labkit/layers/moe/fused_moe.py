"""FusedMoE: every expert's MLP of one layer as two stacked weights, sharded over the ranks.

Expert parallelism (ep_size ranks): each rank holds num_experts / ep_size whole experts. The ranks
that share an expert range (tp_size / ep_size of them) split each expert's intermediate features as
the dense MLP does. Dispatch and combine: attention is tensor-parallel, so after it every rank already
holds every token; a rank runs its own experts on the tokens routed to them (the others' expert ids
are masked to -1) and one all-reduce sums the partial outputs, as the dense MLP's row-parallel layer
does. An all-to-all would move fewer bytes only when ranks hold different tokens (data-parallel
attention), which labkit does not have, so the all-reduce is both simpler and no slower here.

On CUDA the forward is labkit.kernels.fused_moe (sorted, block-padded tokens and two grouped GEMMs);
elsewhere the plain torch loop over the experts that received tokens."""

from __future__ import annotations

import torch
from torch import nn

from labkit.distributed.parallel_state import TPGroup
from labkit.layers.fused import triton_kernels, use_triton_kernels
from labkit.layers.moe.torch_path import fused_moe_torch


class ExpertWeights(nn.Module):
    """One stacked weight [local experts, out_local, in_local] of the full [E, out, in], whose out
    (split_dim 1: gate|up blocks, each split) or in (split_dim 2) features are split over the ranks
    sharing an expert range."""

    def __init__(self, experts: range, full_shape: tuple[int, int, int], blocks: int, split_dim: int, part: range):
        super().__init__()
        self.experts, self.blocks, self.split_dim, self.part = experts, blocks, split_dim, part
        self.full_shape = full_shape
        shape = list(full_shape)
        shape[0] = len(experts)
        shape[split_dim] = blocks * len(part)
        self.weight = nn.Parameter(torch.empty(shape), requires_grad=False)

    def load(self, param: nn.Parameter, full: torch.Tensor, shard_id: int | None = None) -> None:
        """`full`: the whole stacked tensor [E, out, in] (shard_id None)."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"stacked experts: checkpoint shape {tuple(full.shape)} != {self.full_shape}")
        for local, expert in enumerate(self.experts):
            self._copy(param.data[local], full[expert], None)

    def load_expert(self, expert: int, full: torch.Tensor, block: int | None) -> bool:
        """Copy one expert's HF tensor ([out, in], or block `block` of the fused gate|up); False if
        this rank does not hold that expert."""
        if expert not in self.experts:
            return False
        self._copy(self.weight.data[expert - self.experts.start], full, block)
        return True

    def _copy(self, dst: torch.Tensor, full: torch.Tensor, block: int | None) -> None:
        dim = self.split_dim - 1  # within one expert's [out, in]
        pieces = range(self.blocks) if block is None else [block]
        block_len = self.full_shape[self.split_dim] // self.blocks
        for b in pieces:
            src = full if block is not None else full.narrow(dim, b * block_len, block_len)
            if src.shape[dim] != block_len or src.shape[1 - dim] != dst.shape[1 - dim]:
                raise ValueError(f"expert weight: checkpoint shape {tuple(src.shape)} does not fit {self.full_shape}")
            dst.narrow(dim, b * len(self.part), len(self.part)).copy_(src.narrow(dim, self.part.start, len(self.part)))


class FusedMoE(nn.Module):
    """The experts of one MoE layer: forward(hidden [T, H], topk_weights, topk_ids) -> [T, H], the
    routed sum over every rank's experts (all-reduced over the group)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup) -> None:
        super().__init__()
        ep = tp.ep_size
        if num_experts % ep:
            raise ValueError(f"ep_size {ep} does not divide the model's {num_experts} experts")
        moe_tp = tp.size // ep
        if intermediate % moe_tp:
            raise ValueError(f"tp_size / ep_size = {moe_tp} does not divide the experts' {intermediate} features")
        ep_rank, moe_rank = divmod(tp.rank, moe_tp)
        per_rank, inter_local = num_experts // ep, intermediate // moe_tp
        self.tp, self.num_experts = tp, num_experts
        self.local = range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
        part = range(moe_rank * inter_local, (moe_rank + 1) * inter_local)
        self.w13 = ExpertWeights(self.local, (num_experts, 2 * intermediate, hidden), 2, 1, part)
        self.w2 = ExpertWeights(self.local, (num_experts, hidden, intermediate), 1, 2, part)

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if len(self.local) != self.num_experts:  # another rank's experts: masked out here
            local_ids = topk_ids - self.local.start
            topk_ids = torch.where((local_ids >= 0) & (local_ids < len(self.local)), local_ids, -1)
        if use_triton_kernels(hidden):
            out = triton_kernels().fused_moe(hidden, self.w13.weight, self.w2.weight, topk_weights, topk_ids)
        else:
            out = fused_moe_torch(hidden, self.w13.weight, self.w2.weight, topk_weights, topk_ids)
        return self.tp.all_reduce(out)
