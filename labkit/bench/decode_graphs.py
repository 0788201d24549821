"""Device time of the captured decode CUDA graphs by batch size: the floor under a decode step of that
many requests, and under a speculative verify step of that many rows (a request's token and each
draft are a row each), however little the host does.

    python -m labkit.bench.decode_graphs [--model smollm2-135m] [--context 600] [--replays 50]
                                         [--rounds 3] [--batch-sizes 1 2 4 8 16 32 40 64]

A random-weight engine (bfloat16) captures its decode graphs up to the largest size asked for. Every
row of the static buffers then reads the same request slot, whose first --context positions hold
distinct KV slots, as a request of that context would; each graph is replayed --replays times back
to back between two CUDA events, in --rounds rounds, and the least round is kept (the device's time,
apart from a shared machine's slow spells). Also the host's cost, on an idle GPU, of launching a
graph and of the runner's whole replay (input copies, padding, split counts, launch, output copy).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from labkit import Engine
from labkit.model_executor.cuda_graph_runner import CudaGraphRunner


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


@torch.inference_mode()
def measure(runner: CudaGraphRunner, bs: int, context: int, replays: int, rounds: int) -> tuple[float, float, float]:
    """(device s per replay, host s per launch, host s per runner replay) of the graph of size bs, its
    rows at `context` tokens of request slot 0."""
    fb = runner.forward_batches[bs]
    fb.seq_lens_cpu = [context] * bs
    runner.seq_lens[:bs].fill_(context)
    runner.positions[:bs].fill_(context - 1)
    runner.req_pool_indices[:bs].zero_()
    runner.attn_backend.init_forward_metadata_replay_cuda_graph(fb)
    graph = runner.graphs[bs]
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
    slots = torch.arange(1, args.context + 1, dtype=torch.int64)  # slot 0 is the padding rows'
    engine.model_runner.req_to_token_pool.write_row(0, 0, slots)
    print(
        f"== decode graphs, {args.model} (random bf16 weights), every row at {args.context} tokens, "
        f"{torch.cuda.get_device_name()}"
    )
    print("| rows | graph size | device us per replay | host us per launch | host us per runner replay |")
    print("| --- | --- | --- | --- | --- |")
    rows = []
    for bs in args.batch_sizes:
        padded = runner.padded_size(bs)
        device, launch, replay = measure(runner, padded, args.context, args.replays, args.rounds)
        rows.append((bs, device, launch, replay))
        print(f"| {bs} | {padded} | {device * 1e6:.1f} | {launch * 1e6:.1f} | {replay * 1e6:.1f} |", flush=True)
    engine.shutdown()
    return rows


if __name__ == "__main__":
    main()
