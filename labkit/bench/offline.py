"""Offline throughput: labkit vs transformers' padded-batch `generate`, same requests, one process.

    python -m labkit.bench.offline [--num-requests 32] [--min-input 32] [--max-input 256] [--output-len 64]

Requests are random token ids (seeded), greedy, EOS ignored, so both sides produce exactly
output-len tokens per request. Prints both throughputs, their ratio, and batch-1 time per token."""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass

import torch

from labkit import Engine
from labkit.bench.datasets import random_ids
from labkit.model_loader.loader import resolve_model_dir


@dataclass
class Result:
    system: str
    requests: int
    output_tokens: int
    seconds: float
    output_throughput: float  # output tokens / s
    batch1_ms_per_token: float


def make_requests(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """`n` prompts of random ids (datasets.random_ids), lengths uniform in [lo, hi]."""
    rng = random.Random(seed)
    return [random_ids(rng, rng.randint(lo, hi), vocab) for _ in range(n)]


def bench_labkit(engine: Engine, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
    params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
    engine.generate(input_ids=prompts[:2], sampling_params={**params, "max_new_tokens": 4})  # warm-up
    engine.flush_cache()
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - start
    if any(len(o["output_ids"]) != output_len for o in outs):
        raise RuntimeError("labkit produced the wrong number of tokens")
    engine.flush_cache()
    one = engine.generate(input_ids=prompts[0], sampling_params=params)["meta_info"]
    per_token = (one["timestamps"]["finished"] - one["timestamps"]["first_token"]) / (output_len - 1)
    return seconds, per_token


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), both [n, longest prompt], left padded as decoder-only generation needs."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


def hf_generate(model, prompts: list[list[int]], output_len: int, pad_id: int) -> torch.Tensor:
    ids, mask = left_pad(prompts, pad_id)
    config = model.generation_config
    config.eos_token_id = None  # ignore EOS, like labkit's ignore_eos
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=pad_id,
            generation_config=config,
        )
    return out[:, ids.shape[1] :]


def bench_hf(model, prompts: list[list[int]], output_len: int, pad_id: int) -> tuple[float, float]:
    hf_generate(model, prompts[:2], 4, pad_id)  # warm-up
    start = time.perf_counter()
    out = hf_generate(model, prompts, output_len, pad_id)
    seconds = time.perf_counter() - start
    if out.shape[1] != output_len:
        raise RuntimeError("transformers produced the wrong number of tokens")
    t0 = time.perf_counter()
    hf_generate(model, prompts[:1], 1, pad_id)
    t1 = time.perf_counter()
    hf_generate(model, prompts[:1], output_len, pad_id)
    t2 = time.perf_counter()
    return seconds, ((t2 - t1) - (t1 - t0)) / (output_len - 1)


def main(argv: list[str] | None = None) -> list[Result]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--min-input", type=int, default=32)
    ap.add_argument("--max-input", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    if args.output_len < 2:
        ap.error("--output-len must be at least 2 (time per token is measured after the first)")

    from transformers import AutoModelForCausalLM

    engine = Engine(max_total_tokens=args.num_requests * (args.max_input + args.output_len) + 1024)
    prompts = make_requests(
        args.num_requests, args.min_input, args.max_input, engine.model_runner.vocab_size, args.seed
    )
    lab_s, lab_tok = bench_labkit(engine, prompts, args.output_len)
    del engine
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(None), dtype=torch.float32).eval()
    hf_s, hf_tok = bench_hf(model, prompts, args.output_len, pad_id=model.config.pad_token_id or 0)

    total = args.num_requests * args.output_len
    results = [
        Result("labkit", args.num_requests, total, lab_s, total / lab_s, lab_tok * 1e3),
        Result("transformers generate (padded)", args.num_requests, total, hf_s, total / hf_s, hf_tok * 1e3),
    ]
    print(
        f"{args.num_requests} requests, input {args.min_input}..{args.max_input}, output {args.output_len}, "
        f"greedy, EOS ignored, {torch.get_num_threads()} threads"
    )
    print(f"{'system':32} {'seconds':>8} {'out tok/s':>10} {'batch-1 ms/token':>17}")
    for r in results:
        print(f"{r.system:32} {r.seconds:8.2f} {r.output_throughput:10.1f} {r.batch1_ms_per_token:17.2f}")
    ratio = results[0].output_throughput / results[1].output_throughput
    print(
        f"throughput ratio labkit / transformers: {ratio:.2f}x; "
        f"batch-1 per-token ratio transformers / labkit: {hf_tok / lab_tok:.2f}x"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return results


if __name__ == "__main__":
    main()
