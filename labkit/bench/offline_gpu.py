"""GPU offline throughput: the nano-vllm / mini-sglang workload, labkit against transformers and the
roofline, in one process and one run.

    python -m labkit.bench.offline_gpu [--num-seqs 256] [--min-len 100] [--max-len 1024] [--json out.json]

Workload: --num-seqs sequences of random token ids (seeded), input and output lengths each uniform in
[min-len, max-len], greedy, EOS ignored (each request makes exactly its output length), random
weights of a data/configs shape (default qwen3-0.6b) in bfloat16. In the same run:

- labkit (`Engine(model_path=..., load_format="dummy")`, CUDA graphs for decode), with a per-step
  breakdown: forward and sampling GPU time (CUDA events), time in the forward and sampling calls on
  the host, the rest of the scheduler step on the host, and GPU idle time;
- transformers continuous batching (`ContinuousBatchingManager`, attn_implementation "paged|sdpa",
  each request with its own max_new_tokens) and padded `generate` (sdpa, left padding) on the first
  --hf-padded-seqs requests; each peer stops at --hf-max-seconds and is then reported as capped;
- the roofline: every decode step must read all weights plus the KV of every running sequence
  from HBM (bandwidth measured here by a device-to-device copy); prefill needs its FLOPs at the
  bf16 matrix rate measured here. Reported as achieved % (floor time / measured time);
- batch-1 decode time per output token for --batch1-models, in each of --batch1-variants (CUDA
  graphs, graphs + torch.compile, eager): the median of --batch1-repeats runs of one request.

--kv-cache-dtype fp8_e4m3 / fp8_e5m2 gives labkit a float8 KV pool (the roofline then counts one
byte per K/V value). --compare-overlap runs labkit a second time with overlap scheduling toggled;
--enable-torch-compile compiles labkit's decode forward (up to --torch-compile-max-bs);
--kernel-profile runs labkit's workload once more under torch.profiler and prints device time per
kernel group (matmul, decode and extend attention, norms, ...) over the whole run.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from labkit import Engine
from labkit.bench.moe_roofline import expert_share
from labkit.bench.offline import left_pad, make_requests
from labkit.config import KV_CACHE_DTYPES
from labkit.model_loader.loader import CONFIGS_DIR


@dataclass
class Run:
    system: str
    requests: int
    output_tokens: int
    seconds: float
    note: str = ""

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class StepStats:
    """Per scheduler step, split by forward mode (times in seconds)."""

    steps: int = 0
    wall: float = 0.0
    forward_gpu: float = 0.0
    sample_gpu: float = 0.0
    forward_call: float = 0.0  # host time inside ModelRunner.forward (copies, launches, replay)
    sample_call: float = 0.0  # host time inside ModelRunner.sample (sampling info, launches)
    tokens: int = 0  # tokens run through the model
    kv_tokens_read: int = 0  # decode: sum of seq_lens (KV rows every step must read)
    graph_steps: int = 0

    def per_step_ms(self) -> dict[str, float]:
        """Milliseconds per step: wall, forward and sampling GPU time and host call time, the rest of
        the step on the host (with its wait for the GPU), and the GPU's idle time (wall - GPU time)."""
        k = 1e3 / max(self.steps, 1)
        gpu = self.forward_gpu + self.sample_gpu
        rest = self.wall - self.forward_call - self.sample_call
        return {
            "wall": self.wall * k,
            "fwd_gpu": self.forward_gpu * k,
            "smpl_gpu": self.sample_gpu * k,
            "fwd_call": self.forward_call * k,
            "smpl_call": self.sample_call * k,
            "rest_cpu": rest * k,
            "gpu_idle": (self.wall - gpu) * k,
        }


@dataclass
class Profile:
    decode: StepStats = field(default_factory=StepStats)
    extend: StepStats = field(default_factory=StepStats)
    prefill_attn_pairs: int = 0  # sum over prefill tokens of the context each attends to
    decode_batch_sizes: list[int] = field(default_factory=list)  # an MoE step reads the experts its batch chose


def make_workload(n: int, lo: int, hi: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Prompts (offline.make_requests: random ids, lengths uniform in [lo, hi]) and output lengths."""
    prompts = make_requests(n, lo, hi, vocab, seed)
    rng = random.Random(seed + 1)
    return prompts, [rng.randint(lo, hi) for _ in range(n)]


def free_cuda() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# ---- labkit -----------------------------------------------------------------------------------
def instrument(engine: Engine, profile: Profile):
    """Wrap the scheduler step and the model runner's forward / sample calls with host timers and
    CUDA events (read after the run, so the steps are not slowed by extra syncs). Returns the
    function that, once the run is over, removes the wrappers and reads the events into `profile`."""
    runner, scheduler = engine.model_runner, engine.scheduler
    forward, sample, step = runner.forward, runner.sample, scheduler.step
    current: dict = {}
    pending: list[tuple[StepStats, torch.cuda.Event, torch.cuda.Event, torch.cuda.Event]] = []

    def timed_forward(fb):
        stats = profile.decode if fb.forward_mode.is_decode() else profile.extend
        current["stats"] = stats
        stats.tokens += fb.num_tokens
        if fb.forward_mode.is_decode():
            stats.kv_tokens_read += sum(fb.seq_lens_cpu)
            profile.decode_batch_sizes.append(fb.batch_size)
            graphs = runner.cuda_graph_runner
            stats.graph_steps += int(graphs is not None and graphs.can_run(fb))
        else:
            for prefix, n in zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu):
                profile.prefill_attn_pairs += n * prefix + n * (n + 1) // 2
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        t0 = time.perf_counter()
        out = forward(fb)
        stats.forward_call += time.perf_counter() - t0
        e1.record()
        current["events"] = (e0, e1)
        return out

    def timed_sample(logits, reqs, fb, vocab_mask=None):
        t0 = time.perf_counter()
        out = sample(logits, reqs, fb, vocab_mask)
        e2 = torch.cuda.Event(enable_timing=True)
        e2.record()
        stats = current["stats"]
        stats.sample_call += time.perf_counter() - t0
        pending.append((stats, *current["events"], e2))
        return out

    def timed_step():
        current.clear()
        t0 = time.perf_counter()
        out = step()
        if "stats" in current:
            current["stats"].steps += 1
            current["stats"].wall += time.perf_counter() - t0
        return out

    def resolve() -> None:
        runner.forward, runner.sample, scheduler.step = forward, sample, step
        torch.cuda.synchronize()
        for stats, e0, e1, e2 in pending:
            stats.forward_gpu += e0.elapsed_time(e1) * 1e-3
            stats.sample_gpu += e1.elapsed_time(e2) * 1e-3
        pending.clear()

    runner.forward, runner.sample, scheduler.step = timed_forward, timed_sample, timed_step
    return resolve


def build_engine(model: str, args, **overrides) -> Engine:
    options = dict(
        model_path=model,
        load_format="dummy",
        dtype="bfloat16",
        page_size=args.page_size,
        kv_memory_gb=args.kv_memory_gb,
        max_running_requests=args.max_running_requests,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        enable_torch_compile=args.enable_torch_compile,
        torch_compile_max_bs=args.torch_compile_max_bs,
        chunked_prefill_size=args.chunked_prefill_size,
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend,
    )
    if args.cuda_graph_max_prefill_tokens is not None:
        options["cuda_graph_max_prefill_tokens"] = args.cuda_graph_max_prefill_tokens
    return Engine(**{**options, **overrides})


def weight_bytes(engine: Engine) -> int:
    """Parameter bytes a decode step reads: all of them, except an untied embedding table (only
    the batch's rows of it are read)."""
    model = engine.model_runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if getattr(model, "lm_head", None) is not None:
        embed = model.model.embed_tokens.weight
        total -= embed.numel() * embed.element_size()
    return total


def warm_up(engine: Engine, args, vocab: int) -> None:
    """Everything the first steps of a run set up (Triton variants, torch.compile graphs, the CUDA
    allocator's blocks) happens before the timing: the same number of requests and prompt lengths
    (other ids), short outputs. With a lighter warm-up the first engine of a process ran slower than
    a second on the same workload (on an H200, 14,590 tok/s run first, 17,535 run second)."""
    prompts, _ = make_workload(args.num_seqs, args.min_len, args.max_len, vocab, args.seed + 99)
    params = [{"temperature": 0, "max_new_tokens": 1 + i % 32, "ignore_eos": True} for i in range(len(prompts))]
    engine.generate(input_ids=prompts, sampling_params=params)
    engine.flush_cache()


def run_workload(engine: Engine, prompts: list[list[int]], out_lens: list[int]) -> float:
    """Seconds for the workload (greedy, out_lens[i] tokens for prompts[i], EOS ignored) from an idle
    device; RuntimeError if a request made another number of tokens."""
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in out_lens]
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - start
    if not isinstance(outs, list) or [len(o["output_ids"]) for o in outs] != out_lens:
        raise RuntimeError("labkit produced the wrong number of tokens")
    return seconds


def bench_labkit(args, prompts, out_lens, name: str = "labkit", **overrides) -> tuple[Run, Profile, Engine]:
    engine = build_engine(args.model, args, **overrides)
    vocab = engine.model_runner.vocab_size
    warm_up(engine, args, vocab)
    profile = Profile()
    resolve = instrument(engine, profile)
    seconds = run_workload(engine, prompts, out_lens)
    resolve()
    graphs = engine.model_runner.cuda_graph_runner
    note = f"CUDA graphs bs<={graphs.max_bs}" if graphs else "no CUDA graphs"
    note += ", overlap scheduling" if engine.scheduler.overlap else ", no overlap"
    if engine.config.enable_torch_compile:
        note += f", torch.compile bs<={engine.config.torch_compile_max_bs}"
    return Run(name, len(prompts), sum(out_lens), seconds, note), profile, engine


BATCH1_VARIANTS = {
    "graphs": {},
    "graphs+compile": {"enable_torch_compile": True},
    "eager": {"disable_cuda_graph": True},
    "flashinfer": {"attention_backend": "flashinfer"},
    "flashinfer+eager": {"attention_backend": "flashinfer", "disable_cuda_graph": True},
}


def batch1_engine(model: str, args, variant: str, prompt: list[int]) -> Engine:
    """An engine for one request at a time (CUDA graphs for batch 1 unless the variant says not),
    warmed up on `prompt`."""
    options = {"enable_torch_compile": False, **BATCH1_VARIANTS[variant]}  # the variant alone decides
    engine = build_engine(model, args, cuda_graph_max_bs=1, kv_memory_gb=2.0, **options)
    engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
    return engine


def decode_ms_per_token(engine: Engine, prompt: list[int], n: int) -> float:
    """ms per output token after the first, of one request of n output tokens alone (the prefix
    cache flushed first, so the prompt is prefilled anew)."""
    engine.flush_cache()
    params = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    stamps = engine.generate(input_ids=prompt, sampling_params=params)["meta_info"]["timestamps"]
    return (stamps["finished"] - stamps["first_token"]) / (n - 1) * 1e3


def batch1_ms_per_token(
    model: str, args, variant: str, prompt: list[int], n: int, repeats: int = 1
) -> tuple[list[float], int]:
    """(ms per output token after the first, of each of `repeats` runs; weight bytes) of one request
    alone."""
    engine = batch1_engine(model, args, variant, prompt)
    nbytes = weight_bytes(engine)
    runs = [decode_ms_per_token(engine, prompt, n) for _ in range(repeats)]
    del engine
    free_cuda()
    return runs, nbytes


def kernel_profile(engine: Engine, prompts: list[list[int]], out_lens: list[int]) -> None:
    """The timed workload again (cache flushed) under torch.profiler: where the device time goes."""
    from labkit.bench.profile_step import profiled, report

    engine.flush_cache()
    for prompt, n in zip(prompts, out_lens):
        engine.add_request(
            input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
        )
    groups, kernels, wall, _ = profiled(engine, engine.scheduler.has_work)
    report("labkit's run under torch.profiler, device time by kernel group", groups, kernels, wall, 1, 12, per="run")


# ---- transformers -----------------------------------------------------------------------------
def hf_model(model: str, attn: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(CONFIGS_DIR / f"{model}.json")
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attn)
    m.generation_config.eos_token_id = None  # ignore EOS, like labkit's ignore_eos
    return m.eval()


def bench_hf_continuous(args, prompts, out_lens) -> Run:
    """transformers' continuous batching as generate_batch runs it (a warmed-up manager from
    continuous_batching_context_manager, sized by WorkloadHints), but each request added with its
    own max_new_tokens (generate_batch takes one for all)."""
    from transformers import GenerationConfig

    model = hf_model(args.model, "paged|sdpa")
    gen = GenerationConfig(max_new_tokens=max(out_lens), do_sample=False, eos_token_id=None, pad_token_id=0)
    kwargs = {}
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        kwargs["workload_hints"] = WorkloadHints(
            max_prompt_length=max(map(len, prompts)), max_generated_length=max(out_lens)
        )
    except ImportError:
        pass
    done: dict[str, int] = {}
    with model.continuous_batching_context_manager(generation_config=gen, block=True, timeout=30, **kwargs) as manager:
        start = time.perf_counter()
        for i, (p, n) in enumerate(zip(prompts, out_lens)):
            manager.add_request(input_ids=p, request_id=f"r{i}", max_new_tokens=n)
        while len(done) < len(prompts) and time.perf_counter() - start < args.hf_max_seconds:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done[result.request_id] = len(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError("the continuous batching thread stopped")
        seconds = time.perf_counter() - start
    capped = len(done) < len(prompts)
    wrong = sum(done[f"r{i}"] != n for i, n in enumerate(out_lens) if f"r{i}" in done)
    note = "attn paged|sdpa" + (
        f"; capped at {args.hf_max_seconds:.0f} s: {len(done)}/{len(prompts)} "
        "requests finished, only their tokens counted"
        if capped
        else ""
    )
    if wrong:
        note += f"; {wrong} requests with a different token count"
    del manager, model
    free_cuda()
    return Run("transformers continuous batching", len(done), sum(done.values()), seconds, note)


def hf_padded_generate(model, prompts: list[list[int]], output_len: int, max_time: float | None) -> torch.Tensor:
    """offline.hf_generate on the model's device: left padding, greedy, EOS ignored, every row
    runs output_len steps (or until max_time seconds). Returns the new tokens [n, steps]."""
    ids, mask = left_pad(prompts, pad_id=0)
    with torch.inference_mode():
        out = model.generate(
            ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=0,
            max_time=max_time,
        )
    return out[:, ids.shape[1] :]


def bench_hf_padded(args, prompts, out_lens) -> Run:
    """Padded `generate` on the first --hf-padded-seqs requests as one batch (left padding, every
    row runs to the longest output); only each request's own output length counts."""
    model = hf_model(args.model, "sdpa")
    n = min(args.hf_padded_seqs, len(prompts))
    sub, lens = prompts[:n], out_lens[:n]
    hf_padded_generate(model, [p[:16] for p in sub[:2]], 4, None)  # warm-up (CUDA init, kernels)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = hf_padded_generate(model, sub, max(lens), args.hf_max_seconds)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    steps = out.shape[1]
    useful = sum(min(m, steps) for m in lens)
    note = f"first {n} requests as one batch, attn sdpa"
    if steps < max(lens):
        note += f"; capped at {args.hf_max_seconds:.0f} s after {steps}/{max(lens)} steps"
    del model
    free_cuda()
    return Run("transformers generate (padded)", n, useful, seconds, note)


# ---- report -----------------------------------------------------------------------------------
def roofline(engine: Engine, profile: Profile, bandwidth: float, rate: float) -> dict[str, float]:
    """Decode: weights + the KV of every running sequence read once per step, at HBM bandwidth.
    Prefill: 2 FLOPs per layer weight per token plus attention (QK^T and PV over each token's
    context), at the bf16 matrix rate (the lm_head of the last tokens is left out). MoE models: a
    decode step reads the experts its batch is expected to choose (moe_roofline), a prefill token
    computes with its top-k experts only."""
    runner = engine.model_runner
    wbytes = weight_bytes(engine)
    kv_per_token = runner.token_to_kv_pool.bytes_per_token()
    d = profile.decode
    cfg = runner.hf_config
    layer_params = sum(p.numel() for p in runner.model.model.layers.parameters())
    experts = expert_share(runner.model, getattr(cfg, "num_experts_per_tok", 0))
    if experts is None:
        decode_weight_bytes = d.steps * wbytes
    else:
        dense = wbytes - experts.num_experts * experts.bytes_per_expert
        active = sum(experts.expected_active(b) for b in profile.decode_batch_sizes)
        decode_weight_bytes = d.steps * dense + active * experts.bytes_per_expert
        layer_params -= (experts.num_experts - experts.top_k) * experts.params_per_expert
    decode_bytes = decode_weight_bytes + d.kv_tokens_read * kv_per_token
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    prefill_flops = (
        2 * layer_params * profile.extend.tokens
        + 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * profile.prefill_attn_pairs
    )
    return {
        "weight_bytes": wbytes,
        "kv_bytes_per_token": kv_per_token,
        "decode_bytes": decode_bytes,
        "decode_floor_s": decode_bytes / bandwidth,
        "prefill_flops": prefill_flops,
        "prefill_floor_s": prefill_flops / rate,
    }


def print_report(
    args,
    runs: list[Run],
    profile: Profile,
    roof: dict,
    bandwidth: float,
    rate: float,
    batch1: list[tuple[str, str, float, float]],
) -> None:
    print(
        f"\n== offline throughput: {args.num_seqs} seqs, input and output lengths uniform in "
        f"[{args.min_len}, {args.max_len}] (seed {args.seed}), random ids, greedy, EOS ignored, "
        f"{args.model} random weights, bfloat16, {torch.cuda.get_device_name()}"
    )
    print(f"{'system':34} {'reqs':>5} {'out tokens':>10} {'seconds':>8} {'out tok/s':>10}  note")
    for r in runs:
        print(f"{r.system:34} {r.requests:5d} {r.output_tokens:10d} {r.seconds:8.2f} {r.throughput:10.0f}  {r.note}")
    lab = runs[0]
    floor = roof["decode_floor_s"] + roof["prefill_floor_s"]
    d, e = profile.decode, profile.extend
    print(
        f"\n== roofline (HBM {bandwidth / 1e12:.2f} TB/s by a 2 GiB copy, bf16 matmul {rate / 1e12:.0f} "
        f"TFLOP/s, both measured in this run)"
    )
    print(
        f"weights {roof['weight_bytes'] / 1e9:.3f} GB (a decode step reads them all, an MoE model's "
        f"experts as its batch routes), KV "
        f"{roof['kv_bytes_per_token'] / 1024:.0f} KiB per token; {d.steps} decode steps read "
        f"{roof['decode_bytes'] / 1e12:.2f} TB -> {roof['decode_floor_s']:.2f} s; prefill "
        f"{roof['prefill_flops'] / 1e15:.3f} PFLOP -> {roof['prefill_floor_s']:.2f} s"
    )
    print(
        f"floor {floor:.2f} s = {lab.output_tokens / floor:.0f} out tok/s; labkit {lab.seconds:.2f} s: "
        f"{100 * floor / lab.seconds:.1f}% of roofline overall; decode steps alone {d.wall:.2f} s: "
        f"{100 * roof['decode_floor_s'] / d.wall:.1f}% of their floor"
    )
    print("\n== labkit step breakdown (per step, ms; GPU times from CUDA events)")
    print(
        f"{'mode':7} {'steps':>6} {'wall':>7} {'fwd GPU':>8} {'smpl GPU':>9} {'fwd call':>9} "
        f"{'smpl call':>10} {'rest CPU':>9} {'GPU idle':>9} {'tok/step':>9}"
    )
    for name, s in (("decode", d), ("prefill", e)):
        if not s.steps:
            continue
        b = s.per_step_ms()
        print(
            f"{name:7} {s.steps:6d} {b['wall']:7.3f} {b['fwd_gpu']:8.3f} {b['smpl_gpu']:9.3f} "
            f"{b['fwd_call']:9.3f} {b['smpl_call']:10.3f} {b['rest_cpu']:9.3f} {b['gpu_idle']:9.3f} "
            f"{s.tokens / s.steps:9.1f}"
        )
    print(
        f"decode steps replayed from a CUDA graph: {d.graph_steps}/{d.steps}; total step time "
        f"{d.wall + e.wall:.2f} s of {lab.seconds:.2f} s"
    )
    print(
        "('rest CPU' = the scheduler step outside the forward and sampling calls, including the wait for "
        "the GPU at the step's one sync; 'GPU idle' = wall - forward GPU - sampling GPU)"
    )
    if batch1:
        print(
            f"\n== batch-1 decode, ms per output token ({args.batch1_input}-token prompt, "
            f"{args.batch1_output} output tokens; floor = weights / HBM bandwidth)"
        )
        print(f"{'model':14} {'variant':>14} {'ms/token':>9} {'floor ms':>9}")
        for model, variant, ms, floor_ms in batch1:
            print(f"{model:14} {variant:>14} {ms:9.3f} {floor_ms:9.3f}")


def arg_parser() -> argparse.ArgumentParser:
    """The command line; its defaults are the workload and engine options other benchmarks reuse."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b", help="a data/configs name (random weights)")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--kv-memory-gb", type=float, default=40.0)
    ap.add_argument(
        "--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="labkit's KV pool storage (as the server's)"
    )
    ap.add_argument("--attention-backend", default="auto", help="labkit's (auto: triton on CUDA)")
    ap.add_argument("--max-running-requests", type=int, default=256)
    ap.add_argument("--cuda-graph-max-bs", type=int, default=256)
    ap.add_argument("--chunked-prefill-size", type=int, default=None, help="default: the engine's")
    ap.add_argument(
        "--cuda-graph-max-prefill-tokens", type=int, default=None, help="prefill graphs' cap (default: the engine's)"
    )
    ap.add_argument(
        "--kernel-profile",
        action="store_true",
        help="run labkit's workload once more under torch.profiler: device time per kernel group",
    )
    ap.add_argument("--skip-hf", action="store_true", help="no transformers peers")
    ap.add_argument("--disable-overlap-schedule", action="store_true", help="labkit's run without overlap")
    ap.add_argument("--enable-torch-compile", action="store_true", help="labkit's runs with torch.compile")
    ap.add_argument("--torch-compile-max-bs", type=int, default=32)
    ap.add_argument("--compare-overlap", action="store_true", help="also run labkit with overlap toggled")
    ap.add_argument("--hf-padded-seqs", type=int, default=64, help="requests given to padded generate")
    ap.add_argument("--hf-max-seconds", type=float, default=60.0, help="time cap of each transformers run")
    ap.add_argument("--batch1-models", default="qwen3-0.6b,qwen2.5-0.5b", help="comma-separated; empty: skip")
    ap.add_argument(
        "--batch1-variants", default="graphs,eager", help=f"comma-separated, of {', '.join(BATCH1_VARIANTS)}"
    )
    ap.add_argument("--batch1-input", type=int, default=512)
    ap.add_argument("--batch1-output", type=int, default=256)
    ap.add_argument("--batch1-repeats", type=int, default=5, help="timed runs of each; the median is reported")
    ap.add_argument("--json", help="also write the results to this JSON file")
    return ap


def main(argv: list[str] | None = None) -> dict:
    ap = arg_parser()
    args = ap.parse_args(argv)
    unknown = set(args.batch1_variants.split(",")) - set(BATCH1_VARIANTS)
    if unknown:
        ap.error(f"unknown --batch1-variants {sorted(unknown)}; choose from {sorted(BATCH1_VARIANTS)}")
    if not torch.cuda.is_available():
        raise SystemExit("offline_gpu needs a CUDA device (python -m labkit.bench.offline runs on CPU)")
    device = torch.device("cuda")

    from labkit.kernels.bench import measure_ceilings

    bandwidth, rate = measure_ceilings(device, copy_elements=1 << 30)  # 2 GiB
    free_cuda()
    print(f"HBM copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    vocab = json.loads((CONFIGS_DIR / f"{args.model}.json").read_text())["vocab_size"]
    prompts, out_lens = make_workload(args.num_seqs, args.min_len, args.max_len, vocab, args.seed)

    lab, profile, engine = bench_labkit(args, prompts, out_lens, disable_overlap_schedule=args.disable_overlap_schedule)
    print(f"labkit: {lab.output_tokens} tokens in {lab.seconds:.2f} s = {lab.throughput:.0f} tok/s", flush=True)
    roof = roofline(engine, profile, bandwidth, rate)
    if args.kernel_profile:
        kernel_profile(engine, prompts, out_lens)
    del engine
    free_cuda()
    runs = [lab]
    if args.compare_overlap:
        other, _, engine = bench_labkit(
            args,
            prompts,
            out_lens,
            "labkit, overlap toggled",
            disable_overlap_schedule=not args.disable_overlap_schedule,
        )
        del engine
        free_cuda()
        runs.append(other)
        print(f"{other.system}: {other.throughput:.0f} tok/s ({other.note})", flush=True)

    batch1 = []
    for model in filter(None, args.batch1_models.split(",")):
        cfg_vocab = json.loads((CONFIGS_DIR / f"{model}.json").read_text())["vocab_size"]
        prompt = make_requests(1, args.batch1_input, args.batch1_input, cfg_vocab, args.seed)[0]
        for variant in args.batch1_variants.split(","):
            runs, nbytes = batch1_ms_per_token(model, args, variant, prompt, args.batch1_output, args.batch1_repeats)
            ms = statistics.median(runs)
            batch1.append((model, variant, ms, nbytes / bandwidth * 1e3))
            spread = f" (median of {len(runs)}: {min(runs):.3f}-{max(runs):.3f})" if len(runs) > 1 else ""
            print(f"batch-1 {model} {variant}: {ms:.3f} ms/token{spread}", flush=True)

    if not args.skip_hf:
        for bench in (bench_hf_continuous, bench_hf_padded):
            try:
                run = bench(args, prompts, out_lens)
            except Exception as e:  # a peer that fails is reported, not fatal
                run = Run(bench.__name__.removeprefix("bench_"), 0, 0, 0.0, f"FAILED: {type(e).__name__}: {e}")
                free_cuda()
            runs.append(run)
            print(f"{run.system}: {run.output_tokens} tokens in {run.seconds:.2f} s {run.note}", flush=True)

    print_report(args, runs, profile, roof, bandwidth, rate, batch1)
    result = {
        "args": vars(args),
        "device": torch.cuda.get_device_name(),
        "hbm_bytes_per_s": bandwidth,
        "bf16_flops": rate,
        "runs": [{**asdict(r), "throughput": r.throughput} for r in runs],
        "profile": {"decode": asdict(profile.decode), "extend": asdict(profile.extend)},
        "roofline": roof,
        "batch1": batch1,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
