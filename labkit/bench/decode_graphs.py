"""Device time of the captured decode CUDA graphs by batch size: the floor under a decode step of that
many requests, and under a speculative verify step of that many rows (a request's token and each
draft are a row each), however little the host does.

    python -m labkit.bench.decode_graphs [--model smollm2-135m] [--context 600] [--replays 50]
                                         [--rounds 3] [--batch-sizes 1 2 4 8 16 32 40 64]

A random-weight engine (bfloat16) captures its decode graphs up to the largest size asked for. Every
row of a batch then reads the same request slot, whose first --context positions hold KV slots of
their own, as a request of that context would; the runner's replay sets a graph's inputs, then the
graph is replayed --replays times back to back between two CUDA events, in --rounds rounds, and the
least round is kept (the device's time, apart from a shared machine's slow spells). Also the host's
cost, on an idle GPU, of launching a graph and of the runner's whole replay (input copies, padding,
split counts, launch, output copy).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from labkit import Engine
from labkit.model_executor.cuda_graph_runner import PAD_SLOT, CudaGraphRunner
from labkit.model_executor.forward_batch import ForwardBatch


def host_seconds(fn: Callable[[], object], times: int = 20) -> float:
    """Median host time of fn() started on an idle GPU."""
    spent = []
    for _ in range(times):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        spent.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(spent)


def device_seconds(fn: Callable[[], object], replays: int, rounds: int) -> float:
    """The least over `rounds` of the device time per call of `replays` calls back to back."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(rounds):
        start.record()
        for _ in range(replays):
            fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / replays)
    return best


def context_of(engine: Engine, context: int) -> tuple[int, torch.Tensor]:
    """A request slot whose first `context` positions hold KV slots of their own, from the pools
    (the caller frees them): what every row of the timed graphs reads."""
    runner = engine.model_runner
    taken = runner.req_to_token_pool.alloc(1)
    kv_slots = runner.token_to_kv_pool_allocator.alloc_extend([0], [context], [-1])
    if taken is None or kv_slots is None:
        raise SystemExit(f"the KV pool cannot hold a context of {context} tokens")
    runner.req_to_token_pool.write_row(taken[0], 0, kv_slots)
    return taken[0], kv_slots


def decode_batch(runner: CudaGraphRunner, bs: int, req_slot: int, context: int) -> ForwardBatch:
    """A DECODE batch of bs rows, each request slot `req_slot`'s next token at `context` tokens, its
    K/V written to the padding slot (the graphs' static batch of size bs for everything else)."""

    def rows(value: int) -> torch.Tensor:
        return torch.full((bs,), value, dtype=torch.int64, device=runner.device)

    return dataclasses.replace(
        runner.forward_batches[bs],
        input_ids=rows(0),
        positions=rows(context - 1),
        req_pool_indices=rows(req_slot),
        seq_lens=rows(context),
        out_cache_loc=rows(PAD_SLOT),
        seq_lens_cpu=[context] * bs,
    )


@torch.inference_mode()
def measure(runner: CudaGraphRunner, fb: ForwardBatch, replays: int, rounds: int) -> tuple[float, float, float]:
    """(device s per replay, host s per launch, host s per runner replay) of the graph of fb's size,
    its inputs set by the runner's replay of fb."""
    runner.replay(fb)
    graph = runner.graphs[fb.batch_size]
    for _ in range(5):
        graph.replay()
    return (
        device_seconds(graph.replay, replays, rounds),
        host_seconds(graph.replay),
        host_seconds(lambda: runner.replay(fb)),
    )


def main(argv: list[str] | None = None) -> list[tuple[int, float, float, float]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a data/configs name (random weights)")
    ap.add_argument("--context", type=int, default=600, help="tokens every row reads")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 24, 32, 40, 48, 64])
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_graphs times CUDA graphs: it needs a CUDA device")
    if args.context < 1 or min(args.batch_sizes) < 1:
        ap.error("--context and every batch size must be at least 1")
    engine = Engine(
        model_path=args.model,
        load_format="dummy",
        dtype="bfloat16",
        kv_memory_gb=2.0,
        max_running_requests=max(args.batch_sizes),
        cuda_graph_max_bs=max(args.batch_sizes),
    )
    runner = engine.model_runner.cuda_graph_runner
    if runner is None:
        raise SystemExit("the engine captured no decode graphs")
    req_slot, kv_slots = context_of(engine, args.context)
    print(
        f"== decode graphs, {args.model} (random bf16 weights), every row at {args.context} tokens, "
        f"{torch.cuda.get_device_name()}"
    )
    print("| rows | graph size | device us per replay | host us per launch | host us per runner replay |")
    print("| --- | --- | --- | --- | --- |")
    rows = []
    for bs in args.batch_sizes:
        padded = runner.padded_size(bs)
        fb = decode_batch(runner, padded, req_slot, args.context)
        device, launch, replay = measure(runner, fb, args.replays, args.rounds)
        rows.append((bs, device, launch, replay))
        print(f"| {bs} | {padded} | {device * 1e6:.1f} | {launch * 1e6:.1f} | {replay * 1e6:.1f} |", flush=True)
    engine.model_runner.token_to_kv_pool_allocator.free(kv_slots)
    engine.model_runner.req_to_token_pool.free(req_slot)
    engine.shutdown()
    return rows


if __name__ == "__main__":
    main()
