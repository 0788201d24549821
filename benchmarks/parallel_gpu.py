"""Tensor parallelism on GPUs: batch-1 decode ms/token at tp_size 1 and 2 (Llama-3-8B shape, random
bf16 weights), and TP=2 logprobs against TP=1 with and without CUDA graphs (Qwen3-0.6B shape).

    python benchmarks/parallel_gpu.py            # needs 2 GPUs; prints one JSON line per result
"""

from __future__ import annotations

import json
import time

from labkit.engine import Engine


def decode_ms_per_token(tp_size: int, cuda_graph: bool, model: str = "llama-3-8b", new_tokens: int = 256) -> float:
    graphs = {"disable_cuda_graph": not cuda_graph, "cuda_graph_max_bs": 4}
    with Engine(model_path=model, load_format="dummy", tp_size=tp_size, kv_memory_gb=4, **graphs) as engine:
        params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
        engine.generate(input_ids=list(range(1, 33)), sampling_params=params)  # warm-up
        best = float("inf")
        for _ in range(3):
            meta = engine.generate(input_ids=list(range(1, 33)), sampling_params=params)["meta_info"]
            t = meta["timestamps"]
            best = min(best, (t["finished"] - t["first_token"]) / (new_tokens - 1) * 1e3)
        return best


def logprob_gap(disable_cuda_graph: bool) -> dict:
    common = {"model_path": "qwen3-0.6b", "load_format": "dummy", "disable_cuda_graph": disable_cuda_graph}
    common["cuda_graph_max_bs"] = 8
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(10 + 5 * i)] for i in range(8)]
    params = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True, "return_logprob": True}
    runs = []
    for tp in (1, 2):
        with Engine(**common, tp_size=tp) as engine:
            runs.append(engine.generate(input_ids=prompts, sampling_params=params))
    gaps, same = [], 0
    for a, b in zip(*runs):
        same += a["output_ids"] == b["output_ids"]
        for (la, ta), (lb, tb) in zip(a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]):
            gaps.append(abs(la - lb))
            if ta != tb:  # past a bf16 near-tie the two continue different texts
                break
    return {"cuda_graph": not disable_cuda_graph, "same_tokens": f"{same}/{len(prompts)}", "max_logprob_gap": max(gaps)}


def main() -> None:
    for cuda_graph in (False, True):
        for tp in (1, 2):
            start = time.perf_counter()
            ms = decode_ms_per_token(tp, cuda_graph)
            row = {"bench": "batch1_decode", "model": "llama-3-8b", "tp_size": tp, "cuda_graph": cuda_graph}
            print(json.dumps({**row, "ms_per_token": round(ms, 3), "wall_s": round(time.perf_counter() - start, 1)}))
    for cuda_graph_off in (True, False):
        print(json.dumps({"check": "tp2_vs_tp1_bf16", **logprob_gap(cuda_graph_off)}), flush=True)


if __name__ == "__main__":
    main()
