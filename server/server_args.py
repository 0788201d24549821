"""ServerArgs: the server's options. Every EngineConfig field is an option too, so `--help` lists
the whole engine; `--config FILE` (YAML or JSON) supplies values that the command line overrides."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from labkit.config import EngineConfig

ENGINE_HELP = {
    "model_path": "HF model directory, or a data/configs name with --load-format dummy "
    "(none: the embedded SmolLM2-135M-Instruct)",
    "load_format": "auto: weights from --model-path; dummy: random weights for a config",
    "dtype": "auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16",
    "device": "auto (cuda if available), cpu or cuda",
    "context_length": "max prompt + output tokens per request (default: the model's)",
    "random_seed": "seed for dummy weights and the random policy",
    "page_size": "tokens per KV page",
    "max_total_tokens": "KV pool size in tokens (default: from --kv-memory-gb)",
    "kv_memory_gb": "KV pool memory in GiB when --max-total-tokens is not given",
    "max_running_requests": "most requests decoding at once",
    "schedule_policy": "fcfs, lpm, dfs-weight, lof or random",
    "chunked_prefill_size": "prompt tokens per prefill step (default 2048 on CPU, 8192 on CUDA; <= 0: no chunking)",
    "max_prefill_tokens": "prefill token budget of one step",
    "enable_mixed_chunk": "run a prefill chunk and the decodes in one batch",
    "disable_radix_cache": "no prefix sharing (ChunkCache)",
    "schedule_conservativeness": "scales the decode reservation of admitted requests",
    "attention_backend": "auto (triton on CUDA, torch_native on CPU), torch_native or triton",
    "cuda_graph_max_bs": "largest decode batch run from a captured CUDA graph (CUDA with the triton backend); "
    "larger batches run eagerly",
    "disable_cuda_graph": "never capture CUDA graphs: every decode step runs eagerly",
    "enable_torch_compile": "torch.compile the decode forward around the attention kernels (the CUDA graphs are "
    "captured from it); compiling takes a while at start",
    "torch_compile_max_bs": "largest decode batch run compiled with --enable-torch-compile",
    "disable_overlap_schedule": "schedule each step only after the previous one finished (overlap is on for CUDA)",
    "overlap_schedule_on_cpu": "overlap scheduling on CPU too: no speed-up there; tokens arrive one step later",
}
HIDDEN_ENGINE_FIELDS = {"enable_trace"}  # set by --trace-file


@dataclass
class ServerArgs:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=30000, metadata={"help": "port to listen on"})
    served_model_name: str | None = field(
        default=None, metadata={"help": "model name in the API (default: --model-path, or the embedded model's name)"}
    )
    max_queued_requests: int | None = field(
        default=None,
        metadata={"help": "requests allowed to wait beyond --max-running-requests; more get 503 (default: no limit)"},
    )
    api_key: str | None = field(
        default=None, metadata={"help": "require 'Authorization: Bearer KEY' on every endpoint but /health"}
    )
    log_level: str = field(default="info", metadata={"help": "debug, info, warning or error"})
    enable_metrics: bool = field(default=False, metadata={"help": "serve Prometheus metrics at /metrics"})
    trace_file: str | None = field(
        default=None, metadata={"help": "record station/step traces and write them as Perfetto JSON here at shutdown"}
    )

    @classmethod
    def from_cli(cls, argv: list[str] | None = None) -> ServerArgs:
        parser = build_parser()
        ns = parser.parse_args(argv)
        if ns.config:  # file values become defaults, so the command line still wins
            parser.set_defaults(**_load_config_file(Path(ns.config), parser))
            ns = parser.parse_args(argv)
        values = vars(ns)
        values.pop("config")
        engine_names = {f.name for f in dataclasses.fields(EngineConfig)}
        engine = EngineConfig(**{k: v for k, v in values.items() if k in engine_names})
        engine.enable_trace = values.get("trace_file") is not None
        args = cls(engine=engine, **{k: v for k, v in values.items() if k not in engine_names})
        args.check()
        return args

    def check(self) -> None:
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise SystemExit(f"--log-level must be debug, info, warning or error, got {self.log_level!r}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise SystemExit("--max-queued-requests must be >= 0")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(d.pop("engine"))
        if d["api_key"] is not None:
            d["api_key"] = "***"
        return d


def _options() -> list[tuple[dataclasses.Field, str]]:
    """(field, help) of every option: the engine's fields, then the server's own."""
    opts = [
        (f, ENGINE_HELP.get(f.name, "")) for f in dataclasses.fields(EngineConfig) if f.name not in HIDDEN_ENGINE_FIELDS
    ]
    opts += [(f, f.metadata["help"]) for f in dataclasses.fields(ServerArgs) if f.name != "engine"]
    return opts


_TYPES = {"str": str, "int": int, "float": float}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m labkit.server",
        description="labkit's OpenAI-compatible server: HTTP + tokenizer, scheduler and detokenizer processes.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--config", metavar="FILE", help="YAML or JSON file of options (command line wins)")
    for f, help_text in _options():
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        type_name = str(f.type).replace(" | None", "")
        if type_name == "bool":
            parser.add_argument(flag, action="store_true", default=default, help=help_text)
        else:
            parser.add_argument(
                flag, type=_TYPES[type_name], default=default, help=help_text, metavar=type_name.upper()
            )
    return parser


def _load_config_file(path: Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    if not path.is_file():
        raise SystemExit(f"--config: no such file {path}")
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise SystemExit(f"--config {path}: cannot parse: {e}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"--config {path}: expected a mapping of option names to values")
    known = {a.dest: a for a in parser._actions}
    values = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in known or dest == "config":
            raise SystemExit(f"--config {path}: unknown option {key!r}")
        action = known[dest]
        if value is not None and action.type is not None and not isinstance(value, action.type):
            try:
                value = action.type(value)
            except (TypeError, ValueError):
                raise SystemExit(f"--config {path}: {key} must be {action.type.__name__}, got {value!r}") from None
        values[dest] = value
    return values
