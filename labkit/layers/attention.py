"""The model-side attention layer: a thin handle that forwards to the batch's attention backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from labkit.attention.base import AttentionLayerSpec

if TYPE_CHECKING:
    from labkit.model_executor.forward_batch import ForwardBatch


class Attention(nn.Module):
    """Paged attention for one layer. q [T, H*D], k, v [T, H_kv*D] -> [T, H*D]; k and v None where
    the layer wrote them into the pool itself (AttentionBackend.takes_stored_kv)."""

    def __init__(
        self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float | None = None
    ) -> None:
        super().__init__()
        self.spec = AttentionLayerSpec(
            layer_id=layer_id,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            scaling=head_dim**-0.5 if scaling is None else scaling,
        )
        # The backend call as compiled graphs see it: set by compile_with_eager_attention.
        self.backend_forward_outside_graphs: Callable[..., torch.Tensor] | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        s = self.spec
        call = _backend_forward
        if torch.compiler.is_compiling() and self.backend_forward_outside_graphs is not None:
            call = self.backend_forward_outside_graphs
        kv_shape = (-1, s.num_kv_heads, s.head_dim)
        return call(
            q.view(-1, s.num_heads, s.head_dim),
            None if k is None else k.view(kv_shape),
            None if v is None else v.view(kv_shape),
            s,
            forward_batch,
        )


# --enable-torch-compile compiles what lies between the attention calls (norms, rotary, MLP); the
# backends run their own kernels and keep Python state (metadata, per-request loops) that
# torch.compile would only guard on and recompile for.
def _backend_forward(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    spec: AttentionLayerSpec,
    forward_batch: ForwardBatch,
) -> torch.Tensor:
    return forward_batch.attn_backend.forward(q, k, v, spec, forward_batch)


def compile_with_eager_attention(model: nn.Module) -> Callable[..., torch.Tensor]:
    """torch.compile(model), with every Attention layer's backend call left out of the graphs. The
    exclusion (torch.compiler.disable) is made here rather than as a decorator because it imports
    torch._dynamo: about a second of start-up in every process (the server's three included) that
    only a compiling engine needs. It must exist before any trace: it cannot be made inside one."""
    outside_graphs = torch.compiler.disable(_backend_forward)
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend_forward_outside_graphs = outside_graphs
    return torch.compile(model)
