"""Timings of the attention kernels on a CUDA device against their floors, torch's SDPA and (where
it is installed) FlashInfer's kernels on the same inputs.

    python -m labkit.kernels.bench            # prints one table (median milliseconds)

Decode is memory-bound: floor = bytes of K and V read / measured copy bandwidth. Extend (prefill) is
compute-bound: floor = causal FLOPs / measured bf16 matmul rate. Both ceilings are measured here.
Decode is timed as CUDA-graph replays, as the engine runs it: timed eagerly, the small decode cases
measure the host's kernel launches instead (docs/benchmarks.md has both figures). Extend runs eagerly
in the engine and is timed so."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from labkit.kernels import ExtendPlan, decode_attention, decode_kv_splits, extend_attention
from labkit.kernels.decode import DEFAULT_MAX_KV_SPLITS, num_sms
from labkit.kernels.extend import extend_blocks


def measure_ceilings(device: torch.device, copy_elements: int = 1 << 28) -> tuple[float, float]:
    """(copy bandwidth in bytes/s from a device-to-device copy of copy_elements bf16 values, counting
    read + write; bf16 matmul FLOP/s from an 8192^3 product of random matrices), both measured."""
    src = torch.randn(copy_elements, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(functools.partial(dst.copy_, src), warmup=50, rep=200, return_mode="median")
    bw = 2 * src.numel() * src.element_size() / (ms * 1e-3)
    del src, dst
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=200, return_mode="median")
    return bw, 2 * 8192**3 / (ms * 1e-3)


def _pool(batch: int, seq_len: int, num_kv_heads: int, head_dim: int, page_size: int, dtype, device):
    pages_per_req = -(-seq_len // page_size)
    num_pages = batch * pages_per_req + 1
    pages = (torch.randperm(num_pages - 1, device=device) + 1).view(batch, pages_per_req)
    slots = (pages[:, :, None] * page_size + torch.arange(page_size, device=device)).view(batch, -1)
    req_to_token = slots[:, :seq_len].contiguous()
    k = torch.randn(num_pages * page_size, num_kv_heads, head_dim, device=device, dtype=dtype)
    return k, torch.randn_like(k), req_to_token


@dataclass
class DecodeCase:
    """One decode_attention call ready to run: its inputs and the split bound its workspace has."""

    q: torch.Tensor
    k_buf: torch.Tensor
    v_buf: torch.Tensor
    req_to_token: torch.Tensor
    bound: int
    call: Callable[[], object]


def prepare_decode(
    batch: int,
    seq_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
    max_kv_splits: int = DEFAULT_MAX_KV_SPLITS,
) -> DecodeCase:
    """`batch` requests of `seq_len` tokens of KV each, in shuffled pages, prepared as the engine's
    decode graph is (splits and workspace made outside, so `call` runs only the kernels)."""
    k_buf, v_buf, r2t = _pool(batch, seq_len, num_kv_heads, head_dim, page_size, dtype, device)
    q = torch.randn(batch, num_heads, head_dim, device=device, dtype=dtype)
    rows = torch.arange(batch, device=device)
    seq = torch.full((batch,), seq_len, device=device)
    splits, bound = decode_kv_splits(seq, num_heads, num_kv_heads, num_sms(device), max_kv_splits)
    out = torch.empty_like(q)
    mid_o = torch.empty(batch, num_heads, bound, head_dim, dtype=torch.float32, device=device)
    mid_lse = torch.empty(batch, num_heads, bound, dtype=torch.float32, device=device)

    def call() -> torch.Tensor:
        return decode_attention(
            q, k_buf, v_buf, r2t, rows, seq, head_dim**-0.5,
            out=out, num_kv_splits=splits, max_kv_splits=bound, mid_o=mid_o, mid_lse=mid_lse,
        )  # fmt: skip

    return DecodeCase(q, k_buf, v_buf, r2t, bound, call)


def _replayed_ms(fn) -> float:
    """Median ms of fn captured in a CUDA graph and replayed (no host launch cost)."""
    torch.cuda.synchronize()  # Triton runs fn on a side stream: the inputs must be written first
    return triton.testing.do_bench_cudagraph(fn, return_mode="median")


def _flashinfer_decode(q, k_buf, v_buf, req_to_token, page_size: int, scale: float) -> float:
    """FlashInfer's paged decode over the same pages (req_to_token's every page_size-th slot)."""
    import flashinfer

    batch, seq_len = req_to_token.shape
    pages = (req_to_token[:, ::page_size] // page_size).to(torch.int32)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages.shape[1]
    last = torch.full((batch,), (seq_len - 1) % page_size + 1, dtype=torch.int32)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(256 << 20, dtype=torch.uint8, device=q.device),
        "NHD",
        use_tensor_cores=q.shape[1] // k_buf.shape[1] >= 4,
    )
    wrapper.plan(
        indptr,
        pages.flatten(),
        last,
        q.shape[1],
        k_buf.shape[1],
        q.shape[2],
        page_size,
        q_data_type=q.dtype,
        sm_scale=scale,
    )
    kv = (k_buf.view(-1, page_size, *k_buf.shape[1:]), v_buf.view(-1, page_size, *v_buf.shape[1:]))
    return _replayed_ms(lambda: wrapper.run(q, kv))


def _flashinfer_prefill(q, k, v, batch: int, new: int, scale: float) -> float:
    """FlashInfer's causal prefill of `batch` requests of `new` tokens each (no prefix, contiguous K/V)."""
    import flashinfer

    indptr = torch.arange(batch + 1, dtype=torch.int32) * new
    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
        torch.zeros(256 << 20, dtype=torch.uint8, device=q.device), "NHD"
    )
    wrapper.plan(indptr, indptr, q.shape[1], k.shape[1], q.shape[2], causal=True, q_data_type=q.dtype, sm_scale=scale)
    return triton.testing.do_bench(lambda: wrapper.run(q, k, v), return_mode="median")


def main() -> None:
    device = torch.device("cuda")
    dtype = torch.bfloat16
    bw, flops = measure_ceilings(device)
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    has_flashinfer = importlib.util.find_spec("flashinfer") is not None
    print(f"{'case':<44} {'ms':>8} {'floor':>8} {'sdpa':>8} {'flashinf':>8}  achieved (labkit)")
    num_heads, num_kv_heads, head_dim, page_size = 32, 8, 128, 16
    scale = head_dim**-0.5
    for batch, seq_len in [(1, 32768), (8, 4096), (64, 4096), (256, 1024)]:
        case = prepare_decode(batch, seq_len, num_heads, num_kv_heads, head_dim, page_size, dtype, device)
        q, k_buf, v_buf, r2t = case.q, case.k_buf, case.v_buf, case.req_to_token
        ms = _replayed_ms(case.call)
        floor = 2 * batch * seq_len * num_kv_heads * head_dim * 2 / bw * 1e3
        # SDPA on contiguous K/V (no paging): what a dense kernel does with the same bytes.
        kd = k_buf[r2t].transpose(1, 2)  # [B, H_kv, L, D]
        vd = v_buf[r2t].transpose(1, 2)
        sd = _replayed_ms(
            lambda: torch.nn.functional.scaled_dot_product_attention(
                q[:, :, None], kd, vd, scale=scale, enable_gqa=True
            )
        )
        fi = _flashinfer_decode(q, k_buf, v_buf, r2t, page_size, scale) if has_flashinfer else float("nan")
        print(
            f"{f'decode B={batch} L={seq_len} h32/kv8 d128 page16':<44} {ms:8.3f} {floor:8.3f} {sd:8.3f} "
            f"{fi:8.3f}  {floor / ms * bw / 1e12:.2f} TB/s"
        )
        del k_buf, v_buf, kd, vd
    for batch, prefix, new in [(1, 0, 4096), (4, 0, 2048), (8, 0, 2048), (4, 4096, 512)]:
        k_buf, v_buf, r2t = _pool(batch, max(prefix, 1), num_kv_heads, head_dim, page_size, dtype, device)
        total = batch * new
        q = torch.randn(total, num_heads, head_dim, device=device, dtype=dtype)
        k = torch.randn(total, num_kv_heads, head_dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
        rows = torch.arange(batch, device=device)
        prefix_lens = torch.full((batch,), prefix, device=device)
        ext = torch.full((batch,), new, device=device)
        starts = torch.arange(batch, device=device) * new
        plan = ExtendPlan.build([new] * batch, extend_blocks(head_dim, num_heads // num_kv_heads, dtype), device)
        ms = triton.testing.do_bench(
            lambda: extend_attention(q, k, v, k_buf, v_buf, r2t, rows, prefix_lens, ext, starts, scale, plan=plan),
            return_mode="median",
        )
        flop = 4 * batch * num_heads * head_dim * (new * prefix + new * (new + 1) / 2)
        qd = q.view(batch, new, num_heads, head_dim).transpose(1, 2)
        kd = k.view(batch, new, num_kv_heads, head_dim).transpose(1, 2)
        vd = v.view(batch, new, num_kv_heads, head_dim).transpose(1, 2)
        sd = (
            triton.testing.do_bench(
                lambda: torch.nn.functional.scaled_dot_product_attention(
                    qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True
                ),
                return_mode="median",
            )
            if prefix == 0
            else float("nan")
        )
        fi = _flashinfer_prefill(q, k, v, batch, new, scale) if has_flashinfer and prefix == 0 else float("nan")
        print(
            f"{f'extend B={batch} prefix={prefix} new={new} h32/kv8 d128':<44} {ms:8.3f} "
            f"{flop / flops * 1e3:8.3f} {sd:8.3f} {fi:8.3f}  {flop / ms / 1e9:.0f} TFLOP/s"
        )


if __name__ == "__main__":
    main()
