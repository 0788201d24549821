"""Batch-1 decode under several settings, alternated in one process so that every setting sees the
same GPU. Separate runs are not comparable to a few percent: on one H200 the same code measured
1.226 and 0.998 ms a token minutes apart (docs/benchmarks.md).

    python -m labkit.bench.batch1_ab [--model qwen3-0.6b] [--rounds 7] \\
        --variant base \\
        --variant prefetch:labkit.kernels.decode.PREFETCH_MAX_BATCH=8 \\
        --variant split:labkit.kernels.gemv.SPLIT_UNDER_PDL=True

A variant is a name and the module constants (module.NAME=value, comma-separated; values are Python
literals, dicts and tuples included) set while its engine is built and while it runs: a constant read
when the CUDA graphs are captured is then in that engine's graphs, and one read at each launch is set
for its runs too.
Every variant gets its own engine (random bf16 weights, CUDA graphs for batch 1), and every round
times each once over offline_gpu's batch-1 request (512-token prompt, 256 output tokens), the order
rotating from round to round; each run's line ends with the GPU's clocks and the host's load as it
ended (machine_state). Reported: each variant's median ms per output token with its range, and the
median of its per-round difference from the first variant.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import json
import os
import statistics
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Variant:
    name: str
    knobs: tuple[tuple[str, str, Any], ...] = ()  # (module, constant, value)


def _top_level_items(text: str) -> list[str]:
    """text cut at the commas outside brackets and quotes: a value may be a tuple or a dict."""
    items, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return [*items, text[start:]]


def parse_variant(spec: str) -> Variant:
    """'name' or 'name:module.NAME=value,module.NAME=value' -> Variant (a value may be any Python
    literal, a dict or a tuple with its own commas included)."""
    name, _, rest = spec.partition(":")
    if not name:
        raise ValueError(f"a variant needs a name before its knobs, got {spec!r}")
    knobs = []
    for item in filter(None, _top_level_items(rest)):
        path, eq, value = item.partition("=")
        module, _, attr = path.rpartition(".")
        if not eq or not module or not attr:
            raise ValueError(f"a knob is module.NAME=value, got {item!r}")
        try:
            knobs.append((module, attr, ast.literal_eval(value)))
        except (ValueError, SyntaxError):
            raise ValueError(f"the value of {path} must be a Python literal, got {value!r}") from None
    return Variant(name, tuple(knobs))


@contextlib.contextmanager
def applied(variant: Variant) -> Iterator[None]:
    """The variant's constants set inside the block, the old values back after it."""
    saved = []
    try:
        for module_name, attr, value in variant.knobs:
            module = importlib.import_module(module_name)
            if not hasattr(module, attr):
                raise ValueError(f"{module_name} has no {attr} to set")
            saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, value)
        yield
    finally:
        for module, attr, old in reversed(saved):
            setattr(module, attr, old)


def alternate(run: Callable[[str], float], names: list[str], rounds: int) -> dict[str, list[float]]:
    """run(name) for every name in every round, round r starting at names[r % len(names)]; results
    per name in round order."""
    results: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            results[name].append(run(name))
    return results


def summary(results: dict[str, list[float]], unit: str = "ms/token", digits: int = 3) -> list[str]:
    """One line per variant: median (min-max), and the median per-round difference from the first."""
    first = next(iter(results.values()))
    lines = []
    for name, runs in results.items():
        median, low, high = (f"{x:.{digits}f}" for x in (statistics.median(runs), min(runs), max(runs)))
        line = f"{name}: {median} {unit} ({low}-{high}, {len(runs)} rounds)"
        if runs is not first:
            diff = statistics.median(b - a for a, b in zip(first, runs))
            line += f", {diff:+.{digits}f} against {next(iter(results))} (median per round)"
        lines.append(line)
    return lines


def machine_state() -> str:
    """The GPU's clocks, power and temperature (nvidia-smi, where there is one) and the host's load
    average, as a run ends: a round that swings away from the others can then be told apart as a
    clock drop (throttling) or a busy host."""
    state = f"load {os.getloadavg()[0]:.1f}"
    try:
        index = str(torch.cuda.current_device())
        query = ["nvidia-smi", "-i", index, "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu"]
        done = subprocess.run([*query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
        sm, mem, watts, celsius = (field.strip() for field in done.stdout.strip().split(","))
    except (OSError, subprocess.SubprocessError, ValueError):  # no nvidia-smi, or another output
        return state
    return f"SM {sm} MHz, mem {mem} MHz, {watts} W, {celsius} C; {state}"


def parse_variants(ap: argparse.ArgumentParser, specs: list[str]) -> dict[str, Variant]:
    """The --variant options by name; a malformed or repeated one is a usage error."""
    try:
        variants = {v.name: v for v in map(parse_variant, specs)}
    except ValueError as e:
        ap.error(str(e))
    if len(variants) < len(specs):
        ap.error("variant names must differ")
    return variants


def compare(
    variants: dict[str, Variant],
    build: Callable[[], Any],
    measure: Callable[[Any], float],
    rounds: int,
    title: str,
    unit: str,
    digits: int,
) -> dict[str, list[float]]:
    """An engine per variant (build() under its constants), then `rounds` rounds of measure(engine)
    under its constants, rotating; prints each run and the summary."""
    if not torch.cuda.is_available():
        raise SystemExit("an A/B of GPU settings needs a CUDA device")
    engines = {}
    for name, variant in variants.items():
        with applied(variant):
            engines[name] = build()

    def run(name: str) -> float:
        with applied(variants[name]):
            value = measure(engines[name])
        print(f"  {name}: {value:.{digits}f} {unit}  [{machine_state()}]", flush=True)
        return value

    results = alternate(run, list(variants), rounds)
    print(f"== {title}, {torch.cuda.get_device_name()}")
    for line in summary(results, unit, digits):
        print(line)
    return results


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    from labkit.bench import offline_gpu

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--variant", action="append", required=True, help="name[:module.NAME=value,...]; repeat")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--engine-variant", default="graphs", choices=sorted(offline_gpu.BATCH1_VARIANTS))
    cli = ap.parse_args(argv)
    variants = parse_variants(ap, cli.variant)
    args = offline_gpu.arg_parser().parse_args(["--skip-hf"])
    vocab = json.loads((offline_gpu.CONFIGS_DIR / f"{cli.model}.json").read_text())["vocab_size"]
    prompt = offline_gpu.make_requests(1, args.batch1_input, args.batch1_input, vocab, args.seed)[0]
    return compare(
        variants,
        lambda: offline_gpu.batch1_engine(cli.model, args, cli.engine_variant, prompt),
        lambda engine: offline_gpu.decode_ms_per_token(engine, prompt, args.batch1_output),
        cli.rounds,
        f"batch-1 {cli.model} ({cli.engine_variant})",
        "ms/token",
        3,
    )


if __name__ == "__main__":
    main()
