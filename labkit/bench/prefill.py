"""The prefill (extend) step of one request, with and without the prefill CUDA graphs.

    python -m labkit.bench.prefill [--prompt-lens 16 160 512 2048 4096] [--repeats 8]
                                   [--model-path PATH --load-format dummy] [--device auto]

For each prompt length, --repeats requests of that many random token ids run alone, each asking
for one token: the first (fresh) prefill computes the whole prompt; then the same prompt is sent
again, and its prefill (cached) computes one new token after the cached prefix. The wall time of
each extend step is taken with the device synchronized before and after it (scheduler steps,
overlap scheduling off so a step is its own work). Two engines, the CUDA default
(--cuda-graph-max-prefill-tokens 2048: prompts up to 2048 tokens replay a graph) and
--cuda-graph-max-prefill-tokens 0 (every extend eager); on CPU only the eager one exists. Prints
the median milliseconds per extend step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

from labkit import Engine
from labkit.model_executor.forward_batch import ForwardMode

VARIANTS = {"eager": 0, "prefill graphs": 2048}


def _sync(engine: Engine) -> None:
    if engine.model_runner.device.type == "cuda":
        torch.cuda.synchronize(engine.model_runner.device)


def extend_step_ms(engine: Engine, prompt: list[int]) -> float:
    """Milliseconds of the extend step of `prompt` run alone (one output token)."""
    scheduler, times = engine.scheduler, []
    step = scheduler.step

    def timed_step():
        _sync(engine)
        start = time.perf_counter()
        out = step()
        _sync(engine)
        if out.forward_mode == ForwardMode.EXTEND:
            times.append(time.perf_counter() - start)
        return out

    scheduler.step = timed_step  # type: ignore[method-assign]
    try:
        engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0})
    finally:
        scheduler.step = step  # type: ignore[method-assign]
    if len(times) != 1:
        raise RuntimeError(f"expected one extend step, got {len(times)}")
    return times[0] * 1e3


def bench(engine: Engine, prompt_lens: list[int], repeats: int, seed: int = 0) -> dict[int, tuple[float, float]]:
    """Prompt length -> (median ms of a fresh prefill, median ms of a cached one)."""
    rng = random.Random(seed)
    vocab = engine.model_runner.vocab_size
    results = {}
    for n in prompt_lens:
        fresh, cached = [], []
        for _ in range(repeats):
            prompt = [rng.randrange(vocab) for _ in range(n)]
            fresh.append(extend_step_ms(engine, prompt))
            cached.append(extend_step_ms(engine, prompt))
        results[n] = (statistics.median(fresh), statistics.median(cached))
    return results


def main(argv: list[str] | None = None) -> dict[str, dict[int, tuple[float, float]]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[16, 160, 512, 2048, 4096])
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--model-path", default=None, help="default: the embedded model")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    kw: dict[str, Any] = {"device": args.device, "load_format": args.load_format, "disable_overlap_schedule": True}
    if args.model_path:
        kw["model_path"] = args.model_path
    results = {}
    for name, max_tokens in VARIANTS.items():
        engine = Engine(**kw, cuda_graph_max_prefill_tokens=max_tokens)
        if max_tokens and engine.model_runner.prefill_graph_runner is None:
            print(f"{name}: none on {engine.model_runner.device} (CUDA graphs with the triton backend only)")
            continue
        bench(engine, args.prompt_lens[:1], 1, seed=99)  # warm-up: Triton variants, allocator blocks
        results[name] = bench(engine, args.prompt_lens, args.repeats)
        del engine
    where = f"{args.model_path or 'embedded model'}, {args.device}"
    print(f"\nextend step, median ms of {args.repeats} ({where}): fresh prompt / prompt cached, one new token")
    print("| prompt tokens | " + " | ".join(results) + " |")
    print("| --- |" + " --- |" * len(results))
    for n in args.prompt_lens:
        cells = " | ".join(f"{r[n][0]:.2f} / {r[n][1]:.2f}" for r in results.values())
        print(f"| {n} | {cells} |")
    return results


if __name__ == "__main__":
    main()
