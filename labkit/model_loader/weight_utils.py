"""Filling one parameter from its full tensor: tensor-parallel layers take their rank's slice
(each parallel layer's `load`), every other parameter is copied whole."""

from __future__ import annotations

import torch
from torch import nn


def owner_of(model: nn.Module, param_name: str) -> nn.Module:
    return model.get_submodule(param_name.rpartition(".")[0])


def full_shape_of(model: nn.Module, param_name: str, param: nn.Parameter) -> tuple[int, ...]:
    """The unsharded shape of a parameter (a parallel layer's bias is its weight's first dimension)."""
    shape = getattr(owner_of(model, param_name), "full_shape", None)
    if shape is None:
        return tuple(param.shape)
    return tuple(shape) if param_name.endswith("weight") else (shape[0],)


@torch.no_grad()
def load_param(
    model: nn.Module, param_name: str, param: nn.Parameter, full: torch.Tensor, block: int | None = None
) -> None:
    """Copy this rank's part of `full` (the whole parameter, or block `block` of a fused one) into it."""
    owner = owner_of(model, param_name)
    load = getattr(owner, "load", None)
    if load is not None:
        load(param, full, block)
        return
    if param.shape != full.shape:
        raise ValueError(f"{param_name}: checkpoint shape {tuple(full.shape)} != {tuple(param.shape)}")
    param.data.copy_(full)
