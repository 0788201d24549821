"""EngineConfig: every knob of the engine. Each field's `help` metadata is its one description: the
server's command line (server/server_args.py) is built from these fields, one option per field."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import Field, dataclass, field
from typing import Any

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
HICACHE_WRITE_POLICIES = ("write_back", "write_through")


@dataclass
class EngineConfig:
    """Options of the Engine and of the server's scheduler process (`Engine(**overrides)` takes the
    same names). The choices of schedule_policy, attention_backend and grammar_backend are their
    registries' names."""

    # Model
    model_path: str | None = field(
        default=None,
        metadata={
            "help": "HF model directory, or a data/configs name with --load-format dummy "
            "(none: the embedded SmolLM2-135M-Instruct)"
        },
    )
    load_format: str = field(
        default="auto", metadata={"help": "auto: weights from --model-path; dummy: random weights for a config"}
    )
    tokenizer_path: str | None = field(
        default=None,
        metadata={
            "help": "HF tokenizer directory (default: the model's); lets random-weight models take text, if "
            "its vocabulary fits the model's"
        },
    )
    skip_tokenizer_init: bool = field(
        default=False,
        metadata={
            "help": "load no tokenizer: prompts must be input_ids and outputs are token ids only (no text, "
            "no stop strings, chat or grammars); serves random-weight models of any vocabulary"
        },
    )
    dtype: str = field(
        default="auto", metadata={"help": "auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16"}
    )
    device: str = field(default="auto", metadata={"help": "auto (cuda if available), cpu or cuda"})
    context_length: int | None = field(
        default=None, metadata={"help": "max prompt + output tokens per request (default: the model's)"}
    )
    random_seed: int = field(default=0, metadata={"help": "seed for dummy weights and the random policy"})
    cpu_threads: int = field(
        default=0,
        metadata={
            "help": "torch threads per rank on CPU; 0: auto (OMP_NUM_THREADS if set, else the cores less one, "
            "shared by the machine's ranks)"
        },
    )
    # Memory
    page_size: int = field(default=1, metadata={"help": "tokens per KV page"})
    max_total_tokens: int | None = field(
        default=None, metadata={"help": "KV pool size in tokens (default: from --kv-memory-gb)"}
    )
    kv_memory_gb: float = field(
        default=1.0, metadata={"help": "KV pool memory in GiB when --max-total-tokens is not given"}
    )
    mem_fraction_static: float | None = field(
        default=None,
        metadata={
            "help": "CUDA: share of the GPU's memory for weights and KV pool; the pool gets what is left of it "
            "after the weights (the rest stays for activations and CUDA graphs). Overrides --kv-memory-gb"
        },
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "help": "KV pool storage: auto (the model's dtype), fp8_e4m3 or fp8_e5m2 (half the bytes of bf16; "
            "per-layer scales from the checkpoint's k_scale / v_scale tensors, else 1.0)"
        },
    )
    max_running_requests: int = field(default=256, metadata={"help": "most requests decoding at once"})
    enable_hierarchical_cache: bool = field(
        default=False,
        metadata={
            "help": "keep prefixes evicted from the device pool in a host pool (and on disk with "
            "--hicache-storage-dir), loading them back on a prefix hit (HiRadixCache)"
        },
    )
    hicache_size: float = field(
        default=0.0, metadata={"help": "host KV pool in GiB (0: twice the device pool's bytes)"}
    )
    hicache_write_policy: str = field(
        default="write_back",
        metadata={
            "help": "write_back: copy a prefix to host when it is evicted from the device; write_through: "
            "as soon as it is cached"
        },
    )
    hicache_storage_dir: str | None = field(
        default=None,
        metadata={
            "help": "a directory for the disk tier under the host pool (blocks keyed by the hash of their "
            "token prefix: a restarted server finds them again); none: no disk tier"
        },
    )
    hicache_storage_block: int = field(
        default=64, metadata={"help": "tokens per disk block (a multiple of --page-size)"}
    )
    hicache_storage_size: float | None = field(
        default=None,
        metadata={
            "help": "most GiB the disk tier's directory holds: the least recently used blocks (by write or "
            "read) are deleted to stay under it; none: unbounded"
        },
    )
    # Scheduling
    schedule_policy: str = field(default="fcfs", metadata={"help": "order in which waiting requests are admitted"})
    chunked_prefill_size: int | None = field(
        default=None,
        metadata={"help": "prompt tokens per prefill step (default 2048 on CPU, 8192 on CUDA; <= 0: no chunking)"},
    )
    max_prefill_tokens: int = field(default=16384, metadata={"help": "prefill token budget of one step"})
    enable_mixed_chunk: bool = field(
        default=False, metadata={"help": "run a prefill chunk and the decodes in one batch"}
    )
    disable_radix_cache: bool = field(default=False, metadata={"help": "no prefix sharing (ChunkCache)"})
    schedule_conservativeness: float = field(
        default=1.0, metadata={"help": "scales the decode reservation of admitted requests"}
    )
    grammar_backend: str = field(
        default="xgrammar",
        metadata={
            "help": "grammar backend of structured output (json_schema, regex, ebnf, response_format); none "
            "refuses such requests"
        },
    )
    # Execution
    attention_backend: str = field(default="auto", metadata={"help": "auto: triton on CUDA, torch_native on CPU"})
    cuda_graph_max_bs: int = field(
        default=256,  # max_running_requests' default: every decode batch it allows replays a graph
        metadata={
            "help": "largest decode batch run from a captured CUDA graph (CUDA with the triton backend); "
            "larger batches run eagerly, several times slower (a host-bound launch per kernel)"
        },
    )
    cuda_graph_max_prefill_tokens: int = field(
        default=8192,
        metadata={
            "help": "extend (prefill, mixed) forwards of up to this many new tokens run from captured CUDA "
            "graphs (CUDA with the triton backend, one rank); 0: extends always run eagerly. The default "
            "covers CUDA's 8192-token prefill chunks"
        },
    )
    disable_cuda_graph: bool = field(
        default=False, metadata={"help": "never capture CUDA graphs: every forward runs eagerly"}
    )
    enable_torch_compile: bool = field(
        default=False,
        metadata={
            "help": "torch.compile the decode forward around the attention kernels (the CUDA graphs are "
            "captured from it); compiling takes a while at start"
        },
    )
    torch_compile_max_bs: int = field(
        default=32, metadata={"help": "largest decode batch run compiled with --enable-torch-compile"}
    )
    disable_overlap_schedule: bool = field(
        default=False,
        metadata={"help": "schedule each step only after the previous one finished (overlap is on for CUDA)"},
    )
    overlap_schedule_on_cpu: bool = field(
        default=False,
        metadata={"help": "overlap scheduling on CPU too: no speed-up there; tokens arrive one step later"},
    )
    # Speculative decoding (labkit.speculative)
    speculative_algorithm: str | None = field(
        default=None,
        metadata={
            "help": "draft several tokens per decode step and verify them in one forward: ngram (from the "
            "request's own context) or draft (a smaller model sharing the tokenizer); none: off"
        },
    )
    speculative_num_draft_tokens: int = field(
        default=4, metadata={"help": "most tokens drafted per request and step (each verify row is one)"}
    )
    speculative_draft_model_path: str | None = field(
        default=None,
        metadata={
            "help": "the draft model of --speculative-algorithm draft, as --model-path takes it (none: the "
            "embedded model)"
        },
    )
    speculative_draft_load_format: str = field(
        default="auto", metadata={"help": "auto or dummy, for the draft model as --load-format"}
    )
    speculative_ngram_max_n: int = field(
        default=4, metadata={"help": "ngram: longest context suffix looked up (shorter ones are tried after it)"}
    )
    speculative_ngram_min_n: int = field(default=1, metadata={"help": "ngram: shortest context suffix looked up"})
    speculative_ngram_min_match: int = field(
        default=2,
        metadata={
            "help": "ngram: draft only where at least this many tokens before the draft's source equal the "
            "context's last ones (a copy resumed after an edit waits for the tokens that confirm it)"
        },
    )
    speculative_ngram_share: bool = field(
        default=False,
        metadata={"help": "ngram: also look the suffix up in other requests' recent outputs"},
    )
    speculative_min_accept_rate: float = field(
        default=0.3,
        metadata={
            "help": "a request whose drafts' recent acceptance rate falls below this stops drafting for a "
            "while (0: never stop)"
        },
    )
    speculative_min_batch_gain: float | None = field(
        default=None,
        metadata={
            "help": "a decode step drafts only if its drafting requests are expected (recent acceptance rate x "
            "drafts) to gain at least this many tokens per request of the batch (0: whenever a request drafts); "
            "none: the break-even measured from this engine's own decode and verify step times (a verify step "
            "waits for its tokens; labkit.speculative.step_costs)"
        },
    )
    # Parallelism
    tp_size: int = field(
        default=1, metadata={"help": "tensor parallelism: ranks sharing each layer (gloo on CPU, NCCL on CUDA)"}
    )
    ep_size: int = field(
        default=1,
        metadata={
            "help": "expert parallelism: MoE experts split over this many of the tp_size ranks (a divisor of "
            "tp_size); the rest split each expert's features"
        },
    )
    nnodes: int = field(default=1, metadata={"help": "machines the tp_size ranks are spread over"})
    node_rank: int = field(default=0, metadata={"help": "this machine's index among --nnodes (0 serves HTTP)"})
    dist_init_addr: str | None = field(
        default=None,
        metadata={
            "help": "host:port where rank 0 meets the other ranks (torch.distributed); default: a free local port"
        },
    )
    disable_custom_all_reduce: bool = field(
        default=False,
        metadata={
            "help": "all-reduce through NCCL only (by default small CUDA all-reduces of one machine's ranks go "
            "through symmetric memory, which the decode CUDA graphs need with tp_size > 1)"
        },
    )
    dist_timeout: float = field(
        default=120.0, metadata={"help": "seconds the ranks wait for each other at start before giving up"}
    )
    # Observability
    enable_trace: bool = field(
        default=False, metadata={"help": "record station, step and tree events in a Tracer (labkit.trace)"}
    )


_OPTION_TYPES = {"str": str, "int": int, "float": float}


def add_field_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    fields: Iterable[Field[Any]],
    choices: dict[str, list[str]],
) -> None:
    """One command-line option per dataclass field (`--page-size` for page_size), its help the field's
    `help` metadata: the server's command line and the serving benchmark's engine options."""
    for f in fields:
        flag, help_text = "--" + f.name.replace("_", "-"), f.metadata["help"]
        type_name = str(f.type).replace(" | None", "")
        if type_name == "bool":
            parser.add_argument(flag, action="store_true", default=f.default, help=help_text)
        elif f.name in choices:
            parser.add_argument(flag, default=f.default, help=help_text, choices=choices[f.name])
        else:
            kind = _OPTION_TYPES[type_name]
            parser.add_argument(flag, type=kind, default=f.default, help=help_text, metavar=type_name.upper())


def ranks_per_node(config: EngineConfig) -> int:
    """Tensor-parallel ranks on each machine (checked by check_parallel)."""
    return config.tp_size // config.nnodes


def check_parallel(config: EngineConfig) -> None:
    """ValueError for a parallel layout that cannot work (the model's own limits are checked as it loads)."""
    if config.tp_size < 1 or config.nnodes < 1:
        raise ValueError(f"tp_size and nnodes must be >= 1, got {config.tp_size} and {config.nnodes}")
    if config.ep_size < 1 or config.tp_size % config.ep_size:
        raise ValueError(f"ep_size must be a divisor of tp_size {config.tp_size}, got {config.ep_size}")
    if config.tp_size % config.nnodes:
        raise ValueError(f"tp_size {config.tp_size} does not split evenly over {config.nnodes} nodes")
    if not 0 <= config.node_rank < config.nnodes:
        raise ValueError(f"node_rank must be in [0, {config.nnodes}), got {config.node_rank}")
    if config.nnodes > 1 and not config.dist_init_addr:
        raise ValueError("more than one node needs dist_init_addr (host:port of node 0)")
