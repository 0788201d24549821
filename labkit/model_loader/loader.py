"""Build a labkit model and fill its weights: from a HF directory (safetensors), or random ("dummy")."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

from labkit.distributed.parallel_state import TPGroup
from labkit.model_loader.embedded import embedded_model_dir
from labkit.model_loader.weight_utils import full_shape_of, is_kv_scale, load_param
from labkit.models.registry import get_model_class

if TYPE_CHECKING:
    from labkit.config import EngineConfig

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "data" / "configs"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def resolve_model_dir(model_path: str | None) -> Path:
    """The HF directory for `model_path` (None = the embedded model, converted on first use)."""
    if model_path is None:
        return embedded_model_dir()
    path = Path(model_path).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{model_path!r} is not a model directory (no config.json); labkit never downloads from a model hub"
        )
    return path


def load_config(model_path: str | None) -> PretrainedConfig:
    """A HF config from a model directory, a config .json file, or a short name under data/configs/."""
    path = Path(model_path).expanduser() if model_path is not None else resolve_model_dir(None)
    if path.is_dir():
        return AutoConfig.from_pretrained(path)
    if not path.is_file():
        path = CONFIGS_DIR / f"{model_path}.json"
        if not path.is_file():
            known = sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))
            raise FileNotFoundError(f"no model config {model_path!r}; known short names: {known}")
    fields: dict[str, Any] = json.loads(path.read_text())
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def load_tokenizer(model_dir: str | Path | None) -> Any | None:
    """The directory's HF tokenizer, or None when it has none (e.g. a dummy config)."""
    if model_dir is None:
        model_dir = resolve_model_dir(None)
    path = Path(model_dir)
    if not path.is_dir() or not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(path)


def model_dir_and_tokenizer(config: EngineConfig) -> tuple[Path | None, Any | None]:
    """The model's HF directory (the embedded GGUF is converted once; None for dummy weights) and its
    tokenizer: the one under config.tokenizer_path if given (a random-weight model borrows one that
    way), else the model directory's (None for dummy weights). None with skip_tokenizer_init."""
    model_dir = None if config.load_format == "dummy" else resolve_model_dir(config.model_path)
    if config.skip_tokenizer_init:
        return model_dir, None
    if config.tokenizer_path is None:
        return model_dir, load_tokenizer(model_dir) if model_dir is not None else None
    tokenizer = load_tokenizer(Path(config.tokenizer_path).expanduser())
    if tokenizer is None:
        raise FileNotFoundError(
            f"tokenizer_path {config.tokenizer_path!r} is not a directory with a tokenizer "
            f"({' or '.join(_TOKENIZER_FILES)})"
        )
    vocab_size = load_config(config.model_path).vocab_size
    if len(tokenizer) > vocab_size:
        raise ValueError(f"the tokenizer's {len(tokenizer)} tokens do not fit the model's vocabulary of {vocab_size}")
    return model_dir, tokenizer


def iter_safetensors(
    model_dir: Path, device: torch.device, keep: Callable[[str], bool] = lambda name: True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in the directory's *.safetensors whose name `keep` accepts
    (the others are never read)."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for name in f.keys():
                if keep(name):
                    yield name, f.get_tensor(name)


def checkpoint_kv_scales(model_path: str | None, load_format: str) -> dict[str, torch.Tensor]:
    """The KV cache scale tensors (is_kv_scale: per layer, so the same on every tensor-parallel rank)
    of the checkpoint load_model(model_path, load_format) loads, on the CPU; none for random weights."""
    if load_format != "auto":
        return {}
    return dict(iter_safetensors(resolve_model_dir(model_path), torch.device("cpu"), is_kv_scale))


@torch.no_grad()
def init_dummy_weights(model: nn.Module, std: float, seed: int) -> None:
    """Seeded normal(0, std) weights, norms = 1: random but numerically tame activations. Each full
    (unsharded) parameter is drawn from its own seed and sliced, so every tp_size gets the same model."""
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
            continue
        gen = torch.Generator(device=param.device).manual_seed(seed + _stable_hash(name))
        full = torch.empty(full_shape_of(model, name, param), dtype=param.dtype, device=param.device)
        load_param(model, name, param, full.normal_(0.0, std, generator=gen))


def _stable_hash(name: str) -> int:
    # Per-parameter seeds independent of construction order and of PYTHONHASHSEED.
    return sum((i + 1) * ord(c) for i, c in enumerate(name)) % (2**31)


def load_model(
    model_path: str | None,
    load_format: str = "auto",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    tp: TPGroup | None = None,
) -> tuple[nn.Module, PretrainedConfig]:
    """Build the model for `model_path` on `device` in `dtype` and fill its weights (this rank's
    share of them, over a TPGroup).

    load_format "auto": a HF directory (config.json + possibly sharded *.safetensors); None = embedded.
    Its KV cache scales are skipped: checkpoint_kv_scales reads them for the pool.
    load_format "dummy": random weights for a config given as a directory, .json file or short name."""
    device = torch.device(device)
    if load_format == "auto":
        model_dir = resolve_model_dir(model_path)
        config = AutoConfig.from_pretrained(model_dir)
    elif load_format == "dummy":
        config = load_config(model_path)
    else:
        raise ValueError(f"unknown load_format {load_format!r} (use 'auto' or 'dummy')")
    cls = get_model_class(getattr(config, "architectures", None))
    # Meta construction then to_empty: no throwaway initialization, no CPU copy of a GPU model.
    with torch.device("meta"):
        model = cls(config, dtype, tp or TPGroup())
    model.to_empty(device=device)
    if load_format == "auto":
        # KV cache scales are no parameter: the pool takes them (checkpoint_kv_scales).
        loaded = model.load_weights(iter_safetensors(model_dir, device, lambda name: not is_kv_scale(name)))
        missing = sorted(set(dict(model.named_parameters())) - loaded)
        if missing:
            raise ValueError(
                f"{model_dir}: checkpoint lacks weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}"
            )
    else:
        init_dummy_weights(model, getattr(config, "initializer_range", 0.02), seed)
    return model.eval(), config
