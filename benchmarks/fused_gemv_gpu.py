"""Batch-1 decode with the norms and the MLP activation fused into the GEMV's prologue (the default)
and with them as separate kernels, alternated in one process so both see the same GPU:

    python benchmarks/fused_gemv_gpu.py [--rounds 2] [--profile]

Qwen3-0.6B and Qwen2.5-0.5B shapes, random bf16 weights, CUDA graphs: labkit.bench.offline_gpu's
batch-1 measurement (512-token prompt, 256 output tokens). The separate kernels are restored by
swapping in the unfused forms of the two layer methods that take the fused kernels
(ColumnParallelLinear.forward_normed, LinearBase.matmul) and turning the fused qkv kernel off.
--profile adds one profiled decode step table of Qwen3-0.6B each way (labkit.bench.profile_step:
kernels and launches per step).
"""

from __future__ import annotations

import argparse
import json

from labkit.bench import offline_gpu, profile_step
from labkit.kernels import gemv_qkv
from labkit.layers.linear import ColumnParallelLinear, LinearBase
from labkit.layers.rmsnorm import RMSNorm

MODELS = ["qwen3-0.6b", "qwen2.5-0.5b"]
FUSED = {"forward_normed": ColumnParallelLinear.forward_normed, "matmul": LinearBase.matmul}


def unfused_forward_normed(self, x, residual, norm: RMSNorm):
    normed, residual = norm.add_and_norm(x, residual)
    return self(normed), residual


def unfused_matmul(self, x, bias, act=None):
    return FUSED["matmul"](self, x if act is None else act(x), bias)


def use_fused(fused: bool) -> None:
    gemv_qkv.ENABLED = fused  # the fused qkv kernel has the norm in it too (LlamaAttention.forward_normed)
    ColumnParallelLinear.forward_normed = FUSED["forward_normed"] if fused else unfused_forward_normed  # type: ignore[method-assign]
    LinearBase.matmul = FUSED["matmul"] if fused else unfused_matmul  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="each round runs both ways, the order alternating")
    ap.add_argument("--profile", action="store_true")
    cli = ap.parse_args()
    args = offline_gpu.arg_parser().parse_args(["--skip-hf"])
    results: dict[str, list[float]] = {}
    for round_ in range(cli.rounds):
        for model in MODELS:
            vocab = json.loads((offline_gpu.CONFIGS_DIR / f"{model}.json").read_text())["vocab_size"]
            prompt = offline_gpu.make_requests(1, args.batch1_input, args.batch1_input, vocab, args.seed)[0]
            for fused in (False, True) if round_ % 2 == 0 else (True, False):
                use_fused(fused)
                runs, _ = offline_gpu.batch1_ms_per_token(model, args, "graphs", prompt, args.batch1_output)
                ms = runs[0]
                name = f"{model} {'fused' if fused else 'separate kernels'}"
                results.setdefault(name, []).append(round(ms, 3))
                print(f"{name}: {ms:.3f} ms/token", flush=True)
    print(json.dumps(results))
    if cli.profile:
        for fused in (False, True):
            use_fused(fused)
            print("== fused" if fused else "== separate kernels", flush=True)
            profile_step.main(["--model", MODELS[0], "--batch", "1", "--context", "512", "--steps", "100"])
    use_fused(True)


if __name__ == "__main__":
    main()
