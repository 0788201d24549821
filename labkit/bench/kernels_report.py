"""python -m labkit.bench.kernels_report --out data/results/kernels_gpu.json

The GPU figures of notebook 07 (kernels), measured in one run and written to one JSON file, which the
notebook reads (it runs on a CPU, where none of this can be measured). On a CUDA device, in bfloat16:

- `ceilings`: the device's copy bandwidth and bf16 matmul rate, measured (kernels/bench.py's
  measure_ceilings): the roofline every kernel time below is compared with;
- `decode_attention`: labkit's split-KV decode kernel, replayed from a CUDA graph as the engine runs
  it, at the embedded model's head shape (SmolLM2-135M, 9 query / 3 KV heads of 64) and Llama-3-8B's
  (32 / 8 of 128): time, floor (the bytes of K and V read / copy bandwidth), achieved fraction;
- `decode_splits`: one long request (batch 1) with the split bound forced to 1, 2, 4, ... splits;
- `extend_attention`: prefill of new tokens, eagerly, against its FLOP floor;
- `norm_rotary`: rmsnorm, fused_add_rmsnorm and rotary_embedding against their byte floor and their
  plain-PyTorch references (kernels/reference.py, several kernels each);
- `cuda_graphs`: the embedded model in an `Engine(device="cuda")`: the captured batch sizes, the
  capture time, then decode steps of batches of 1 to 192 requests, alternately replayed from the
  graphs and run eagerly (per step: batch size, the padded size it replays, forward and step
  milliseconds), and the static input rows of one replayed batch of 5 (padded to 8).

`--cpu` runs the same code on the CPU at tiny shapes (kernels in Triton's interpreter, a tiny
random-weight model): no capture (the runner's padded static path runs eagerly, use_cuda_graph=False)
and wall-clock timers instead of CUDA ones. Its numbers mean nothing; it checks the file's shape.
Every section's records come with `meta` (device, the command, versions, what was skipped)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from labkit.model_loader.embedded import EMBEDDED_MODEL_NAME
from labkit.model_loader.loader import CONFIGS_DIR

REPO = Path(__file__).resolve().parents[2]
RESULTS_FILE = REPO / "data" / "results" / "kernels_gpu.json"
SCHEMA = 1
PAD_EXAMPLE = 5  # the batch whose static input rows are recorded (pads to 8)
WARMUP_STEPS = 2  # decode steps per batch size not recorded (first eager launches compile kernels)

GPU_STEP_BATCHES = [1, 2, 3, 4, 5, 6, 8, 12, 16, 17, 24, 32, 48, 64, 96, 128, 160, 192]
# Kernel timings replay the same inputs again and again: the largest cases move 100 MB or more (the
# SmolLM2 shape's smallest), so that the L2 cache (50 MB on an H100) cannot serve them.
GPU_DECODE = [(1, 131072), (8, 16384), (64, 2048), (160, 1024)]  # (batch, tokens of KV per request)
GPU_SPLITS = (1, 131072, [1, 2, 4, 8, 16, 32])  # (batch, tokens, forced split bounds)
GPU_EXTEND = [(1, 4096), (4, 1024)]  # (requests, new tokens each), no prefix
GPU_TOKENS = [1, 64, 32768]  # rows of the norm and rotary cases
CPU_STEP_BATCHES = [PAD_EXAMPLE]
CPU_DECODE = [(1, 40), (2, 24)]
CPU_SPLITS = (1, 64, [1, 2, 4])
CPU_EXTEND = [(1, 16)]
CPU_TOKENS = [4]


@dataclass(frozen=True)
class HeadShape:
    """The attention and hidden sizes a kernel case takes from a model."""

    model: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int

    @classmethod
    def of(cls, model: str, hf_config: Any) -> HeadShape:
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        return cls(model, hf_config.num_attention_heads, hf_config.num_key_value_heads, head_dim, hf_config.hidden_size)


def config_shape(name: str) -> HeadShape:
    """The HeadShape of a data/configs/<name>.json model."""
    return HeadShape.of(name, SimpleNamespace(**json.loads((CONFIGS_DIR / f"{name}.json").read_text())))


def time_ms(fn: Callable[[], object], cuda: bool, replay: bool = True) -> float:
    """Median milliseconds of fn(). On CUDA: replayed from a CUDA graph (replay=True: no launch cost,
    as the engine's decode runs) or launched eagerly, by Triton's timers. On the CPU: wall clock,
    the median of 3 calls after a warm-up."""
    if cuda:
        import triton.testing

        # Triton's timers run fn on a side stream: without this sync its first call can read inputs the
        # default stream is still writing (a req_to_token of garbage slots: an illegal memory access).
        torch.cuda.synchronize()
        if replay:
            return float(triton.testing.do_bench_cudagraph(fn, return_mode="median"))
        return float(triton.testing.do_bench(fn, return_mode="median"))
    fn()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def measure_ceilings(device: torch.device) -> dict[str, Any]:
    """Copy bandwidth (bytes/s, read + write) and matmul rate (FLOP/s): kernels/bench.py's
    measurement on CUDA (bf16); a small float32 stand-in on the CPU."""
    if device.type == "cuda":
        from labkit.kernels.bench import measure_ceilings as cuda_ceilings

        bw, flops = cuda_ceilings(device)
        return {"copy_bytes_per_s": bw, "matmul_flops_per_s": flops, "matmul_dtype": "bfloat16"}
    src = torch.randn(1 << 22)
    dst = torch.empty_like(src)
    bw = 2 * src.numel() * src.element_size() / (time_ms(lambda: dst.copy_(src), False) * 1e-3)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    flops = 2 * 512**3 / (time_ms(lambda: a @ b, False) * 1e-3)
    return {"copy_bytes_per_s": bw, "matmul_flops_per_s": flops, "matmul_dtype": "float32"}


def _shape_fields(shape: HeadShape) -> dict[str, Any]:
    return {k: v for k, v in asdict(shape).items() if k != "hidden_size"}


def decode_case(
    shape: HeadShape,
    batch: int,
    seq_len: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
    bandwidth: float,
    max_kv_splits: int | None = None,
) -> dict[str, Any]:
    """One decode_attention call timed: `batch` requests of `seq_len` tokens of KV each, in shuffled
    pages; splits as the engine picks them (decode_kv_splits), bounded by max_kv_splits if given."""
    from labkit.kernels.bench import prepare_decode
    from labkit.kernels.decode import DEFAULT_MAX_KV_SPLITS

    h, h_kv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    case = prepare_decode(batch, seq_len, h, h_kv, d, page_size, dtype, device, max_kv_splits or DEFAULT_MAX_KV_SPLITS)
    k_buf, bound = case.k_buf, case.bound
    ms = time_ms(case.call, device.type == "cuda")
    kv_bytes = 2 * batch * seq_len * h_kv * d * k_buf.element_size()
    floor_ms = kv_bytes / bandwidth * 1e3
    return {
        **_shape_fields(shape),
        "batch": batch,
        "seq_len": seq_len,
        "page_size": page_size,
        "max_kv_splits": bound,
        "ms": ms,
        "floor_ms": floor_ms,
        "kv_bytes": kv_bytes,
        "bytes_per_s": kv_bytes / (ms * 1e-3),
        "fraction": floor_ms / ms,
    }


def extend_case(
    shape: HeadShape, batch: int, new: int, dtype: torch.dtype, device: torch.device, flop_rate: float
) -> dict[str, Any]:
    """One extend_attention call (batch requests of `new` tokens each, no cached prefix), launched
    eagerly as the engine runs prefill, against the causal attention FLOPs / matmul rate."""
    from labkit.kernels import ExtendPlan, extend_attention
    from labkit.kernels.bench import _pool
    from labkit.kernels.extend import extend_blocks

    h, h_kv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    k_buf, v_buf, r2t = _pool(batch, 1, h_kv, d, 1, dtype, device)
    total = batch * new
    q = torch.randn(total, h, d, device=device, dtype=dtype)
    k = torch.randn(total, h_kv, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    rows = torch.arange(batch, device=device)
    prefix = torch.zeros(batch, dtype=torch.int64, device=device)
    lens = torch.full((batch,), new, device=device)
    starts = torch.arange(batch, device=device) * new
    plan = ExtendPlan.build([new] * batch, extend_blocks(d, h // h_kv, dtype), device)
    ms = time_ms(
        lambda: extend_attention(q, k, v, k_buf, v_buf, r2t, rows, prefix, lens, starts, d**-0.5, plan=plan),
        device.type == "cuda",
        replay=False,
    )
    flops = 4 * batch * h * d * new * (new + 1) / 2
    floor_ms = flops / flop_rate * 1e3
    return {
        **_shape_fields(shape),
        "batch": batch,
        "new_tokens": new,
        "ms": ms,
        "floor_ms": floor_ms,
        "flops": flops,
        "flops_per_s": flops / (ms * 1e-3),
        "fraction": floor_ms / ms,
    }


def norm_rotary_cases(
    shape: HeadShape, tokens: int, dtype: torch.dtype, device: torch.device, bandwidth: float
) -> list[dict[str, Any]]:
    """rmsnorm and fused_add_rmsnorm over [tokens, hidden_size], rotary_embedding over q [tokens, H, D]
    and k [tokens, H_kv, D]: each kernel's time, its plain-PyTorch reference's, and the floor (the
    bytes it must read and write / copy bandwidth)."""
    from labkit.kernels import fused_add_rmsnorm, rmsnorm, rotary_embedding
    from labkit.kernels.reference import (
        cos_sin_cache,
        reference_fused_add_rmsnorm,
        reference_rmsnorm,
        reference_rotary_embedding,
    )

    cuda, eps, n = device.type == "cuda", 1e-6, shape.hidden_size
    x = torch.randn(tokens, n, device=device, dtype=dtype)
    res = torch.randn_like(x)
    w = torch.randn(n, device=device, dtype=dtype)
    out = torch.empty_like(x)
    # The kernels write in place (into copies): a graph of many calls then allocates nothing.
    x2, res2 = x.clone(), res.clone()
    h, h_kv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    q = torch.randn(tokens, h, d, device=device, dtype=dtype)
    k = torch.randn(tokens, h_kv, d, device=device, dtype=dtype)
    q2, k2 = q.clone(), k.clone()  # rotated again and again: a rotation keeps their norms
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    cs = cos_sin_cache(inv_freq, 8192)
    positions = torch.randint(0, 8192, (tokens,), device=device)
    elem = x.element_size()
    rope_bytes = 2 * tokens * (h + h_kv) * d * elem + tokens * (d * 4 + 8)  # + cos/sin rows (float32), positions
    cases = [
        ("rmsnorm", f"x [{tokens}, {n}]", (2 * tokens * n + n) * elem),
        ("fused_add_rmsnorm", f"x, residual [{tokens}, {n}]", (4 * tokens * n + n) * elem),
        ("rotary_embedding", f"q [{tokens}, {h}, {d}], k [{tokens}, {h_kv}, {d}]", rope_bytes),
    ]
    calls: list[tuple[Callable[[], object], Callable[[], object]]] = [
        (lambda: rmsnorm(x, w, eps, out=out), lambda: reference_rmsnorm(x, w, eps)),
        (
            lambda: fused_add_rmsnorm(x2, res2, w, eps, inplace=True),
            lambda: reference_fused_add_rmsnorm(x, res, w, eps),
        ),
        (
            lambda: rotary_embedding(positions, q2, k2, cs, inplace=True),
            lambda: reference_rotary_embedding(positions, q, k, cs),
        ),
    ]
    rows = []
    for (kernel, what, nbytes), (fn, ref) in zip(cases, calls):
        ms, torch_ms = time_ms(fn, cuda), time_ms(ref, cuda)
        floor_ms = nbytes / bandwidth * 1e3
        rows.append(
            {
                "kernel": kernel,
                "model": shape.model,
                "tokens": tokens,
                "shape": what,
                "ms": ms,
                "torch_ms": torch_ms,
                "floor_ms": floor_ms,
                "bytes": nbytes,
                "fraction": floor_ms / ms,
            }
        )
    return rows


def padding_rows(runner: Any, batch_size: int) -> dict[str, Any]:
    """What the CudaGraphRunner's static input buffers held for the last replay of a batch of
    batch_size requests: one row per row of the padded batch (padding: rows batch_size and on)."""
    bs = runner.padded_size(batch_size)
    cols = {
        "input_id": runner.input_ids,
        "position": runner.positions,
        "req_pool_idx": runner.req_pool_indices,
        "seq_len": runner.seq_lens,
        "out_cache_loc": runner.out_cache_loc,
    }
    rows = [{"row": i, "padding": i >= batch_size, **{k: int(v[i]) for k, v in cols.items()}} for i in range(bs)]
    return {"batch_size": batch_size, "padded_size": bs, "rows": rows}


def graph_steps(
    engine: Any, runner: Any, batch_sizes: Sequence[int], prompt_len: int, rounds: int
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Decode steps of each batch size, alternately with the runner (graph replay) and without it
    (eager), each step timed: (records, the static rows of the first replay of PAD_EXAMPLE)."""
    mr = engine.model_runner
    cuda = mr.device.type == "cuda"
    forward = mr.forward
    last: dict[str, Any] = {}

    def timed_forward(fb):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = forward(fb)
        if cuda:
            torch.cuda.synchronize()
        if fb.forward_mode.is_decode():
            graphs = mr.cuda_graph_runner
            last.update(n=fb.batch_size, ms=(time.perf_counter() - start) * 1e3)
            last["mode"] = "graph" if graphs is not None and graphs.can_run(fb) else "eager"
        return out

    records: list[dict[str, Any]] = []
    example = None
    mr.forward = timed_forward
    try:
        for n in batch_sizes:
            rng = random.Random(n)
            params = {"temperature": 0, "max_new_tokens": 1 + WARMUP_STEPS + 2 * rounds, "ignore_eos": True}
            rids = [
                engine.add_request(input_ids=[rng.randrange(5, mr.vocab_size) for _ in range(prompt_len)],
                                   sampling_params=params)
                for _ in range(n)
            ]  # fmt: skip
            decode_steps = 0
            while any(rid not in engine.results for rid in rids):
                mr.cuda_graph_runner = runner if decode_steps % 2 == 0 else None
                last.clear()
                start = time.perf_counter()
                engine.step()
                step_ms = (time.perf_counter() - start) * 1e3
                if "n" not in last:  # a prefill step
                    continue
                decode_steps += 1
                if decode_steps <= WARMUP_STEPS:
                    continue
                bs = last["n"]
                records.append(
                    {
                        "batch_size": bs,
                        "padded_size": runner.padded_size(bs) if bs <= runner.max_bs else None,
                        "mode": last["mode"],
                        "forward_ms": last["ms"],
                        "step_ms": step_ms,
                    }
                )
                if example is None and bs == PAD_EXAMPLE and last["mode"] == "graph":
                    example = padding_rows(runner, bs)
            for rid in rids:
                engine.results.pop(rid)
            engine.flush_cache()
    finally:
        mr.forward = forward
        mr.cuda_graph_runner = runner
    return records, example


def cuda_graph_report(
    device: torch.device, model: dict[str, Any], batch_sizes: Sequence[int], prompt_len: int, rounds: int
) -> tuple[dict[str, Any], HeadShape]:
    """The `cuda_graphs` section (see the module docstring) and the engine model's HeadShape."""
    from labkit import Engine
    from labkit.model_executor.cuda_graph_runner import CudaGraphRunner

    cuda = device.type == "cuda"
    engine = Engine(
        **model,
        device=device.type,
        attention_backend="triton",
        disable_cuda_graph=True,  # the runner is built below, timed
        disable_overlap_schedule=True,  # each step's forward timed on its own
        max_running_requests=max(256, *batch_sizes),
        max_total_tokens=max(batch_sizes) * (prompt_len + 64) + 4096,
    )
    mr = engine.model_runner
    max_bs = min(engine.config.cuda_graph_max_bs, engine.config.max_running_requests)
    start = time.perf_counter()
    runner = CudaGraphRunner(mr, max_bs, use_cuda_graph=cuda)
    capture_s = time.perf_counter() - start
    mr.cuda_graph_runner = runner
    steps, example = graph_steps(engine, runner, batch_sizes, prompt_len, rounds)
    section = {
        "max_bs": runner.max_bs,
        "capture_batch_sizes": list(runner.batch_sizes),
        "capture_seconds": capture_s if cuda else None,
        "replay": "CUDA graph replay" if cuda else "the padded static path run eagerly (no capture on a CPU)",
        "prompt_len": prompt_len,
        "steps": steps,
        "padding_example": example,
    }
    name = Path(model["model_path"]).stem if model else EMBEDDED_MODEL_NAME
    return section, HeadShape.of(name, mr.hf_config)


def _git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    except OSError:
        return None
    return done.stdout.strip() or None


def build_report(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Every section, measured now (see the module docstring)."""
    import triton

    cpu = args.cpu
    device = torch.device("cpu" if cpu else "cuda")
    dtype = torch.float32 if cpu else torch.bfloat16
    model: dict[str, Any] = {}
    if args.model_path or cpu:
        model = {"model_path": args.model_path or str(CONFIGS_DIR / "tiny-llama.json"), "load_format": args.load_format}
    steps_batches = args.batch_sizes or (CPU_STEP_BATCHES if cpu else GPU_STEP_BATCHES)
    rounds = args.rounds or (1 if cpu else 8)
    prompt_len = args.prompt_len or (16 if cpu else 128)
    started = time.perf_counter()
    graphs, engine_shape = cuda_graph_report(device, model, steps_batches, prompt_len, rounds)
    shapes = [engine_shape] if cpu else [engine_shape, config_shape("llama-3-8b")]
    ceilings = measure_ceilings(device)
    bw, flop_rate = ceilings["copy_bytes_per_s"], ceilings["matmul_flops_per_s"]
    page = 4 if cpu else 16
    decode = [
        decode_case(s, b, n, page, dtype, device, bw) for s in shapes for b, n in (CPU_DECODE if cpu else GPU_DECODE)
    ]
    b, n, bounds = CPU_SPLITS if cpu else GPU_SPLITS
    splits = [decode_case(s, b, n, page, dtype, device, bw, max_kv_splits=m) for s in shapes for m in bounds]
    extend = [
        extend_case(s, b, n, dtype, device, flop_rate) for s in shapes for b, n in (CPU_EXTEND if cpu else GPU_EXTEND)
    ]
    tokens = CPU_TOKENS if cpu else GPU_TOKENS
    norms = [row for s in shapes for t in tokens for row in norm_rotary_cases(s, t, dtype, device, bw)]
    meta = {
        "schema": SCHEMA,
        "device": "cpu (Triton interpreter)" if cpu else torch.cuda.get_device_name(device),
        "cuda": not cpu,
        "command": command,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seconds": time.perf_counter() - started,
        "labkit_commit": _git_commit(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "engine_model": engine_shape.model,
        "skipped": (
            ["CUDA graph capture (the runner's padded static path runs eagerly)", "CUDA timers (wall clock instead)"]
            if cpu
            else []
        ),
    }
    return {
        "meta": meta,
        "ceilings": ceilings,
        "decode_attention": decode,
        "decode_splits": splits,
        "extend_attention": extend,
        "norm_rotary": norms,
        "cuda_graphs": graphs,
    }


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m labkit.bench.kernels_report", description="The GPU figures of notebook 07 (kernels)."
    )
    p.add_argument("--out", type=Path, default=RESULTS_FILE, help="the JSON file to write")
    p.add_argument(
        "--cpu",
        action="store_true",
        help="no CUDA: tiny shapes, kernels in Triton's interpreter, no graph capture (checks the file's shape)",
    )
    p.add_argument("--model-path", default=None, help="engine model (default: the embedded one; tiny-llama on --cpu)")
    p.add_argument("--load-format", default="dummy", help="with --model-path (default dummy: random weights)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="decode batch sizes of the engine steps")
    p.add_argument("--rounds", type=int, default=None, help="recorded steps per batch size and mode (8; 1 on --cpu)")
    p.add_argument(
        "--prompt-len", type=int, default=None, help="prompt tokens of every engine request (128; 16 on --cpu)"
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.cpu:  # before Triton is first imported: it reads the switch then
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or pass --cpu to check the file's shape")
    report = build_report(args, shlex.join(["python", "-m", "labkit.bench.kernels_report", *argv]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out} ({report['meta']['device']}, {report['meta']['seconds']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
