"""Decode attention over the offline workload's batches, step by step: where the attention time of
offline_gpu's run goes, by batch size, under several settings of the kernel.

    python -m labkit.bench.attention_replay [--model qwen3-0.6b] [--kv-cache-dtype fp8_e4m3] \\
        [--every 16] [offline_gpu's workload options] \\
        --variant base \\
        --variant four-warp:labkit.kernels.decode.FP8_ONE_WARP=None

Every request of the workload is taken to start decoding at step 0: at decode step t the requests
with more than t + 1 output tokens are in the batch, request i with its prompt + t + 1 tokens of KV
(the engine's first output token comes from prefill). Every `--every`-th step is one decode_attention
call over K/V in random slots of a pool of the KV dtype, split and ordered as the engine's triton
backend does (decode_kv_splits, decode_order; its CUDA graphs' workspace, with room for
DEFAULT_MAX_KV_SPLITS splits, so batches the balanced partition takes run it), timed as CUDA-graph
replays on a GPU (wall clock on the CPU, where the kernels are interpreted) and counted `--every`
steps x the model's layers. Variants are batch1_ab's: a name and module constants set while it runs.

Reported per variant: the run's attention seconds and TB/s of KV read, and the same by batch size.
(The engine's run staggers its requests' starts over its prefill steps; on an H200 this replay's
2.97 s for the float8 4-warp program matched the 3.06 s the run's --kernel-profile gave.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from labkit.bench import offline_gpu
from labkit.bench.batch1_ab import applied, parse_variants
from labkit.bench.kernels_report import config_shape, time_ms
from labkit.kernels import decode_attention, decode_kv_splits
from labkit.kernels.decode import DEFAULT_MAX_KV_SPLITS, decode_order, decode_semaphore_count, num_sms
from labkit.mem_cache.memory_pool import kv_cache_dtype

# A bucket holds the batches up to its edge (and above the last).
BATCH_EDGES = (16, 32, 64, 96, 128, 160, 192, 224, 256)


@dataclass
class Bucket:
    steps: int = 0
    seconds: float = 0.0
    kv_bytes: float = 0.0


@dataclass
class Replay:
    """One variant's attention over the run: per batch-size bucket, in edge order."""

    buckets: dict[int, Bucket] = field(default_factory=dict)

    def add(self, batch: int, steps: int, seconds: float, kv_bytes: float) -> None:
        edge = next((e for e in BATCH_EDGES if batch <= e), BATCH_EDGES[-1])
        bucket = self.buckets.setdefault(edge, Bucket())
        bucket.steps += steps
        bucket.seconds += seconds
        bucket.kv_bytes += kv_bytes

    @property
    def total(self) -> Bucket:
        return Bucket(*(sum(getattr(b, f) for b in self.buckets.values()) for f in ("steps", "seconds", "kv_bytes")))


def alive(out_lens: list[int], t: int) -> list[int]:
    """The requests in decode step t: those with more than t + 1 output tokens (see above)."""
    return [i for i, n in enumerate(out_lens) if n - 1 > t]


def decode_steps(prompt_lens: list[int], out_lens: list[int]) -> list[list[int]]:
    """The KV length of each request in each decode step of the run, step 0 first (see above)."""
    return [[prompt_lens[i] + t + 1 for i in alive(out_lens, t)] for t in range(max(out_lens) - 1)]


def replay(args, shape, layers: int, dtype: torch.dtype, prompt_lens: list[int], out_lens: list[int]) -> Replay:
    """Time every args.every-th decode step's attention (one layer's call) and count it for the run."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    h, h_kv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    batch, room = len(prompt_lens), max(p + n for p, n in zip(prompt_lens, out_lens))
    slots = torch.randperm(batch * room, device=device, dtype=torch.int32) + 1  # slot 0 unused
    req_to_token = slots.view(batch, room)
    k_buf = torch.randn(batch * room + 1, h_kv, d, device=device).to(dtype)
    v_buf = torch.randn(batch * room + 1, h_kv, d, device=device).to(dtype)
    q_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kv_bytes, sms = k_buf.element_size(), num_sms(device)
    result = Replay()
    steps = decode_steps(prompt_lens, out_lens)
    for t, lens in enumerate(steps):
        if t % args.every:
            continue
        rows = torch.tensor(alive(out_lens, t), device=device)
        seq = torch.tensor(lens, device=device, dtype=torch.int32)
        q = torch.randn(len(lens), h, d, device=device, dtype=q_dtype)
        splits, bound = decode_kv_splits(seq, h, h_kv, sms, DEFAULT_MAX_KV_SPLITS, kv_bytes=kv_bytes, head_dim=d)
        order = decode_order(seq, h, h_kv, bound, sms, kv_bytes, d)
        # The workspace and semaphores as the backend's CUDA graphs hold them: every split's room.
        mid_o = torch.empty(len(lens), h, DEFAULT_MAX_KV_SPLITS, d, dtype=torch.float32, device=device)
        mid_lse = torch.empty(len(lens), h, DEFAULT_MAX_KV_SPLITS, dtype=torch.float32, device=device)
        sems = torch.zeros(decode_semaphore_count(len(lens), h, h_kv), dtype=torch.int32, device=device)

        def call(
            q=q, seq=seq, rows=rows, splits=splits, bound=bound, order=order, mid_o=mid_o, mid_lse=mid_lse, sems=sems
        ):
            return decode_attention(
                q, k_buf, v_buf, req_to_token, rows, seq, d**-0.5, num_kv_splits=splits, max_kv_splits=bound,
                mid_o=mid_o, mid_lse=mid_lse, order=order, semaphores=sems,
            )  # fmt: skip

        counted = min(args.every, len(steps) - t)  # this step stands for the ones up to the next timed one
        seconds = time_ms(call, device.type == "cuda") * 1e-3
        read = sum(lens) * h_kv * d * 2 * kv_bytes
        result.add(len(lens), counted, seconds * counted * layers, read * counted * layers)
    return result


def report(name: str, r: Replay) -> list[str]:
    total = r.total
    lines = [f"{name}: attention {total.seconds:.3f} s for {total.kv_bytes / 1e12:.2f} TB of KV"
             f" = {total.kv_bytes / max(total.seconds, 1e-12) / 1e12:.2f} TB/s"]  # fmt: skip
    for edge, b in sorted(r.buckets.items()):
        rate = b.kv_bytes / max(b.seconds, 1e-12) / 1e12
        lines.append(f"   batch <= {edge:3d}: {b.steps:4d} steps, {b.seconds:.3f} s, {rate:.2f} TB/s")
    return lines


def main(argv: list[str] | None = None) -> dict[str, Replay]:
    ap = offline_gpu.arg_parser()
    ap.description = __doc__
    ap.add_argument("--variant", action="append", default=None, help="name[:module.NAME=value,...]; repeat")
    ap.add_argument("--every", type=int, default=16, help="time every N-th decode step (each counts N)")
    args = ap.parse_args(argv)
    if args.every < 1:
        ap.error("--every must be at least 1")
    variants = parse_variants(ap, args.variant or ["base"])
    config = json.loads((offline_gpu.CONFIGS_DIR / f"{args.model}.json").read_text())
    prompts, out_lens = offline_gpu.make_workload(
        args.num_seqs, args.min_len, args.max_len, config["vocab_size"], args.seed
    )
    model_dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    dtype = kv_cache_dtype(args.kv_cache_dtype, model_dtype)
    shape, layers = config_shape(args.model), config["num_hidden_layers"]
    print(f"== decode attention of offline {args.model}, {len(prompts)} requests, KV {dtype}, every {args.every} steps")
    results = {}
    for name, variant in variants.items():
        with applied(variant):
            results[name] = replay(args, shape, layers, dtype, [len(p) for p in prompts], out_lens)
        print("\n".join(report(name, results[name])), flush=True)
    return results


if __name__ == "__main__":
    main()
