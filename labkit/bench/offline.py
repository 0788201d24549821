"""Offline throughput: labkit vs transformers' padded-batch `generate`, same requests, one process.

    python -m labkit.bench.offline [--num-requests 32] [--min-input 32] [--max-input 256] [--output-len 64]
                                   [--llama-cpp]

Requests are random token ids (seeded), greedy, EOS ignored, so every system produces exactly
output-len tokens per request. Prints the throughputs, their ratios, and batch-1 time per token.
--llama-cpp adds llama.cpp (llama-cpp-python, an optional install: pip install llama-cpp-python)
running the embedded GGUF as it ships, quantized, one request after another as it serves."""

from __future__ import annotations

import argparse
import copy
import json
import random
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from labkit import Engine
from labkit.bench.datasets import random_ids
from labkit.model_loader.embedded import gguf_path
from labkit.model_loader.loader import resolve_model_dir

if TYPE_CHECKING:
    from llama_cpp import Llama

LLAMA_CPP_HINT = "pip install llama-cpp-python"
AGREE_PREFIX = 8  # leading greedy tokens compared between llama.cpp and labkit


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


def bench_labkit(engine: Engine, prompts: list[list[int]], output_len: int) -> tuple[float, float, list[list[int]]]:
    """(seconds for all prompts, batch-1 seconds per decode token, each prompt's output ids)."""
    params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
    engine.generate(input_ids=prompts[:2], sampling_params={**params, "max_new_tokens": 4})  # warm-up
    engine.flush_cache()
    start = time.perf_counter()
    outs = cast(list[dict[str, Any]], engine.generate(input_ids=prompts, sampling_params=params))
    seconds = time.perf_counter() - start
    if any(len(o["output_ids"]) != output_len for o in outs):
        raise RuntimeError("labkit produced the wrong number of tokens")
    engine.flush_cache()
    one = cast(list[dict[str, Any]], engine.generate(input_ids=prompts[:1], sampling_params=params))[0]
    times = one["meta_info"]["timestamps"]
    per_token = (times["finished"] - times["first_token"]) / (output_len - 1)
    return seconds, per_token, [o["output_ids"] for o in outs]


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
    # All settings in one config (a copy: the model's stays as loaded); EOS ignored, like labkit's ignore_eos.
    config = copy.deepcopy(model.generation_config)
    config.update(
        eos_token_id=None, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=pad_id
    )
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, generation_config=config)
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


def import_llama() -> type[Llama]:
    """llama_cpp.Llama, imported only when asked for: llama-cpp-python is an optional peer, not a labkit
    dependency. Raises ImportError naming the install command when it is missing."""
    try:
        from llama_cpp import Llama
    except ImportError as e:
        raise ImportError(f"--llama-cpp needs llama-cpp-python, which is not installed; run: {LLAMA_CPP_HINT}") from e
    return Llama


def load_llama(prompts: list[list[int]], output_len: int) -> Llama:
    """The embedded GGUF in llama.cpp, as it ships (quantized), on torch's thread count so it gets the same
    cores as labkit; room for the longest prompt plus its output, and the longest prompt in one batch."""
    longest = max(map(len, prompts))
    threads = torch.get_num_threads()
    return import_llama()(
        model_path=str(gguf_path()),
        n_ctx=longest + output_len,
        n_batch=max(512, longest),  # 512 is llama.cpp's default; larger only when a prompt needs it
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )


def llama_generate(llm: Llama, prompt: list[int], output_len: int) -> tuple[list[int], float]:
    """Exactly `output_len` greedy tokens after `prompt`, and the seconds from the first to the last.
    EOS does not end it (Llama.generate yields until the caller stops), and nothing is reused from the
    previous call: reset() first, else generate() would reuse the KV cache of a matching prefix."""
    llm.reset()
    tokens: list[int] = []
    first = 0.0
    for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0):
        tokens.append(token)
        if len(tokens) == 1:
            first = time.perf_counter()
        if len(tokens) == output_len:
            break
    if len(tokens) != output_len:
        raise RuntimeError(f"llama.cpp produced {len(tokens)} tokens, not {output_len}")
    return tokens, time.perf_counter() - first


def bench_llama_cpp(llm: Llama, prompts: list[list[int]], output_len: int) -> tuple[float, float, list[list[int]]]:
    """bench_labkit's figures for llama.cpp, which serves one sequence at a time: the prompts in turn."""
    for p in prompts[:2]:  # warm-up
        llama_generate(llm, p, 4)
    start = time.perf_counter()
    outs = [llama_generate(llm, p, output_len)[0] for p in prompts]
    seconds = time.perf_counter() - start
    decode_seconds = llama_generate(llm, prompts[0], output_len)[1]
    return seconds, decode_seconds / (output_len - 1), outs


def count_agreeing(a: list[list[int]], b: list[list[int]], prefix: int = AGREE_PREFIX) -> int:
    """How many requests' first `prefix` tokens are the same in `a` and `b`."""
    return sum(x[:prefix] == y[:prefix] for x, y in zip(a, b))


def main(argv: list[str] | None = None) -> list[Result]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--min-input", type=int, default=32)
    ap.add_argument("--max-input", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results to this JSON file")
    ap.add_argument(
        "--llama-cpp", action="store_true", help="add llama.cpp running the GGUF itself (needs llama-cpp-python)"
    )
    args = ap.parse_args(argv)
    if args.output_len < 2:
        ap.error("--output-len must be at least 2 (time per token is measured after the first)")
    if args.llama_cpp:
        try:
            import_llama()  # fail before the long runs, not after them
        except ImportError as e:
            ap.error(str(e))

    from transformers import AutoModelForCausalLM

    engine = Engine(max_total_tokens=args.num_requests * (args.max_input + args.output_len) + 1024)
    prompts = make_requests(
        args.num_requests, args.min_input, args.max_input, engine.model_runner.vocab_size, args.seed
    )
    lab_s, lab_tok, lab_outs = bench_labkit(engine, prompts, args.output_len)
    del engine
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(None), dtype=torch.float32).eval()
    hf_s, hf_tok = bench_hf(model, prompts, args.output_len, pad_id=model.config.pad_token_id or 0)
    del model

    total = args.num_requests * args.output_len
    results = [
        Result("labkit", args.num_requests, total, lab_s, total / lab_s, lab_tok * 1e3),
        Result("transformers generate (padded)", args.num_requests, total, hf_s, total / hf_s, hf_tok * 1e3),
    ]
    if args.llama_cpp:
        llm = load_llama(prompts, args.output_len)
        cpp_s, cpp_tok, cpp_outs = bench_llama_cpp(llm, prompts, args.output_len)
        del llm
        results.append(
            Result("llama.cpp (GGUF, one at a time)", args.num_requests, total, cpp_s, total / cpp_s, cpp_tok * 1e3)
        )
    print(
        f"{args.num_requests} requests, input {args.min_input}..{args.max_input}, output {args.output_len}, "
        f"greedy, EOS ignored, {torch.get_num_threads()} threads"
    )
    print(f"{'system':32} {'seconds':>8} {'out tok/s':>10} {'batch-1 ms/token':>17}")
    for r in results:
        print(f"{r.system:32} {r.seconds:8.2f} {r.output_throughput:10.1f} {r.batch1_ms_per_token:17.2f}")
    lab = results[0]
    for peer, name in zip(results[1:], ("transformers", "llama.cpp")):
        print(
            f"throughput ratio labkit / {name}: {lab.output_throughput / peer.output_throughput:.2f}x; "
            f"batch-1 per-token ratio {name} / labkit: {peer.batch1_ms_per_token / lab.batch1_ms_per_token:.2f}x"
        )
    if args.llama_cpp:
        print(
            f"llama.cpp runs {gguf_path().name} quantized, labkit and transformers its float32 de-quantization: "
            f"first {AGREE_PREFIX} greedy tokens agree with labkit on {count_agreeing(cpp_outs, lab_outs)}"
            f"/{args.num_requests} requests"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return results


if __name__ == "__main__":
    main()
