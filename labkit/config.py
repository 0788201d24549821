"""EngineConfig: every knob of the engine (the server's command line maps onto it one to one)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    # Model
    model_path: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    load_format: str = "auto"  # "auto" (weights from model_path) | "dummy" (random weights for a config)
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda if available, else cpu
    context_length: int | None = None  # default: the model's max_position_embeddings
    random_seed: int = 0
    # Memory
    page_size: int = 1
    max_total_tokens: int | None = None  # KV pool size in tokens; None: from kv_memory_gb
    kv_memory_gb: float = 1.0  # KV budget when max_total_tokens is not given (CPU default)
    max_running_requests: int = 256
    # Scheduling
    schedule_policy: str = "fcfs"
    chunked_prefill_size: int | None = None  # None: 2048 on CPU, 8192 on CUDA; <= 0 disables chunking
    max_prefill_tokens: int = 16384
    enable_mixed_chunk: bool = False
    disable_radix_cache: bool = False
    schedule_conservativeness: float = 1.0
    # Execution
    attention_backend: str = "auto"  # auto: triton on CUDA, torch_native on CPU
    cuda_graph_max_bs: int = 160  # largest decode batch replayed from a CUDA graph (CUDA + triton only)
    disable_cuda_graph: bool = False  # run every decode eagerly
    enable_torch_compile: bool = False  # torch.compile the decode forward around the attention kernels
    torch_compile_max_bs: int = 32  # largest decode batch run compiled
    disable_overlap_schedule: bool = False  # overlap scheduling is on for CUDA unless this is set
    overlap_schedule_on_cpu: bool = False  # also on CPU: no speed-up, but shows (and tests) its one-step lag
    # Observability
    enable_trace: bool = False
