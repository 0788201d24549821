"""Programmatic dependent launch (PDL, Hopper and later): a kernel may start before the one ahead of
it in the stream has finished, and waits for it (griddepcontrol.wait) only where it first needs what
that kernel wrote.

A batch-1 decode step is a chain of a few hundred kernels of a few microseconds each, where a
kernel's launch and ramp-up cost about as much as its work. With PDL the next kernel's programs are
resident and waiting when the current one ends, and a projection streams its weights (which no
kernel writes) before it waits. The contract of a kernel launched with pdl_options:
- nothing written by the kernel ahead is read, and nothing is written, before `pdl_wait`; the wait
  returns once the kernel ahead has finished and its writes are visible. That kernel let this one
  launch only after its own wait, so every kernel before it has finished by this one's start: what
  they wrote may be read before the wait, from L2 (.cg loads skip the multiprocessor's L1). Decode
  attention reads the older K/V rows that way (kernels/decode.py, prefetch);
- after the wait (pdl_wait), or later (pdl_wait_only, then pdl_launch_dependents), it lets the next
  kernel launch; its programs then wait in turn, resident. Later suits a kernel whose next one can
  do nothing before its wait (decode attention after the fused qkv kernel): launched early, that
  kernel's waiting programs slowed the fused kernel by about 1 us a layer (docs/benchmarks.md).

Under PDL a kernel's time in a profile includes its wait for the kernel ahead; LABKIT_DISABLE_PDL=1
in the environment (read at import) launches every kernel plainly, for per-kernel times
(`LABKIT_DISABLE_PDL=1 python -m labkit.bench.profile_step ...`)."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl

PDL_MAX_TOKENS = 256  # the largest decode batch captured in a CUDA graph by default
ENABLED = os.environ.get("LABKIT_DISABLE_PDL", "0") != "1"


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_options(device: torch.device, tokens: int) -> dict[str, Any]:
    """The launch options of a PDL-aware kernel over `tokens` tokens (its PDL constexpr, Triton's
    launch_pdl): on for decode-sized launches (at most PDL_MAX_TOKENS) on CUDA devices of compute
    capability 9.0 or more, off elsewhere (the interpreter included). A prefill-sized launch has
    thousands of programs that, launched early, wait on multiprocessors the kernel ahead still
    needs: with PDL on every launch, the prefill steps of the 256-sequence offline run took 25.8 ms
    of GPU time each against 16.7 with it off (H200, docs/benchmarks.md)."""
    if not ENABLED or tokens > PDL_MAX_TOKENS or device.type != "cuda":
        return {"PDL": False}
    if _capable(device.index if device.index is not None else torch.cuda.current_device()):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the kernel ahead (a no-op without PDL), then let the next one launch."""
    pdl_wait_only(PDL)
    pdl_launch_dependents(PDL)


@triton.jit
def pdl_wait_only(PDL: tl.constexpr):
    """Wait for the kernel ahead (a no-op without PDL); the next one launches at pdl_launch_dependents,
    or once this kernel's programs have all exited."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_launch_dependents(PDL: tl.constexpr):
    """Let the next kernel launch (once every program of this one has called this or exited)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
