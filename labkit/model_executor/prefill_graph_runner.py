"""PrefillGraphRunner: extend and mixed forwards of few new tokens, captured as CUDA graphs.

An eager extend forward launches every layer's kernels from Python: on a small model a prefill of a
few hundred tokens costs tens of milliseconds of host time for a millisecond of GPU work (the
embedded model's 30 layers: some 300 launches, docs/benchmarks.md). Short prompts, a cached prefix
plus a few new tokens, chunked prefill's last pieces and small mixed batches are all such forwards,
and their time is the time to first token. So, like the decode graphs (cuda_graph_runner.py):

- one graph per token count in `capture_token_counts`; a forward of T new tokens replays the
  smallest captured count >= T, and the tokens after T belong to a padding request: token 0 at
  position 0 of request slot 0, its K/V written to the pool's reserved slot 0, attending only to the
  padding tokens before it;
- the graph covers the decoder layers up to the final hidden states, whose rows T.. are dropped; the
  logits step (each request's last token onto the vocabulary, prompt logprobs) runs after the replay,
  eagerly, from the real batch;
- a graph has a fixed number of request rows (the real requests, the padding one, then empty ones
  with no tokens) and the attention backend a fixed tile grid (idle tiles point at the last, empty
  row): see the prefill hooks of AttentionBackend.

Forwards with more tokens or requests than captured, that ask for prompt logprobs, or that record
expert load run eagerly.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch

from labkit.model_executor.cuda_graph_runner import PAD_REQ_POOL_IDX, PAD_SLOT, capture_graphs
from labkit.model_executor.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from labkit.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

MIN_TOKENS = 16


def capture_token_counts(max_tokens: int) -> list[int]:
    """16, 24, 32, 48, 64, ...: powers of two and the midpoints between them (at most a third of a
    replay's tokens are padding), cut at max_tokens, which is always included."""
    if max_tokens < 1:
        raise ValueError(f"cuda_graph_max_prefill_tokens must be >= 1 here, got {max_tokens}")
    counts, n = [], MIN_TOKENS
    while n < max_tokens:
        counts += [c for c in (n, n * 3 // 2) if c < max_tokens]
        n *= 2
    return [*counts, max_tokens]


class PrefillGraphRunner:
    """Captures the model's hidden states for extend forwards of every count in
    capture_token_counts(max_tokens), up to max_reqs requests, and replays them (see the module
    docstring). use_cuda_graph=False runs the same padded, static-buffer path eagerly (tests)."""

    def __init__(self, model_runner: ModelRunner, max_tokens: int, max_reqs: int, use_cuda_graph: bool = True) -> None:
        model = model_runner.model
        self.hidden_states = cast(Callable[..., torch.Tensor], model.hidden_states)
        self.compute_logits = cast(Callable[..., torch.Tensor], model.compute_logits)
        self.attn_backend = model_runner.attn_backend
        self.device = model_runner.device
        self.use_cuda_graph = use_cuda_graph
        self.token_counts = capture_token_counts(max_tokens)
        self.max_tokens = self.token_counts[-1]
        self.max_reqs = max_reqs
        self.num_replays = 0  # forwards served by this runner (tests and benchmarks read it)
        self.num_padded_tokens = 0
        max_rows = self._rows(self.max_tokens)
        # Raises NotImplementedError when the backend cannot be captured (the caller handles it).
        self.attn_backend.init_prefill_graph_state(self.max_tokens, max_rows)

        def buf(size: int, fill: int) -> torch.Tensor:
            return torch.full((size,), fill, dtype=torch.int64, device=self.device)

        self.input_ids, self.positions = buf(max_tokens, 0), buf(max_tokens, 0)
        self.out_cache_loc = buf(max_tokens, PAD_SLOT)
        self.req_pool_indices, self.seq_lens = buf(max_rows, PAD_REQ_POOL_IDX), buf(max_rows, 0)
        self.forward_batches = {t: self._static_batch(model_runner, t) for t in self.token_counts}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if use_cuda_graph:
            start = time.perf_counter()

            def prepare(t: int) -> None:
                self.attn_backend.init_forward_metadata_capture_prefill_graph(self.forward_batches[t])

            self.graphs, self.outputs = capture_graphs(self.token_counts, prepare, self._run_model, self.device)
            logger.info(
                "captured %d CUDA graphs for prefills of up to %d tokens in %.1f s",
                len(self.graphs),
                self.max_tokens,
                time.perf_counter() - start,
            )

    def _rows(self, num_tokens: int) -> int:
        """Request rows of the graph of num_tokens: as many requests as it can hold (each has a token),
        the padding request and an empty last row."""
        return min(num_tokens, self.max_reqs) + 2

    def _static_batch(self, model_runner: ModelRunner, num_tokens: int) -> ForwardBatch:
        """The EXTEND ForwardBatch of the graph of num_tokens: views of the static buffers, its rows
        at capture one padding request holding every token (the lists change at each replay)."""
        rows = self._rows(num_tokens)
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=rows,
            input_ids=self.input_ids[:num_tokens],
            positions=self.positions[:num_tokens],
            req_pool_indices=self.req_pool_indices[:rows],
            seq_lens=self.seq_lens[:rows],
            out_cache_loc=self.out_cache_loc[:num_tokens],
            seq_lens_cpu=[num_tokens] + [0] * (rows - 1),
            extend_prefix_lens_cpu=[0] * rows,
            extend_seq_lens_cpu=[num_tokens] + [0] * (rows - 1),
            req_to_token_pool=model_runner.req_to_token_pool,
            token_to_kv_pool=model_runner.token_to_kv_pool,
            attn_backend=self.attn_backend,
        )

    def _run_model(self, num_tokens: int) -> torch.Tensor:
        fb = self.forward_batches[num_tokens]
        return self.hidden_states(fb.input_ids, fb.positions, fb)

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        fb = forward_batch
        return (
            fb.forward_mode.is_extend()
            and fb.input_logprobs is None
            and 0 < fb.num_tokens <= self.max_tokens
            and fb.batch_size <= self.max_reqs
        )

    @torch.inference_mode()
    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """The logits of an extend forward (as the model's forward returns them)."""
        fb, n, num_tokens = forward_batch, forward_batch.batch_size, forward_batch.num_tokens
        t = self.token_counts[bisect.bisect_left(self.token_counts, num_tokens)]
        static = self.forward_batches[t]
        pad, empty = t - num_tokens, static.batch_size - n - 1
        self.input_ids[:num_tokens].copy_(fb.input_ids)
        self.positions[:num_tokens].copy_(fb.positions)
        self.out_cache_loc[:num_tokens].copy_(fb.out_cache_loc)
        self.req_pool_indices[:n].copy_(fb.req_pool_indices)
        self.seq_lens[:n].copy_(fb.seq_lens)
        if pad:
            self.input_ids[num_tokens:t].zero_()
            self.positions[num_tokens:t].zero_()
            self.out_cache_loc[num_tokens:t].fill_(PAD_SLOT)
        self.req_pool_indices[n : static.batch_size].fill_(PAD_REQ_POOL_IDX)
        static.seq_lens_cpu = [*fb.seq_lens_cpu, pad, *[0] * empty]
        static.extend_prefix_lens_cpu = [*fb.extend_prefix_lens_cpu, *[0] * (empty + 1)]
        static.extend_seq_lens_cpu = [*fb.extend_seq_lens_cpu, pad, *[0] * empty]
        if self.use_cuda_graph:
            self.attn_backend.init_forward_metadata_replay_prefill_graph(static)
            self.graphs[t].replay()
            hidden = self.outputs[t]
        else:  # the same hooks and buffers, run eagerly
            self.attn_backend.init_forward_metadata_capture_prefill_graph(static)
            hidden = self._run_model(t)
        self.num_replays += 1
        self.num_padded_tokens += pad
        return self.compute_logits(hidden[:num_tokens], fb)
