"""One-row linear layers on a GPU: cuBLAS (F.linear) against labkit's gemv kernel.

    python -m labkit.kernels.bench_gemv [--sweep] [--qkv]

The projections of a batch-1 decode step of Qwen3-0.6B and Qwen2.5-0.5B, bf16. Each is timed as
replays of a CUDA graph of 16 calls on 16 different weight copies (more bytes than the L2 holds, so
every call reads its weight from HBM, as in a real step): microseconds per call and the bandwidth it
reaches; the gemv with the split of K it picks (gemv_split_k) and with each power-of-two split (the
linear layers take the gemv for every single 16-bit row on CUDA: labkit.layers.linear).
--qkv times a layer's attention inputs both ways: gemv_rmsnorm, rotary_embedding and store_kv (three
kernels) against gemv_qkv_rope_store (one), in microseconds per layer."""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton

from labkit.kernels.decode import num_sms
from labkit.kernels.gemv import (
    MAX_SPLIT_K,
    Split,
    Tiles,
    default_tiles,
    gemv,
    gemv_rmsnorm,
    gemv_split_k,
    semaphore_count,
)
from labkit.kernels.gemv_qkv import QKVHeads, gemv_qkv_rope_store
from labkit.kernels.kv_cache import store_kv
from labkit.kernels.pdl import pdl_options
from labkit.kernels.rotary import rotary_embedding

SHAPES = {  # name: (out_features N, in_features K)
    "qwen3-0.6b qkv_proj": (4096, 1024),
    "qwen3-0.6b o_proj": (1024, 2048),
    "qwen3-0.6b gate_up_proj": (6144, 1024),
    "qwen3-0.6b down_proj": (1024, 3072),
    "qwen2.5-0.5b qkv_proj": (1152, 896),
    "qwen2.5-0.5b o_proj": (896, 896),
    "qwen2.5-0.5b gate_up_proj": (9728, 896),
    "qwen2.5-0.5b down_proj": (896, 4864),
    "llama-3-8b qkv_proj": (6144, 4096),
    "llama-3-8b o_proj": (4096, 4096),
    "llama-3-8b gate_up_proj": (28672, 4096),
    "llama-3-8b down_proj": (4096, 14336),
}
QKV_HEADS = {  # name: (hidden, query heads, KV heads, head size, qkv bias, q/k norm)
    "qwen3-0.6b": (1024, 16, 8, 128, False, True),
    "qwen2.5-0.5b": (896, 14, 2, 64, True, False),
    "llama-3-8b": (4096, 32, 8, 128, False, False),
}
COPIES = 16
SWEEP_BLOCK_N, SWEEP_BLOCK_K, SWEEP_WARPS = (4, 8, 16, 32), (256, 512, 1024, 2048), (2, 4, 8)


def replayed_us(calls: list[Callable[[], torch.Tensor]]) -> float:
    """Median microseconds per call of `calls` captured in one CUDA graph and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compilation) off the capture stream
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return triton.testing.do_bench(graph.replay, return_mode="median") * 1e3 / len(calls)


def gemv_us(x: torch.Tensor, weights: list[torch.Tensor], split: Split) -> float:
    return replayed_us([lambda w=w: gemv(x, w, None, split) for w in weights])


def chosen_split(n: int, k: int, device: torch.device) -> int:
    """The split gemv_split_k picks for a launch of a one-row GEMV on this device (PDL or not)."""
    return gemv_split_k(n, k, num_sms(device), pdl_options(device, 1)["PDL"])


def sweep(n: int, k: int, x: torch.Tensor, weights: list[torch.Tensor]) -> None:
    """Every tile shape at the chosen split, fastest first (what default_tiles was picked from)."""
    split_k = chosen_split(n, k, x.device)
    semaphores = torch.zeros(triton.cdiv(n, min(SWEEP_BLOCK_N)), dtype=torch.int32, device="cuda")
    k_split = triton.cdiv(k, split_k)
    times = {}
    for bn, bk, warps in itertools.product(SWEEP_BLOCK_N, SWEEP_BLOCK_K, SWEEP_WARPS):
        if bk > 2 * triton.next_power_of_2(k_split) or bn * bk > 16384:
            continue
        times[(bn, bk, warps)] = gemv_us(x, weights, Split(split_k, semaphores, Tiles(bn, bk, warps)))
    default = default_tiles(n, k, num_sms(x.device), split_k)
    best = sorted(times.items(), key=lambda kv: kv[1])[:5]
    print(f"    default {default}: {times[(default.block_n, default.block_k, default.num_warps)]:.2f} us; best:")
    print("    " + ", ".join(f"(block_n {bn}, block_k {bk}, warps {w}) {t:.2f}" for (bn, bk, w), t in best))


def qkv_us(hidden: int, num_q: int, num_kv: int, d: int, bias: bool, qk_norm: bool) -> tuple[float, float]:
    """Microseconds per layer from the residual stream to q and the pool's K/V: the three kernels,
    then the fused one (COPIES layers of their own weights per graph)."""
    n = (num_q + 2 * num_kv) * d

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    x, residual, norm_weight = rand(1, hidden), rand(1, hidden), rand(hidden)
    weights = [(rand(n, hidden), rand(n) if bias else None) for _ in range(COPIES)]
    norms = (rand(d), rand(d)) if qk_norm else None
    table = torch.randn(1, d, device="cuda")
    rows, loc = torch.zeros(1, dtype=torch.int64, device="cuda"), torch.zeros(1, dtype=torch.int64, device="cuda")
    k_buf, v_buf = rand(64, num_kv, d), rand(64, num_kv, d)
    split = Split(None, torch.zeros(semaphore_count(n), dtype=torch.int32, device="cuda"))
    heads = QKVHeads(num_q, num_kv, d, torch.zeros(num_q + num_kv, dtype=torch.int32, device="cuda"), norms)

    def unfused(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        qkv, _ = gemv_rmsnorm(x, residual, norm_weight, 1e-6, w, b, split)
        q, k, v = qkv.view(1, -1, d).split([num_q, num_kv, num_kv], dim=1)
        q, k = rotary_embedding(rows, q, k, table, norm_weights=norms)
        store_kv(k_buf, v_buf, loc, k, v)
        return q

    def fused(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return gemv_qkv_rope_store(x, residual, norm_weight, 1e-6, w, b, split, heads, table, k_buf, v_buf, loc)[0]

    def layers_us(way: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]) -> float:
        return replayed_us([lambda w=w, b=b: way(w, b) for w, b in weights])

    return layers_us(unfused), layers_us(fused)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemv needs a CUDA device")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="also time every tile shape of each layer")
    ap.add_argument("--qkv", action="store_true", help="also time qkv_proj with the rotary and the KV store")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, bf16, one row, {COPIES} weight copies per graph")
    splits = [1 << i for i in range(MAX_SPLIT_K.bit_length())]
    header = f"{'layer':28} {'N':>6} {'K':>6} {'MB':>6} {'cuBLAS us':>10} {'TB/s':>5}"
    header += f" {'split':>5} {'gemv us':>8} {'TB/s':>5}"
    print(header + "".join(f" {f'split {s}':>8}" for s in splits))
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        semaphores = torch.zeros(semaphore_count(n), dtype=torch.int32, device="cuda")
        cublas = replayed_us([lambda w=w, x=x: F.linear(x, w) for w in weights])
        ours = gemv_us(x, weights, Split(None, semaphores))
        each = "".join(f" {gemv_us(x, weights, Split(s, semaphores)):8.2f}" for s in splits)
        mb = n * k * 2 / 1e6
        chosen = chosen_split(n, k, x.device)
        print(
            f"{name:28} {n:6} {k:6} {mb:6.1f} {cublas:10.2f} {mb / cublas:5.2f} {chosen:5} {ours:8.2f} {mb / ours:5.2f}"
            f"{each}"
        )
        if args.sweep:
            sweep(n, k, x, weights)
    if args.qkv:
        print("qkv_proj, rotary and the KV store, us per layer: three kernels, then gemv_qkv_rope_store")
        for name, shape in QKV_HEADS.items():
            print(f"{name:28} " + " ".join(f"{t:8.2f}" for t in qkv_us(*shape)))


if __name__ == "__main__":
    main()
