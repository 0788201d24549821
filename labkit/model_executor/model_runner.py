"""ModelRunner: loads the model, sizes and owns the memory pools, and runs forward + sampling."""

from __future__ import annotations

import json
import logging
import os
import secrets
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from labkit.attention import AttentionBackendConfig, get_attention_backend, resolve_attention_backend
from labkit.config import EngineConfig, ranks_per_node
from labkit.constrained.bitmask import VocabMask
from labkit.distributed.parallel_state import TPGroup
from labkit.layers.attention import Attention, compile_with_eager_attention
from labkit.layers.linear import LinearBase
from labkit.mem_cache.allocator import TokenToKVPoolAllocator
from labkit.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool, is_fp8, kv_cache_dtype
from labkit.model_executor.cuda_graph_runner import CudaGraphRunner
from labkit.model_executor.forward_batch import ForwardBatch, ForwardMode
from labkit.model_executor.future_map import FutureMap, HostSample
from labkit.model_executor.input_logprobs import InputLogprobs
from labkit.model_executor.prefill_graph_runner import PrefillGraphRunner
from labkit.model_loader.loader import checkpoint_kv_scales, load_model
from labkit.model_loader.weight_utils import kv_scales_from
from labkit.sampling.penalties import SamplingReq
from labkit.sampling.sampler import Sampler, SamplingBatchInfo

if TYPE_CHECKING:
    from labkit.scheduler.schedule_batch import ScheduleBatch, Tokenizer

logger = logging.getLogger(__name__)

GIB = 1 << 30


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The device of a rank: on CUDA, GPU `local_rank` of this node (ValueError if it has fewer)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda" or device.index is not None:
        return device
    if local_rank >= torch.cuda.device_count():
        raise ValueError(
            f"rank {local_rank} of this node needs GPU {local_rank}, but {torch.cuda.device_count()} are visible"
        )
    return torch.device("cuda", local_rank)


def available_cores() -> int:
    """The cores this process may run on (its affinity where the OS reports one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_thread_count(requested: int, ranks: int, cores: int, default: int, env_set: bool) -> int | None:
    """Torch threads for one CPU rank, or None to leave torch's setting alone.

    Auto (requested 0) leaves a core free and splits the rest among the node's ranks: torch's OpenMP
    threads spin-wait at each op's end, so with every core busy (a Jupyter kernel's I/O thread, the
    server's tokenizer and detokenizer processes, other ranks) each op waits for its descheduled
    thread; on a 2-core machine a notebook ran 8 times slower with 2 threads than with 1."""
    if requested < 0:
        raise ValueError(f"cpu_threads must be >= 0, got {requested}")
    if requested:
        return requested
    if env_set:  # OMP_NUM_THREADS: the user's choice, already torch's
        return None
    return max(1, min(default, cores - 1) // ranks)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"unknown dtype {name!r}; choose auto or one of {sorted(dtypes)}")
    return dtypes[name]


def check_mem_fraction_static(fraction: float | None, device: torch.device) -> None:
    """ValueError unless --mem-fraction-static is unset, or in (0, 1) on a CUDA device."""
    if fraction is None:
        return
    if device.type != "cuda":
        raise ValueError(
            f"--mem-fraction-static sizes the KV pool from a GPU's memory; on {device.type} give its size "
            "with --kv-memory-gb or --max-total-tokens"
        )
    _check_fraction(fraction)


def _check_fraction(fraction: float) -> None:
    if not 0 < fraction < 1:
        raise ValueError(f"--mem-fraction-static must be in (0, 1), got {fraction}")


def kv_pool_bytes(fraction: float, free_bytes: int, total_bytes: int) -> int:
    """The KV pool's bytes by SGLang's rule, from a GPU's free and total bytes measured once the
    weights are loaded: free - total * (1 - fraction). Weights and pool then take `fraction` of the
    GPU; the rest stays for activations and the CUDA graphs (captured after the pool exists).
    ValueError when the fraction is not in (0, 1) or leaves nothing for the pool."""
    _check_fraction(fraction)
    reserved = round(total_bytes * (1 - fraction))
    pool = free_bytes - reserved
    if pool <= 0:
        raise ValueError(
            f"--mem-fraction-static {fraction} leaves no memory for the KV pool: the weights (and whatever "
            f"else holds GPU memory) take {(total_bytes - free_bytes) / GIB:.2f} GiB of "
            f"{total_bytes / GIB:.2f} GiB, and {reserved / GIB:.2f} GiB must stay free for activations and "
            "CUDA graphs; raise the fraction"
        )
    return pool


def tp_kv_pool_bytes(fraction: float, free_bytes: int, total_bytes: int, tp: TPGroup) -> tuple[int, int, int]:
    """Collective over `tp`, given this rank's GPU memory: (the KV pool bytes every rank takes, the
    free and total bytes of the rank that set it). The ranks' free memory can differ, and every rank
    must hold the same pool: the smallest kv_pool_bytes of them all. Every rank gets the same result,
    or the same ValueError."""
    gathered = b"".join(tp.gather_bytes(struct.pack("<2q", free_bytes, total_bytes)))  # b"" off the leader
    gpus = list(struct.iter_unpack("<2q", tp.broadcast_bytes(gathered if tp.is_leader else None)))
    budgets = [kv_pool_bytes(fraction, free, total) for free, total in gpus]
    tightest = budgets.index(min(budgets))
    return budgets[tightest], gpus[tightest][0], gpus[tightest][1]


def use_column_major_linears(model: torch.nn.Module) -> None:
    """Store each decoder linear layer's weight column-major: same [out, in] shape and values, but the
    memory is [in, out], so F.linear runs MKL's faster non-transposed product at small batches
    (docs/benchmarks.md). The lm_head stays row-major: its vocabulary-wide product is slower
    column-major from batch 4 up."""
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.weight.data = module.weight.data.t().contiguous().t()


def eos_ids_of(hf_config: Any, tokenizer: Tokenizer | None, model_dir: Path | None) -> set[int]:
    """EOS ids from the config, the tokenizer and generation_config.json (where instruct models such
    as Llama-3 list their end-of-turn token)."""
    sources = [getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    gen_config = model_dir / "generation_config.json" if model_dir is not None else None
    if gen_config is not None and gen_config.is_file():
        sources.append(json.loads(gen_config.read_text()).get("eos_token_id"))
    ids: set[int] = set()
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return ids


class ModelRunner:
    """Owns the model, the KV pools and the FutureMap of one engine (of one rank, with tensor
    parallelism: its share of the weights and the KV of its heads); runs a ScheduleBatch's forward
    and samples its next tokens. `tokenizer` (None for dummy weights) only contributes its EOS id."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer | None = None,
        model_dir: Path | None = None,
        tp: TPGroup | None = None,
    ):
        if config.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if config.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {config.cuda_graph_max_bs}")
        if config.cuda_graph_max_prefill_tokens < 0:
            raise ValueError(f"cuda_graph_max_prefill_tokens must be >= 0, got {config.cuda_graph_max_prefill_tokens}")
        self.config = config
        self.tp = tp or TPGroup()
        self.device = resolve_device(config.device, self.tp.rank % ranks_per_node(config))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            cores = available_cores()
            env_set = "OMP_NUM_THREADS" in os.environ
            threads = cpu_thread_count(
                config.cpu_threads, ranks_per_node(config), cores, torch.get_num_threads(), env_set
            )
            if threads is not None:
                torch.set_num_threads(threads)
        self.attention_backend = resolve_attention_backend(config.attention_backend, self.device)
        backend_cls = get_attention_backend(self.attention_backend)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_cache_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        if is_fp8(self.kv_cache_dtype) and not backend_cls.supports_fp8_kv_cache:
            raise ValueError(
                f"--kv-cache-dtype {config.kv_cache_dtype} is not supported by the {self.attention_backend} "
                "attention backend; use --attention-backend triton or torch_native, or --kv-cache-dtype auto"
            )
        check_mem_fraction_static(config.mem_fraction_static, self.device)
        torch.manual_seed(config.random_seed)
        self.model, self.hf_config = load_model(
            config.model_path, config.load_format, self.dtype, self.device, seed=config.random_seed, tp=self.tp
        )
        if self.device.type == "cpu":
            use_column_major_linears(self.model)
        cfg = self.hf_config
        self.vocab_size = cfg.vocab_size
        self.context_len = config.context_length or cfg.max_position_embeddings
        self.eos_token_ids = eos_ids_of(cfg, tokenizer, model_dir)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        attn = next(m.spec for m in self.model.modules() if isinstance(m, Attention))
        num_heads, num_kv_heads = attn.num_heads, attn.num_kv_heads  # this rank's
        pool_size, size_source = self._pool_size(cfg.num_hidden_layers, num_kv_heads, head_dim)
        self.token_to_kv_pool = TokenToKVPool(
            pool_size,
            config.page_size,
            self.kv_cache_dtype,
            cfg.num_hidden_layers,
            num_kv_heads,
            head_dim,
            self.device,
        )
        logger.info(
            "KV pool on %s: %d tokens, %s, %.2f GiB (from %s)",
            self.device,
            pool_size,
            str(self.kv_cache_dtype).removeprefix("torch."),
            self.token_to_kv_pool.nbytes() / GIB,
            size_source,
        )
        self._use_checkpoint_kv_scales()  # before any forward, and before the CUDA graphs capture them
        # The free list lives on the host: the scheduler allocates without waiting for the GPU.
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(self.token_to_kv_pool.size, config.page_size)
        # +2: the request being chunk-prefilled and one being admitted can hold slots beside the cap.
        self.req_to_token_pool = ReqToTokenPool(config.max_running_requests + 2, self.context_len, self.device)
        self.future_map = FutureMap(self.req_to_token_pool.size, self.device)
        self.attn_backend = backend_cls(
            AttentionBackendConfig(
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                page_size=config.page_size,
                max_context_len=self.context_len,
                max_batch_size=config.max_running_requests,
                dtype=self.dtype,
                device=self.device,
            )
        )
        self.sampler = Sampler(seed=self._shared_sampler_seed())
        moe_layers = len(getattr(self.model, "moe_layer_ids", []))
        # The trace's expert-load record, filled by the MoE layers of each traced forward.
        self.expert_load = (
            torch.zeros(moe_layers, cfg.num_experts, dtype=torch.int64, device=self.device)
            if config.enable_trace and moe_layers
            else None
        )
        self._enable_custom_all_reduce()
        # Shapes specialize at first and turn dynamic on the first recompile (torch's default).
        self.compiled_model = compile_with_eager_attention(self.model) if config.enable_torch_compile else None
        self.cuda_graph_runner: CudaGraphRunner | None = self._build_cuda_graph_runner()
        self.prefill_graph_runner: PrefillGraphRunner | None = self._build_prefill_graph_runner()

    def _use_checkpoint_kv_scales(self) -> None:
        """Give a float8 pool the checkpoint's per-layer KV scales (it keeps 1.0 without them) and log
        where its scales came from; another pool ignores them (logged). ValueError for scales that
        the pool cannot use (kv_scales_from, set_kv_scales)."""
        pool = self.token_to_kv_pool
        tensors = checkpoint_kv_scales(self.config.model_path, self.config.load_format)
        if not is_fp8(pool.dtype):
            if tensors:
                logger.info("KV scales: found in the checkpoint, not used by a %s pool", pool.summary()["dtype"])
            return
        scales = kv_scales_from(tensors.items(), pool.num_layers)
        if scales is None:
            why = "none in the checkpoint" if self.config.load_format == "auto" else "random weights"
            logger.info("KV scales: 1.0 (%s)", why)
            return
        pool.set_kv_scales(scales.k, scales.v)
        logger.info("KV scales: from the checkpoint (%d layers)", pool.num_layers)

    def _build_cuda_graph_runner(self) -> CudaGraphRunner | None:
        """Decode CUDA graphs: on CUDA, unless disabled, with one rank, with a backend that supports
        them (triton; torch_native's per-request Python is not capturable). Silently none on CPU."""
        if self.device.type != "cuda" or self.config.disable_cuda_graph:
            return None
        if self.tp.size > 1 and self.tp.custom_all_reduce is None:  # NCCL stays out of graphs (custom_all_reduce.py)
            return None  # _enable_custom_all_reduce said why
        max_bs = min(self.config.cuda_graph_max_bs, self.config.max_running_requests)
        try:
            return CudaGraphRunner(self, max_bs)
        except NotImplementedError as e:
            logger.info("CUDA graphs off: %s", e)
            return None

    def _build_prefill_graph_runner(self) -> PrefillGraphRunner | None:
        """Prefill CUDA graphs: where decode graphs run, unless --cuda-graph-max-prefill-tokens is 0,
        and with one rank only (an extend's all-reduces outgrow the custom all-reduce's buffer)."""
        max_tokens = self.config.cuda_graph_max_prefill_tokens
        if self.cuda_graph_runner is None or max_tokens == 0 or self.tp.size > 1:
            return None
        try:
            return PrefillGraphRunner(self, max_tokens, self.req_to_token_pool.size)
        except NotImplementedError as e:
            logger.info("prefill CUDA graphs off: %s", e)
            return None

    def _enable_custom_all_reduce(self) -> None:
        """Small all-reduces through CustomAllReduce when the ranks share a machine's GPUs (a warning
        says why not). Collective: every rank decides the same from the same config."""
        if self.tp.size == 1 or self.device.type != "cuda":
            return
        if self.config.disable_custom_all_reduce:
            why: str | None = "--disable-custom-all-reduce"
        elif self.config.nnodes > 1:
            why = "the ranks are on several machines"
        else:
            why = self.tp.enable_custom_all_reduce(self.device, self.dtype)
        if why:
            logger.warning("custom all-reduce off (%s): decode CUDA graphs off too, NCCL stays out of them", why)

    def _shared_sampler_seed(self) -> int | None:
        """Tensor-parallel ranks must draw the same noise: rank 0's random seed, for all. A single
        rank seeds its sampler randomly (None)."""
        if self.tp.size == 1:
            return None
        mine = secrets.randbits(63).to_bytes(8, "little") if self.tp.is_leader else None
        return int.from_bytes(self.tp.broadcast_bytes(mine), "little")

    def _pool_size(self, num_layers: int, num_kv_heads: int, head_dim: int) -> tuple[int, str]:
        """Tokens in the KV pool, the same on every rank, and where the size came from: the first of
        --max-total-tokens, --mem-fraction-static (CUDA, measured now: call it once the weights are
        loaded), --kv-memory-gb."""
        c, page = self.config, self.config.page_size
        per_token = 2 * num_layers * num_kv_heads * head_dim * self.kv_cache_dtype.itemsize
        if c.max_total_tokens is not None:
            size, source = c.max_total_tokens, "--max-total-tokens"
        elif c.mem_fraction_static is not None:
            torch.cuda.empty_cache()  # blocks the loader freed are free for the pool too
            budget, free, total = tp_kv_pool_bytes(
                c.mem_fraction_static, *torch.cuda.mem_get_info(self.device), self.tp
            )
            size = budget // per_token
            source = (
                f"--mem-fraction-static {c.mem_fraction_static}: {free / GIB:.2f} of {total / GIB:.2f} GiB free "
                f"after the weights, {budget / GIB:.2f} GiB of it for the pool"
            )
        else:
            size, source = int(c.kv_memory_gb * GIB // per_token), f"--kv-memory-gb {c.kv_memory_gb}"
        size = size // page * page
        if size < page:
            raise ValueError(f"the KV pool must hold at least one page ({page} tokens), got {size}")
        return size, source

    def build_forward_batch(self, batch: ScheduleBatch) -> ForwardBatch:
        req_pool_indices, seq_lens = batch.forward_rows()
        prefix_lens, extend_lens = batch.prefix_lens, batch.extend_lens
        if batch.forward_mode == ForwardMode.TARGET_VERIFY:  # its rows are decode rows
            prefix_lens, extend_lens = [n - 1 for n in seq_lens], [1] * len(seq_lens)
        # One host-to-device copy for the four index lists, then views of it.
        parts = (batch.input_ids, batch.positions, req_pool_indices, seq_lens)
        flat = torch.tensor([v for part in parts for v in part], dtype=torch.int64).to(self.device, non_blocking=True)
        input_ids, positions, req_pool_indices, seq_lens_t = flat.split([len(p) for p in parts])
        if FutureMap.has_future(batch.input_ids):
            input_ids = self.future_map.resolve(input_ids)
        return ForwardBatch(
            forward_mode=batch.forward_mode,
            batch_size=len(seq_lens),
            input_ids=input_ids,
            positions=positions,
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens_t,
            out_cache_loc=batch.out_cache_loc.to(self.device, non_blocking=True),
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=extend_lens,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.token_to_kv_pool,
            attn_backend=self.attn_backend,
            expert_load=self.expert_load.zero_() if self.expert_load is not None else None,
            input_logprobs=(
                InputLogprobs.plan(batch.reqs, batch.prefix_lens, batch.extend_lens, self.device)
                if batch.forward_mode.is_extend()
                else None
            ),
        )

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Next-token logits [batch_size, vocab] (model dtype) for the last token of every request.
        Decode batches up to the largest captured size, and extends of up to the prefill graphs'
        tokens, replay a CUDA graph (unless the trace records expert load: the graphs were captured
        without it); the rest run eagerly. A decode graph's logits are valid until the next forward:
        sample from them (or copy them) first."""
        if forward_batch.expert_load is None:
            for graphs in (self.cuda_graph_runner, self.prefill_graph_runner):
                if graphs is not None and graphs.can_run(forward_batch):
                    return graphs.replay(forward_batch)
        self.attn_backend.init_forward_metadata(forward_batch)
        model = self.decode_model(forward_batch.batch_size) if forward_batch.forward_mode.is_decode() else self.model
        return model(forward_batch.input_ids, forward_batch.positions, forward_batch)

    def decode_model(self, batch_size: int) -> Callable[..., torch.Tensor]:
        """The model a decode batch runs: compiled up to torch_compile_max_bs with --enable-torch-compile.
        Extends stay eager: compiled with dynamic token counts they ran slower."""
        if self.compiled_model is not None and batch_size <= self.config.torch_compile_max_bs:
            return self.compiled_model
        return self.model

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        reqs: Sequence[SamplingReq],
        forward_batch: ForwardBatch,
        vocab_mask: VocabMask | None = None,
    ) -> HostSample:
        """Sample on the device and hand the tokens to the FutureMap (for future-token inputs, and on
        their way to the host); `HostSample.wait()` then waits for this step only. `vocab_mask`: the
        tokens the grammars of the constrained rows allow."""
        info = SamplingBatchInfo.from_requests(reqs, self.vocab_size, logits.device, self.eos_token_ids, vocab_mask)
        return self.future_map.store(forward_batch.req_pool_indices, self.sampler(logits, info))
