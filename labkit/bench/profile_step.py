"""Where a GPU step's time goes: device time per kernel group, from torch.profiler, for decode steps
of a full batch and for prompt-chunk (extend) steps.

    python -m labkit.bench.profile_step [--model qwen3-0.6b] [--batch 256] [--context 800]
                                        [--chunked-prefill-size N] [--steps 20] [--no-graphs]
                                        [--tp-size N] [--overlap]

A random-weight engine is given --batch requests of --context random prompt tokens each (EOS
ignored). The prompt chunks are profiled as they run, then --steps decode steps of the whole batch
(replayed from a CUDA graph unless --no-graphs). Each kernel is put in a group by its name (matrix
products, attention, norms, rotary, activation, KV store, sampling, copies) and the table shows
device milliseconds per step, next to the step's wall time, so the gap is host/launch time.
Overlap scheduling is off unless --overlap (then a step's wall time is the larger of its host and
device time). With --tp-size N the profile is rank 0's (the followers run in processes of their own).
"""

from __future__ import annotations

import argparse
import random
import re
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from labkit import Engine

# First match wins; kernel names from cuBLAS/CUTLASS (gemm), labkit.kernels (Triton), FlashInfer and torch.
GROUPS = [
    ("collectives", r"nccl|one_shot|two_shot|all_reduce|AllReduce|AllGather"),
    ("MoE experts (fused_moe)", r"_moe_gemm|_moe_sum"),
    ("MoE token alignment", r"_moe_align"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|splitK|cublas|_gemv"),
    ("attention, decode", r"_decode_stage|_decode_balanced|BatchDecode"),
    ("attention, extend", r"_extend_kernel|BatchPrefill"),
    ("kv store", r"_store_kv"),
    ("rmsnorm", r"rmsnorm|rms_norm"),
    ("rotary (+ q/k norm)", r"_rope"),
    ("silu_and_mul", r"silu"),
    ("argmax / sampling", r"argmax|ArgMax|reduce_kernel|topk|softmax"),
    ("copies / casts / indexing", r"copy|Copy|Memcpy|Memset|index|gather|scatter|elementwise|fill|cat|where"),
]


def group_of(kernel: str) -> str:
    for name, pattern in GROUPS:
        if re.search(pattern, kernel):
            return name
    return "other"


def kernel_times(prof: profile) -> tuple[dict[str, float], dict[str, tuple[float, int]]]:
    """(device ms per group, (device ms, launches) per kernel name) of a finished profile."""
    groups: dict[str, float] = defaultdict(float)
    kernels: dict[str, tuple[float, int]] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = event.device_time * 1e-3
        groups[group_of(event.name)] += ms
        total, count = kernels.get(event.name, (0.0, 0))
        kernels[event.name] = (total + ms, count + 1)
    return groups, kernels


def profiled(
    engine: Engine, more: Callable[[], object]
) -> tuple[dict[str, float], dict[str, tuple[float, int]], float, int]:
    """Run engine steps under the profiler while more() is true: (device ms per group, device ms and
    launches per kernel name, wall ms, steps), totals over the steps."""
    torch.cuda.synchronize()
    steps = 0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        while more():
            engine.step(count_pool=False)
            steps += 1
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3
    return (*kernel_times(prof), wall, steps)


def report(
    title: str,
    groups: dict[str, float],
    kernels: dict[str, tuple[float, int]],
    wall: float,
    steps: int,
    top: int,
    per: str = "step",
) -> None:
    """Print device time per group and the top kernels, divided by `steps` (per="run": steps=1)."""
    device = sum(groups.values())
    print(
        f"\n== {title}: {steps} steps, wall {wall / steps:.3f} ms/{per}, device busy {device / steps:.3f} "
        f"ms/{per} ({device / wall:.0%})"
    )
    for name, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {name:28s} {ms / steps:9.3f} ms/{per}  {ms / device:6.1%}")
    print(f"  top kernels (ms/{per}, launches/{per}):")
    for name, (ms, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"    {ms / steps:9.3f}  {count / steps:8.1f}  {name[:110]}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b", help="a data/configs name (random weights)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=800, help="prompt tokens per request")
    ap.add_argument("--chunked-prefill-size", type=int, default=None, help="default: the engine's")
    ap.add_argument("--steps", type=int, default=20, help="decode steps profiled")
    ap.add_argument("--no-graphs", action="store_true", help="decode eagerly (no CUDA graphs)")
    ap.add_argument("--enable-torch-compile", action="store_true")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--top", type=int, default=15, help="kernels listed per table")
    ap.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (rank 0 is profiled)")
    ap.add_argument("--overlap", action="store_true", help="keep overlap scheduling on")
    args = ap.parse_args(argv)

    engine = Engine(
        model_path=args.model,
        load_format="dummy",
        dtype="bfloat16",
        kv_memory_gb=40.0,
        max_running_requests=args.batch,
        cuda_graph_max_bs=args.batch,
        disable_cuda_graph=args.no_graphs,
        chunked_prefill_size=args.chunked_prefill_size,
        enable_torch_compile=args.enable_torch_compile,
        torch_compile_max_bs=args.batch,
        attention_backend=args.attention_backend,
        disable_overlap_schedule=not args.overlap,
        tp_size=args.tp_size,
    )
    rng = random.Random(0)
    vocab = engine.model_runner.vocab_size

    def add_batch(max_new_tokens: int) -> None:
        params = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
        for _ in range(args.batch):
            engine.add_request(input_ids=[rng.randrange(vocab) for _ in range(args.context)], sampling_params=params)

    add_batch(4)  # warm-up: Triton variants and graphs at the profiled shapes
    engine.run_until_done()
    engine.flush_cache()
    with profile(activities=[ProfilerActivity.CUDA]):
        pass  # the profiler's first start is slow; keep it out of the numbers

    add_batch(args.steps + 8)  # small reservations: the whole batch is admitted before decoding
    groups, kernels, wall, chunks = profiled(
        engine, lambda: engine.scheduler.waiting_queue or engine.scheduler.chunked_req
    )
    chunk = engine.scheduler.chunked_prefill_size
    report(f"prompt chunks of <= {chunk} tokens", groups, kernels, wall, chunks, args.top)
    stop = engine.scheduler.step_id + args.steps
    groups, kernels, wall, steps = profiled(engine, lambda: engine.scheduler.step_id < stop)
    mode = "eager" if args.no_graphs else "CUDA graph"
    title = f"decode, batch {args.batch}, context ~{args.context}, {mode}, tp_size {args.tp_size}"
    report(title + (", overlap" if args.overlap else ""), groups, kernels, wall, steps, args.top)
    engine.shutdown()


if __name__ == "__main__":
    main()
