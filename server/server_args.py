"""ServerArgs: the server's options. Every EngineConfig field is an option too, so `--help` lists
the whole engine; `--config FILE` (YAML or JSON) supplies values that the command line overrides.
Each option's help is its field's `help` metadata; policy and backend choices are their registries'."""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from labkit.attention import ATTENTION_BACKENDS
from labkit.attention.base import LAZY_BACKENDS
from labkit.config import HICACHE_WRITE_POLICIES, KV_CACHE_DTYPES, EngineConfig, add_field_options, check_parallel
from labkit.constrained import grammar_backend_names
from labkit.distributed.dp_controller import LOAD_BALANCE_POLICIES
from labkit.scheduler.schedule_policy import POLICIES
from labkit.speculative.base import drafter_names

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
    max_request_bytes: int = field(
        default=16 * 1024 * 1024, metadata={"help": "largest request body accepted; larger ones get 413"}
    )
    dp_size: int = field(
        default=1, metadata={"help": "data parallelism: model replicas (each of --tp-size ranks) behind this server"}
    )
    load_balance_method: str = field(
        default="round_robin", metadata={"help": "how requests are routed to the --dp-size replicas"}
    )
    tokenizer_worker_num: int = field(
        default=1,
        metadata={
            "help": "HTTP processes, each with its own TokenizerManager, sharing the port (Linux SO_REUSEPORT): "
            "more than one when a single process's HTTP and streaming work limits throughput"
        },
    )
    incremental_streaming_output: bool = field(
        default=False,
        metadata={
            "help": "/generate streams each chunk's new output_ids and text only (default: everything so far, "
            "whose resending costs the server and client time quadratic in the output length)"
        },
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
        if self.max_request_bytes < 1:
            raise SystemExit("--max-request-bytes must be >= 1")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise SystemExit("--max-queued-requests must be >= 0")
        if self.dp_size < 1:
            raise SystemExit("--dp-size must be >= 1")
        if self.tokenizer_worker_num < 1:
            raise SystemExit("--tokenizer-worker-num must be >= 1")
        if self.tokenizer_worker_num > 1:
            if self.trace_file is not None:
                raise SystemExit("--trace-file records one process's requests: use --tokenizer-worker-num 1")
            if not hasattr(socket, "SO_REUSEPORT") or not sys.platform.startswith("linux"):
                raise SystemExit("--tokenizer-worker-num > 1 shares the port with SO_REUSEPORT, which needs Linux")
        try:
            check_parallel(self.engine)
        except ValueError as e:
            raise SystemExit(f"labkit server: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(d.pop("engine"))
        if d["api_key"] is not None:
            d["api_key"] = "***"
        return d


def _options() -> list[dataclasses.Field]:
    """Every option's field: the engine's, then the server's own."""
    engine = [f for f in dataclasses.fields(EngineConfig) if f.name not in HIDDEN_ENGINE_FIELDS]
    return engine + [f for f in dataclasses.fields(ServerArgs) if f.name != "engine"]


def _choices() -> dict[str, list[str]]:
    """The registered names, read when the parser is built (a policy registered before counts)."""
    return {
        "schedule_policy": sorted(POLICIES),
        "load_balance_method": sorted(LOAD_BALANCE_POLICIES),
        "attention_backend": ["auto", *sorted(ATTENTION_BACKENDS.keys() | LAZY_BACKENDS.keys())],
        "grammar_backend": grammar_backend_names(),
        "speculative_algorithm": drafter_names(),
        "kv_cache_dtype": list(KV_CACHE_DTYPES),
        "hicache_write_policy": list(HICACHE_WRITE_POLICIES),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m labkit.server",
        description="labkit's OpenAI-compatible server: HTTP + tokenizer, scheduler and detokenizer processes.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--config", metavar="FILE", help="YAML or JSON file of options (command line wins)")
    add_field_options(parser, _options(), _choices())
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
