"""Parallelism on GPUs (needs 2): prints one JSON line per result.

    python benchmarks/parallel_gpu.py logprobs  # TP=2 vs TP=1 logprobs (Qwen3-0.6B), with and without CUDA graphs
    python benchmarks/parallel_gpu.py decode    # batch-1 decode ms/token (Llama-3-8B): TP=1, TP=2, TP=2 eager
    python benchmarks/parallel_gpu.py offline   # the 256-sequence offline workload (Llama-3-8B): TP=1 and TP=2,
                                                # with the share of device time in collectives (torch.profiler)
    python benchmarks/parallel_gpu.py dp        # the same workload (Qwen3-0.6B): DP=1 and DP=2
    python benchmarks/parallel_gpu.py dp-1024   # the same with 1,024 requests

Random bf16 weights. The offline workload and engine options are labkit.bench.offline_gpu's (256
requests, input and output lengths uniform in 100..1024, EOS ignored). Data parallelism offline: the
requests are routed by labkit's DataParallelController (round_robin) to one Engine process per GPU,
started together after their warm-up; the run takes as long as its slowest replica.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

import torch

from labkit.bench.offline_gpu import arg_parser, bench_labkit, make_workload
from labkit.bench.profile_step import profiled
from labkit.distributed.dp_controller import DataParallelController
from labkit.engine import Engine

GREEDY = {"temperature": 0, "ignore_eos": True}


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def decode_ms_per_token(tp_size: int, cuda_graph: bool, model: str = "llama-3-8b", new_tokens: int = 256) -> float:
    graphs = {"disable_cuda_graph": not cuda_graph, "cuda_graph_max_bs": 4}
    with Engine(model_path=model, load_format="dummy", tp_size=tp_size, kv_memory_gb=4, **graphs) as engine:
        params = {**GREEDY, "max_new_tokens": new_tokens}
        engine.generate(input_ids=list(range(1, 33)), sampling_params=params)  # warm-up
        best = float("inf")
        for _ in range(3):
            meta = engine.generate(input_ids=list(range(1, 33)), sampling_params=params)["meta_info"]
            t = meta["timestamps"]
            best = min(best, (t["finished"] - t["first_token"]) / (new_tokens - 1) * 1e3)
        return best


def logprob_gap(cuda_graph: bool) -> dict:
    common = {"model_path": "qwen3-0.6b", "load_format": "dummy", "disable_cuda_graph": not cuda_graph}
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(10 + 5 * i)] for i in range(8)]
    params = {**GREEDY, "max_new_tokens": 32, "return_logprob": True}
    runs, replays = [], []
    for tp in (1, 2):
        with Engine(**common, tp_size=tp, cuda_graph_max_bs=8) as engine:
            runs.append(engine.generate(input_ids=prompts, sampling_params=params))
            graphs = engine.model_runner.cuda_graph_runner
            replays.append(graphs.num_replays if graphs else 0)
    gaps, same = [], 0
    for a, b in zip(*runs):
        same += a["output_ids"] == b["output_ids"]
        for (la, ta), (lb, tb) in zip(a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]):
            gaps.append(abs(la - lb))
            if ta != tb:  # past a bf16 near-tie the two continue different texts
                break
    return {"same_tokens": f"{same}/{len(prompts)}", "max_logprob_gap": round(max(gaps), 4), "graph_replays": replays}


def offline_options(model: str, num_seqs: int = 256) -> argparse.Namespace:
    """labkit.bench.offline_gpu's defaults."""
    return arg_parser().parse_args(["--model", model, "--num-seqs", str(num_seqs)])


def workload(model: str, num_seqs: int = 256) -> tuple[list[list[int]], list[int]]:
    from labkit.model_loader.loader import load_config

    vocab = load_config(model).vocab_size
    return make_workload(num_seqs, 100, 1024, vocab, 0)


def offline_tp(tp: int, model: str = "llama-3-8b") -> None:
    args = offline_options(model)
    prompts, out_lens = workload(model)
    run, _, engine = bench_labkit(args, prompts, out_lens, tp_size=tp)
    row = {"bench": "offline", "model": model, "tp_size": tp, "out_tokens": run.output_tokens}
    row |= {"seconds": round(run.seconds, 2), "out_tok_s": round(run.throughput), "note": run.note}
    if tp > 1:  # the same workload again under the profiler: rank 0's device time by kernel group
        engine.flush_cache()
        for prompt, n in zip(prompts, out_lens):
            engine.add_request(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": n})
        groups, _, wall, _ = profiled(engine, engine.scheduler.has_work)
        busy = sum(groups.values())
        row |= {"collectives_share_of_device_time": round(groups.get("collectives", 0.0) / busy, 3)}
        row |= {"profiled_wall_s": round(wall / 1e3, 2), "device_busy_s": round(busy / 1e3, 2)}
    emit(**row)
    engine.shutdown()


def _dp_replica(gpu: int, model: str, prompts, out_lens, start: mp.Barrier, results: mp.Queue) -> None:
    args = offline_options(model, len(prompts))
    from labkit.bench.offline_gpu import Profile, build_engine, instrument, warm_up

    engine = build_engine(model, args, device=f"cuda:{gpu}")
    warm_up(engine, args, engine.model_runner.vocab_size)
    params = [{**GREEDY, "max_new_tokens": n} for n in out_lens]
    profile = Profile()
    resolve = instrument(engine, profile)
    torch.cuda.synchronize()
    start.wait()
    t = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - t
    resolve()
    steps = {
        mode: {"steps": s.steps, **{k: round(v, 3) for k, v in s.per_step_ms().items()}}
        for mode, s in (("decode", profile.decode), ("prefill", profile.extend))
    }
    results.put((gpu, seconds, sum(len(o["output_ids"]) for o in outs), steps))


def offline_dp(num_seqs: int, model: str = "qwen3-0.6b") -> None:
    prompts, out_lens = workload(model, num_seqs)
    ctx = mp.get_context("spawn")
    for dp in (1, 2):
        controller = DataParallelController(dp, "round_robin")
        shares: list[list[int]] = [[] for _ in range(dp)]
        for i, prompt in enumerate(prompts):
            shares[controller.route(str(i), prompt)].append(i)
        start, results = ctx.Barrier(dp), ctx.Queue()
        procs = [
            ctx.Process(
                target=_dp_replica,
                args=(g, model, [prompts[i] for i in share], [out_lens[i] for i in share], start, results),
            )
            for g, share in enumerate(shares)
        ]
        for p in procs:
            p.start()
        done = [results.get(timeout=540) for _ in procs]
        for p in procs:
            p.join()
        seconds = max(s for _, s, _, _ in done)
        tokens = sum(n for _, _, n, _ in done)
        emit(
            bench="offline_dp", model=model, num_seqs=num_seqs, dp_size=dp, out_tokens=tokens,
            seconds=round(seconds, 2), out_tok_s=round(tokens / seconds),
            replica_seconds=[round(s, 2) for _, s, _, _ in sorted(done)],
            replica_steps_ms=[steps for _, _, _, steps in sorted(done)],
        )  # fmt: skip


def emit_logprobs(cuda_graph: bool) -> None:
    emit(check="tp2_vs_tp1_bf16", cuda_graph=cuda_graph, **logprob_gap(cuda_graph))


def emit_decode(tp: int, cuda_graph: bool) -> None:
    start = time.perf_counter()
    ms = decode_ms_per_token(tp, cuda_graph)
    emit(bench="batch1_decode", model="llama-3-8b", tp_size=tp, cuda_graph=cuda_graph,
         ms_per_token=round(ms, 3), wall_s=round(time.perf_counter() - start, 1))  # fmt: skip


# Each measurement in a process of its own: one tensor-parallel group per process keeps the custom
# all-reduce (labkit/distributed/custom_all_reduce.py).
JOBS = {
    "logprobs": [(emit_logprobs, (False,)), (emit_logprobs, (True,))],
    "decode": [(emit_decode, (1, True)), (emit_decode, (2, True)), (emit_decode, (2, False))],
    "offline": [(offline_tp, (1,)), (offline_tp, (2,))],
    "dp": [(offline_dp, (256,))],
    "dp-1024": [(offline_dp, (1024,))],  # four times the requests: more than one engine runs at once
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="+", choices=list(JOBS))
    ctx = mp.get_context("spawn")
    for what in ap.parse_args().what:
        for fn, args in JOBS[what]:
            proc = ctx.Process(target=fn, args=args)
            proc.start()
            proc.join()


if __name__ == "__main__":
    main()
