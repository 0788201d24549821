"""Speculative decoding's speed-up: the same greedy requests without speculation and with each
drafter, on a copy-heavy workload and on plain chat.

    python -m labkit.bench.speculative [--algorithms ngram draft] [--workloads copy chat] [--batch-sizes 1 16]
                                       [--num-draft-tokens 4] [--min-batch-gain G] [--min-accept-rate R]
                                       [--ngram-min-match M]
                                       [--output-len 128] [--repeats 3] [--min-requests 4] [--min-groups 1]
                                       [--device auto] [--dtype auto]
                                       [--draft-model-path PATH] [--json out.json]
                                       [--model-path smollm2-135m --load-format dummy --tokenizer-path DIR]

Workloads (data/workloads/speculative.json, chat prompts of the embedded model): `copy` asks the
model to repeat or correct a paragraph given in the prompt (three of the file's short texts), the
case n-gram drafting serves; `chat` asks short questions with nothing to copy. Batch size b: at
least --min-requests requests and --min-groups groups (a multiple of b), submitted b at a time
through `Engine.generate(list)`, groups one after another. Greedy, EOS allowed: output tokens/s
counts the tokens each request actually produced, and every speculative output is checked against
the plain one of the same round (greedy: they should be equal; `mismatch` counts the requests that
differed in any round). Every engine is warmed up once; in each round the engines take turns group
by group (the order reversed from one group to the next), so a shared machine's slow spells hit them
alike; a round's rate is its tokens over its seconds, and the speed-up is the median over the rounds
of each round's ratio to the plain engine, with a distribution-free 95% confidence interval
(labkit.bench.stats.median_ci; the whole range up to 8 rounds). The cache is flushed before each
group.
Acceptance length = (accepted drafts + verify steps) / verify steps, the tokens one verify forward
yields; acceptance rate = accepted / drafted; from drafts = accepted / output tokens, how much of
the output verify steps took from the drafts (what makes a workload copy-heavy). The `draft` drafter
defaults to the embedded model drafting for itself (no smaller model shares SmolLM2's tokenizer
offline): an upper bound on acceptance at about twice the compute per token. Overlap scheduling and
CUDA graphs stay the engine's defaults: on CUDA the plain engine overlaps every step, the
speculative one every step but those after a verify step (the n-gram drafter drafts behind the token
in flight; the host waits for a verify step's tokens).
After the table, each speculative engine's measured step times and break-even
(labkit.speculative.step_costs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from labkit import Engine
from labkit.bench.stats import median_ci
from labkit.tokenizer.prompt import encode_prompt

WORKLOAD_FILE = Path(__file__).resolve().parents[2] / "data" / "workloads" / "speculative.json"
PLAIN = "plain"
# Texts per copy prompt: one text (about 38 tokens) makes an answer whose preamble and prefill weigh
# as much as the copy; three make it a paragraph the answer mostly copies.
TEXTS_PER_COPY = 3
DRAFT_NOTE = (
    "draft: the embedded model drafts for itself (no smaller model shares its tokenizer offline), an upper "
    "bound on acceptance at about twice the compute per token"
)

Message = dict[str, str]


@dataclass
class Row:
    workload: str
    batch_size: int
    algorithm: str  # "plain" or a drafter
    requests: int
    output_tokens: int  # of the last round
    tok_s: float  # output tokens / s, median of the rounds
    tok_s_min: float
    tok_s_max: float
    speedup: float  # median over the rounds of tok/s over plain's in the same round
    speedup_lo: float  # its 95% confidence interval (labkit.bench.stats.median_ci)
    speedup_hi: float
    accept_len: float  # (accepted + verify steps) / verify steps; 1.0 for plain
    accept_rate: float  # accepted / drafted
    from_drafts: float  # accepted / output tokens
    verify_steps: float  # per request
    mismatches: int  # requests whose output differed from plain's in some round


def chat_workloads(path: Path = WORKLOAD_FILE) -> dict[str, list[list[Message]]]:
    """Workload name -> its chat prompts: `copy` (an instruction, in turn, and a paragraph of
    TEXTS_PER_COPY consecutive texts) and `chat` (questions)."""
    data = json.loads(path.read_text())
    instructions, texts = data["copy_instructions"], data["copy_texts"]
    paragraphs = [" ".join(texts[(i + j) % len(texts)] for j in range(TEXTS_PER_COPY)) for i in range(len(texts))]
    copy = [
        [{"role": "user", "content": f"{instructions[i % len(instructions)]}\n\n{paragraph}"}]
        for i, paragraph in enumerate(paragraphs)
    ]
    chat = [[{"role": "user", "content": q}] for q in data["chat_questions"]]
    return {"copy": copy, "chat": chat}


def tokenize_workloads(engine: Engine, workloads: dict[str, list[list[Message]]]) -> dict[str, list[list[int]]]:
    """The prompts as the engine would tokenize them (chat template, no extra special tokens)."""
    return {name: [encode_prompt(engine.tokenizer, messages=m)[1] for m in chats] for name, chats in workloads.items()}


def make_engines(
    algorithms: list[str],
    num_draft_tokens: int,
    draft_model_path: str | None = None,
    min_batch_gain: float | None = None,
    min_accept_rate: float | None = None,
    **engine_kw: Any,
) -> dict[str, Engine]:
    """The plain engine and one per algorithm that can be built; one that cannot (a draft model that is
    missing or has another vocabulary) is skipped with a line saying why."""
    engines = {PLAIN: Engine(**engine_kw)}
    for algorithm in algorithms:
        spec_kw: dict[str, Any] = {"speculative_algorithm": algorithm, "speculative_num_draft_tokens": num_draft_tokens}
        spec_kw["speculative_min_batch_gain"] = min_batch_gain
        if min_accept_rate is not None:
            spec_kw["speculative_min_accept_rate"] = min_accept_rate
        if algorithm == "draft" and draft_model_path is not None:
            spec_kw["speculative_draft_model_path"] = draft_model_path
            spec_kw["speculative_draft_load_format"] = engine_kw.get("load_format", "auto")
        try:
            engines[algorithm] = Engine(**engine_kw, **spec_kw)
        except (ValueError, OSError, RuntimeError) as e:
            print(f"skipping {algorithm}: {e}")
    return engines


def _requests(
    prompts: list[list[int]], batch_size: int, min_requests: int, min_groups: int = 1
) -> list[list[list[int]]]:
    """Groups of `batch_size` prompts (taken in turn): at least `min_requests` prompts and
    `min_groups` groups in all."""
    groups = max(min_groups, -(-max(batch_size, min_requests) // batch_size))
    return [[prompts[(g * batch_size + i) % len(prompts)] for i in range(batch_size)] for g in range(groups)]


def _run_group(engine: Engine, group: list[list[int]], params: dict[str, Any]) -> tuple[float, list[dict]]:
    """Seconds for one group of requests submitted together, from an empty cache, and their results."""
    engine.flush_cache()
    start = time.perf_counter()
    result = engine.generate(input_ids=group, sampling_params=params)
    assert isinstance(result, list)
    return time.perf_counter() - start, result


def bench(
    engines: dict[str, Engine],
    workloads: dict[str, list[list[int]]],
    batch_sizes: list[int],
    output_len: int,
    repeats: int,
    min_requests: int = 4,
    ignore_eos: bool = False,
    min_groups: int = 1,
) -> list[Row]:
    """One Row per workload x batch size x engine ("plain" must be among the engines): `repeats`
    rounds, each running every engine on the same requests in turn."""
    params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": ignore_eos}
    for engine in engines.values():  # warm-up
        engine.generate(input_ids=next(iter(workloads.values()))[:2], sampling_params={**params, "max_new_tokens": 8})
    rows = []
    for workload, prompts in workloads.items():
        for bs in batch_sizes:
            groups = _requests(prompts, bs, min_requests, min_groups)
            rates: dict[str, list[float]] = {name: [] for name in engines}
            last: dict[str, list[dict]] = {}
            differed: dict[str, set[int]] = {name: set() for name in engines}
            for round_ in range(repeats):
                seconds = dict.fromkeys(engines, 0.0)
                last = {name: [] for name in engines}
                for g, group in enumerate(groups):  # the engines take turns group by group, neither always first
                    for name in list(engines) if (round_ + g) % 2 == 0 else list(reversed(engines)):
                        took, outs = _run_group(engines[name], group, params)
                        seconds[name] += took
                        last[name] += outs
                plain_ids = [o["output_ids"] for o in last[PLAIN]]
                for name, outs in last.items():
                    rates[name].append(sum(o["meta_info"]["completion_tokens"] for o in outs) / seconds[name])
                    differed[name] |= {i for i, o in enumerate(outs) if o["output_ids"] != plain_ids[i]}
            done = ", ".join(f"{name} {statistics.median(r):.1f}" for name, r in rates.items())
            ratios = "; ".join(
                f"{name} " + " ".join(f"{r / p:.2f}" for r, p in zip(rates[name], rates[PLAIN]))
                for name in engines
                if name != PLAIN
            )
            print(f"{workload}, batch {bs}: {done} out tok/s (each round's ratio to plain: {ratios})", flush=True)
            for name in engines:
                rows.append(_row(workload, bs, name, last[name], rates[name], rates[PLAIN], len(differed[name])))
    return rows


def _row(
    workload: str, bs: int, name: str, outs: list[dict], rates: list[float], plain_rates: list[float], mismatches: int
) -> Row:
    """The speed-up is the median of the rounds' ratios to the plain engine's rate in the same round
    (the pairs share the machine's state of the moment; the medians of the two columns need not)."""
    metas = [o["meta_info"] for o in outs]
    verify, drafted, accepted = (
        sum(m[key] for m in metas) for key in ("spec_verify_ct", "spec_draft_tokens", "spec_accepted_tokens")
    )
    rate = statistics.median(rates)
    ratios = [r / p for r, p in zip(rates, plain_rates)]
    low, high = median_ci(ratios)
    return Row(
        workload=workload,
        batch_size=bs,
        algorithm=name,
        requests=len(outs),
        output_tokens=sum(m["completion_tokens"] for m in metas),
        tok_s=rate,
        tok_s_min=min(rates),
        tok_s_max=max(rates),
        speedup=statistics.median(ratios),
        speedup_lo=low,
        speedup_hi=high,
        accept_len=(accepted + verify) / verify if verify else 1.0,
        accept_rate=accepted / drafted if drafted else 0.0,
        from_drafts=accepted / max(1, sum(m["completion_tokens"] for m in metas)),
        verify_steps=verify / len(outs),
        mismatches=mismatches,
    )


def markdown_table(rows: list[Row]) -> str:
    lines = [
        "| workload | batch | algorithm | requests | out tokens | out tok/s (min-max) | speed-up (95% CI) | accept len "
        "| accept rate | from drafts | verify steps/req | mismatch |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        spec = r.algorithm != PLAIN
        accept = f"{r.accept_len:.2f} | {r.accept_rate:.0%} | {r.from_drafts:.0%} | {r.verify_steps:.1f}"
        accept = accept if spec else "- | - | - | -"
        speedup = f"{r.speedup:.2f}x ({r.speedup_lo:.2f}-{r.speedup_hi:.2f})" if spec else "1.00x"
        lines.append(
            f"| {r.workload} | {r.batch_size} | {r.algorithm} | {r.requests} | {r.output_tokens} "
            f"| {r.tok_s:.1f} ({r.tok_s_min:.1f}-{r.tok_s_max:.1f}) | {speedup} | {accept} "
            f"| {r.mismatches if spec else '-'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algorithms", nargs="+", default=["ngram", "draft"])
    ap.add_argument("--workloads", nargs="+", default=["copy", "chat"], choices=["copy", "chat"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument(
        "--min-batch-gain",
        type=float,
        default=None,
        help="the engines' --speculative-min-batch-gain (default: none, the break-even measured from step times)",
    )
    ap.add_argument(
        "--min-accept-rate",
        type=float,
        default=None,
        help="the engines' --speculative-min-accept-rate (default: the engine's default)",
    )
    ap.add_argument(
        "--ngram-min-match",
        type=int,
        default=None,
        help="the engines' --speculative-ngram-min-match (default: the engine's default)",
    )
    ap.add_argument("--output-len", type=int, default=128, help="max_new_tokens (EOS allowed)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds; the median counts")
    ap.add_argument("--min-requests", type=int, default=4, help="fewest requests per run (batch 1: one by one)")
    ap.add_argument(
        "--min-groups",
        type=int,
        default=1,
        help="fewest groups of a batch size per run (longer rounds at large batches: less timing noise)",
    )
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU) or float32")
    ap.add_argument(
        "--draft-model-path",
        default=None,
        help="the draft model of `draft`, loaded with --load-format (default: the embedded model)",
    )
    ap.add_argument("--model-path", default=None, help="default: the embedded model")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--tokenizer-path", default=None, help="the tokenizer a random-weight model borrows")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    args = ap.parse_args(argv)

    start = time.perf_counter()
    engine_kw = {"device": args.device, "dtype": args.dtype, "model_path": args.model_path}
    engine_kw["load_format"] = args.load_format
    engine_kw["tokenizer_path"] = args.tokenizer_path
    if args.ngram_min_match is not None:
        engine_kw["speculative_ngram_min_match"] = args.ngram_min_match
    engines = make_engines(
        args.algorithms,
        args.num_draft_tokens,
        args.draft_model_path,
        args.min_batch_gain,
        args.min_accept_rate,
        **engine_kw,
    )
    chats = {name: prompts for name, prompts in chat_workloads().items() if name in args.workloads}
    workloads = tokenize_workloads(engines[PLAIN], chats)
    rows = bench(
        engines,
        workloads,
        args.batch_sizes,
        args.output_len,
        args.repeats,
        args.min_requests,
        min_groups=args.min_groups,
    )

    runner = engines[PLAIN].model_runner
    where = f"{runner.device}, {runner.dtype}"
    if runner.device.type == "cpu":
        where += f", {torch.get_num_threads()} threads"
    print(
        f"\n{args.model_path or 'embedded model'}, {where}; greedy, up to {args.output_len} tokens, EOS allowed, "
        f"{args.num_draft_tokens} draft tokens; median of {args.repeats} rounds\n"
    )
    print(markdown_table(rows))
    for name, engine in engines.items():
        if name != PLAIN:  # what the measured rule saw (the last round's steps)
            timed = engine.scheduler.step_costs.summary() or ["no batch size timed both as decode and verify"]
            print(f"\n{name} step times: " + "; ".join(timed))
    if "draft" in engines and args.draft_model_path is None:
        print(f"\n{DRAFT_NOTE}")
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    return rows


if __name__ == "__main__":
    main()
