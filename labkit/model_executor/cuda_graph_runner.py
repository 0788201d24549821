"""CudaGraphRunner: the model's decode forward, captured once per batch size as a CUDA graph and
replayed.

A decode step of a small model launches about a thousand small kernels; from Python that costs
more than the GPU work itself. A CUDA graph records those launches once and replays them with a
single call. A graph replays fixed addresses and fixed shapes, so:

- the forward's inputs (input_ids, positions, req_pool_indices, seq_lens, out_cache_loc) live in
  static buffers sized for the largest captured batch; a replay copies the step's values into them;
- one graph is captured per batch size in `capture_batch_sizes`; a batch of n requests replays the
  smallest captured size >= n, and the rows after n are padding: token 0 at position 0 of request
  slot 0 with seq_len 1, its K/V written to slot 0 of the pool's reserved first page (never handed
  out by the allocator, see TokenToKVPool), so padding reads only valid slots and overwrites no real
  KV; their logits are dropped;
- the attention backend keeps its per-step metadata in buffers of its own, filled in place by its
  `init_forward_metadata_replay_cuda_graph` hook (see AttentionBackend), which may plan on the host
  from the step's lengths (FlashInfer does);
- the logits of the real rows are copied out of the graph's output, so a later replay cannot
  overwrite what the caller holds. Sampling runs outside the graph, eagerly;
- with tensor parallelism the graph's all-reduces go through the custom all-reduce (NCCL stays out
  of the graph, see labkit/distributed/custom_all_reduce.py) and the graph outputs each rank's
  vocabulary range: the logits are gathered after the replay, eagerly.

Extend and mixed forwards, and decode batches larger than the largest captured size, run eagerly.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch

from labkit.model_executor.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from labkit.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

PAD_SLOT = 0  # the reserved first page's first slot: where padded rows write their K/V
PAD_REQ_POOL_IDX = 0  # any request slot: a padded row reads req_to_token[0, 0], always a valid slot index
WARMUP_FORWARDS = 2  # eager forwards before a capture (Triton compilation, cuBLAS algorithm choice)


def capture_batch_sizes(max_bs: int) -> list[int]:
    """The batch sizes to capture: 1, 2, 4, 8, then steps of 8 up to 256 and of 16 beyond, cut at
    max_bs, which is always included."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
    sizes = [bs for bs in (1, 2, 4, 8) if bs <= max_bs]
    sizes += list(range(16, min(max_bs, 256) + 1, 8)) + list(range(272, max_bs + 1, 16))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


@torch.inference_mode()
def capture_graphs(
    keys: list[int], prepare: Callable[[int], None], run: Callable[[int], torch.Tensor], device: torch.device
) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, torch.Tensor]]:
    """One CUDA graph of `run(key)` per key, largest key first, all in one shared memory pool (a
    smaller graph reuses the larger ones' freed intermediates; graphs of one pool never run
    concurrently). `prepare(key)` sets up the metadata before the warm-up forwards and the capture.
    Returns the graphs and their output tensors (overwritten by each replay)."""
    pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream(device)
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, torch.Tensor] = {}
    # No garbage collection while capturing: an object of an earlier run collected mid-capture
    # (a pinned host buffer of a sampled step, say) is freed with CUDA calls that are illegal
    # there and invalidate the capture. On an H200, tests/test_cuda_graph.py failed one case a
    # run that way (2 runs of 2); with collection held off, 5 runs of 36 passed.
    gc.collect()
    gc.disable()
    try:
        for key in sorted(keys, reverse=True):
            prepare(key)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # warm up off the capture stream, as PyTorch advises
                for _ in range(WARMUP_FORWARDS):
                    run(key)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs[key] = run(key)
            graphs[key] = graph
    finally:
        gc.enable()
    torch.cuda.synchronize(device)
    return graphs, outputs


class CudaGraphRunner:
    """Captures `model_runner.model`'s decode forward for every size in capture_batch_sizes(max_bs)
    and replays it (see the module docstring).

    use_cuda_graph=False runs the very same padded, static-buffer path eagerly, hooks included, with
    no capture: the padding and metadata logic can then be tested without a GPU."""

    def __init__(self, model_runner: ModelRunner, max_bs: int, use_cuda_graph: bool = True) -> None:
        self.decode_model = model_runner.decode_model
        self.attn_backend = model_runner.attn_backend
        self.device = model_runner.device
        self.use_cuda_graph = use_cuda_graph
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        self.num_replays = 0  # decode forwards served by this runner (tests and benchmarks read it)
        self.num_padded_rows = 0  # padding rows run in those forwards
        self.local_logits = model_runner.tp.size > 1  # the graphs output this rank's vocabulary range
        self.gather_logits = cast(Callable[[torch.Tensor], torch.Tensor], model_runner.model.gather_logits)
        # Raises NotImplementedError when the backend cannot be captured (the caller handles it).
        self.attn_backend.init_cuda_graph_state(self.max_bs)
        with torch.inference_mode():

            def buf(fill: int) -> torch.Tensor:
                return torch.full((self.max_bs,), fill, dtype=torch.int64, device=self.device)

            self.input_ids, self.positions = buf(0), buf(0)
            self.req_pool_indices, self.seq_lens, self.out_cache_loc = buf(PAD_REQ_POOL_IDX), buf(1), buf(PAD_SLOT)
        self.forward_batches = {bs: self._static_batch(model_runner, bs) for bs in self.batch_sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if use_cuda_graph:
            start = time.perf_counter()
            self.capture()
            logger.info(
                "captured %d CUDA graphs for decode batches of 1..%d in %.1f s",
                len(self.graphs),
                self.max_bs,
                time.perf_counter() - start,
            )

    def _static_batch(self, model_runner: ModelRunner, bs: int) -> ForwardBatch:
        """The DECODE ForwardBatch of the first bs rows of the static buffers. The *_cpu lists are
        placeholders, but for seq_lens_cpu, set to the step's lengths before each replay hook."""
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            seq_lens_cpu=[1] * bs,
            extend_prefix_lens_cpu=[0] * bs,
            extend_seq_lens_cpu=[1] * bs,
            req_to_token_pool=model_runner.req_to_token_pool,
            token_to_kv_pool=model_runner.token_to_kv_pool,
            attn_backend=self.attn_backend,
        )

    def _run_model(self, fb: ForwardBatch) -> torch.Tensor:
        return self.decode_model(fb.batch_size)(fb.input_ids, fb.positions, fb, gather_logits=not self.local_logits)

    def capture(self) -> None:
        def prepare(bs: int) -> None:
            self.attn_backend.init_forward_metadata_capture_cuda_graph(self.forward_batches[bs])

        self.graphs, self.outputs = capture_graphs(
            self.batch_sizes, prepare, lambda bs: self._run_model(self.forward_batches[bs]), self.device
        )

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        return forward_batch.forward_mode.is_decode() and 0 < forward_batch.batch_size <= self.max_bs

    def padded_size(self, batch_size: int) -> int:
        """The captured size a batch of batch_size requests replays."""
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, batch_size)]

    @torch.inference_mode()
    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits [n, vocab] (model dtype) of a DECODE batch of n <= max_bs requests. From a graph they are
        a view of its output buffer, valid until the next replay: the caller samples from them first
        (on the same stream), and no copy of up to 78 MB a step is made (256 rows of a 151,936-token
        vocabulary in bf16)."""
        fb, n = forward_batch, forward_batch.batch_size
        bs = self.padded_size(n)
        self.input_ids[:n].copy_(fb.input_ids)
        self.positions[:n].copy_(fb.positions)
        self.req_pool_indices[:n].copy_(fb.req_pool_indices)
        self.seq_lens[:n].copy_(fb.seq_lens)
        self.out_cache_loc[:n].copy_(fb.out_cache_loc)
        if bs > n:  # rows n..bs-1 may hold an earlier, larger batch's values: reset them to padding
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.req_pool_indices[n:bs].fill_(PAD_REQ_POOL_IDX)
            self.seq_lens[n:bs].fill_(1)
            self.out_cache_loc[n:bs].fill_(PAD_SLOT)
        static = self.forward_batches[bs]
        static.seq_lens_cpu = [*fb.seq_lens_cpu, *[1] * (bs - n)]  # for backends that plan on the host
        if self.use_cuda_graph:
            self.attn_backend.init_forward_metadata_replay_cuda_graph(static)
            self.graphs[bs].replay()
            out = self.outputs[bs]
        else:  # the same hooks and buffers, run eagerly
            self.attn_backend.init_forward_metadata_capture_cuda_graph(static)
            self.attn_backend.init_forward_metadata_replay_cuda_graph(static)
            out = self._run_model(static)
        self.num_replays += 1
        self.num_padded_rows += bs - n
        return self.gather_logits(out[:n]) if self.local_logits else out[:n]
