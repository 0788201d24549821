"""Timings of fused_moe on a CUDA device against its memory floor, at Qwen3-30B-A3B's MoE shapes
(128 experts, top-8, hidden 2048, expert intermediate 768, bfloat16).

    python -m labkit.kernels.bench_moe                  # one table
    python -m labkit.kernels.bench_moe --tune           # also the best of a grid of tile configs per T
    python -m labkit.kernels.bench_moe --tune --tokens 1,16

Routing comes from top-k of random logits (softmax weights renormalized over the k, as Qwen3 does),
so the experts a batch touches are as many as a real router's: at T tokens about
E * (1 - (1 - k/E)^T). At these sizes the layer is bound by reading the active experts' weights:
floor = (bytes of the distinct active experts' w13 + w2, each read once, + hidden in and out) /
measured copy bandwidth. FLOP = 2 * T * k * 3 * H * I (the gate/up product 2 * Tk * 2I * H, the down
product 2 * Tk * H * I). Each timed call cycles through ROUTINGS different routings, so successive
calls touch different experts, as successive layers read different weights: a replay does not find
the last one's weights in L2. fused_moe is timed as CUDA-graph replays (as the engine's decode runs
it) and eagerly; the torch reference (the CPU path, a loop over the active experts) eagerly."""

from __future__ import annotations

import argparse
import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
from triton.runtime.errors import OutOfResources

from labkit.kernels.bench import measure_ceilings
from labkit.kernels.fused_moe import default_config, fused_moe
from labkit.kernels.reference import reference_fused_moe

TOKENS = (1, 16, 64, 256)
ROUTINGS = 8


@dataclass(frozen=True)
class MoEShape:
    num_experts: int
    hidden: int
    inter: int
    top_k: int


QWEN3_30B_A3B = MoEShape(num_experts=128, hidden=2048, inter=768, top_k=8)
SMOKE = MoEShape(num_experts=8, hidden=64, inter=32, top_k=2)


@dataclass
class Problem:
    hidden: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    routings: list[tuple[torch.Tensor, torch.Tensor]]  # (topk_weights float32, topk_ids int32) each

    def run(self, config: dict[str, int] | None = None) -> torch.Tensor:
        """fused_moe once per routing (the last output returned)."""
        for weights, ids in self.routings:
            out = fused_moe(self.hidden, self.w13, self.w2, weights, ids, config=config)
        return out

    def floor_bytes(self) -> float:
        """Mean bytes one call must move: its distinct active experts' weights, hidden in and out."""
        per_expert = (self.w13[0].numel() + self.w2[0].numel()) * self.w13.element_size()
        active = sum(ids.unique().numel() for _, ids in self.routings) / len(self.routings)
        return active * per_expert + 2 * self.hidden.numel() * self.hidden.element_size()


def make_problem(shape: MoEShape, num_tokens: int, dtype: torch.dtype, device: torch.device) -> Problem:
    g = torch.Generator(device).manual_seed(num_tokens)
    e, h, i = shape.num_experts, shape.hidden, shape.inter
    hidden = torch.randn(num_tokens, h, generator=g, device=device).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g, device=device) * h**-0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g, device=device) * i**-0.5).to(dtype)
    routings = []
    for _ in range(ROUTINGS):
        probs = torch.randn(num_tokens, e, generator=g, device=device).softmax(-1)
        weights, ids = probs.topk(shape.top_k, dim=-1)
        routings.append((weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)))
    return Problem(hidden, w13, w2, routings)


def _graph_ms(fn: Callable[[], object]) -> float:
    fn()  # compile outside the capture
    return triton.testing.do_bench_cudagraph(fn, return_mode="median")


def _eager_ms(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, return_mode="median")


def _once_ms(fn: Callable[[], object]) -> float:
    """--cpu-smoke: one wall-clock run (the interpreter), to exercise the code path, not to time it."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def bench(shape: MoEShape, tokens: list[int], dtype: torch.dtype, device: torch.device, smoke: bool) -> None:
    if smoke:
        bw, peak = 3e12, 800e12  # nominal: nothing is timed
        graph_ms = eager_ms = _once_ms
    else:
        bw, peak = measure_ceilings(device)
        graph_ms, eager_ms = _graph_ms, _eager_ms
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter smoke run)"
    print(f"{name}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s")
    print(f"E={shape.num_experts} k={shape.top_k} H={shape.hidden} I={shape.inter} {dtype}, medians (ms per call)")
    print(
        f"{'T':>5} {'experts':>7} {'graph':>8} {'eager':>8} {'floor':>8} {'x floor':>7} "
        f"{'TB/s':>6} {'TFLOP/s':>7} {'torch ref':>9} {'rel err':>7}  config"
    )
    for t in tokens:
        p = make_problem(shape, t, dtype, device)
        weights, ids = p.routings[-1]
        want = reference_fused_moe(p.hidden, p.w13, p.w2, weights, ids).float()
        err = ((p.run().float() - want).norm() / want.norm()).item()  # run()'s output is the last routing's
        ms = graph_ms(p.run) / len(p.routings)
        eager = eager_ms(p.run) / len(p.routings)
        ref = eager_ms(functools.partial(reference_fused_moe, p.hidden, p.w13, p.w2, weights, ids))
        nbytes = p.floor_bytes()
        floor = nbytes / bw * 1e3
        flop = 2 * t * shape.top_k * 3 * shape.hidden * shape.inter
        active = nbytes / ((p.w13[0].numel() + p.w2[0].numel()) * p.w13.element_size())
        cfg = default_config(t)
        layout = "sorted" if cfg["SORTED"] else "unsorted"
        print(
            f"{t:>5} {active:>7.1f} {ms:>8.4f} {eager:>8.4f} {floor:>8.4f} {ms / floor:>7.2f} "
            f"{nbytes / ms / 1e9:>6.2f} {flop / ms / 1e9:>7.1f} {ref:>9.3f} {err:>7.1e}  "
            f"{layout} M{cfg['BLOCK_SIZE_M']} N{cfg['BLOCK_SIZE_N']} K{cfg['BLOCK_SIZE_K']} G{cfg['GROUP_SIZE_M']} "
            f"w{cfg['num_warps']} s{cfg['num_stages']}"
        )


def tune_grid(num_tokens: int) -> list[dict[str, int]]:
    """Candidate configs for num_tokens: block layouts and heights suited to the batch (unsorted only
    for decode sizes), tile widths, depths and pipelining around default_config's."""
    if num_tokens <= 16:  # (SORTED, BLOCK_SIZE_M, GROUP_SIZE_M)
        layouts = [(0, 16, 64), (1, 16, 1)]
    elif num_tokens <= 64:
        layouts = [(1, 16, 1), (1, 32, 4)]
    else:
        layouts = [(1, 32, 4), (1, 64, 8)]
    return [
        {
            "SORTED": layout,
            "BLOCK_SIZE_M": m,
            "BLOCK_SIZE_N": n,
            "BLOCK_SIZE_K": k,
            "GROUP_SIZE_M": group,
            "num_warps": w,
            "num_stages": s,
        }
        for (layout, m, group), n, k, (w, s) in itertools.product(
            layouts, (32, 64, 128), (64, 128, 256), ((4, 3), (4, 4), (8, 4))
        )
    ]


def tune(shape: MoEShape, tokens: list[int], dtype: torch.dtype, device: torch.device, smoke: bool) -> None:
    """Time every tune_grid config (graph replays) per T; print the five best and the default."""
    timer = _once_ms if smoke else _graph_ms
    for t in tokens:
        p = make_problem(shape, t, dtype, device)
        results = []
        grid = tune_grid(t)[:2] if smoke else tune_grid(t)
        for cfg in grid:
            try:
                results.append((timer(functools.partial(p.run, cfg)) / len(p.routings), cfg))
            except OutOfResources:
                continue  # the tiles do not fit in shared memory
        results.sort(key=lambda r: r[0])
        default = timer(p.run) / len(p.routings)
        print(f"T={t}: default {default:.4f} ms {default_config(t)}")
        for ms, cfg in results[:5]:
            print(f"  {ms:.4f} ms ({default / ms:.2f}x) {cfg}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tune", action="store_true", help="also search a grid of tile configs per T")
    parser.add_argument(
        "--tokens",
        type=lambda s: [int(x) for x in s.split(",")],
        default=list(TOKENS),
        help="comma-separated batch sizes (default: %(default)s)",
    )
    # Tiny shapes through the interpreter: checks the script's logic on a machine without a GPU.
    parser.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        shape, dtype, device = SMOKE, torch.float32, torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA device")
        shape, dtype, device = QWEN3_30B_A3B, torch.bfloat16, torch.device("cuda")
    bench(shape, args.tokens, dtype, device, args.cpu_smoke)
    if args.tune:
        tune(shape, args.tokens, dtype, device, args.cpu_smoke)


if __name__ == "__main__":
    main()
