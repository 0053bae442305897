"""A model's tokenizer: the folder `--tokenizer` names, and the transformers tokenizer (with its
chat template) for a folder or a `--model` value. Torch-free, so that a server process loads
its tokenizer while its engine core loads the weights."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from kvfleet.runtime.models import hub
from kvfleet.runtime.models.errors import ModelLoadError
from kvfleet.runtime.models.model_files import BUNDLED, RANDOM_PREFIX, resolve_model

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def resolve_tokenizer(tokenizer: str) -> Path:
    """The folder holding the tokenizer `--tokenizer` names: a folder with tokenizer files (no
    weights needed), or a model value that has one ('bundled', a .gguf file, a Hub id)."""
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise ModelLoadError(
                f"tokenizer: folder {tokenizer!r} has none of {', '.join(TOKENIZER_FILES)}"
            )
        return path
    if tokenizer == BUNDLED or path.is_file() or hub.is_hub_id(tokenizer):
        return resolve_model(tokenizer)
    raise ModelLoadError(
        f"tokenizer: {tokenizer!r} does not exist; expected a folder with tokenizer files, a "
        f".gguf file, a Hub id (org/name) or '{BUNDLED}'"
    )


def load_tokenizer(folder_or_model: str | Path | None) -> Any:
    """The transformers tokenizer (with its chat template) for a folder or a `--model` value;
    random:* models and None get the bundled model's tokenizer, and random:* models a built-in
    byte-level one where the bundled model is not installed."""
    if folder_or_model is None or str(folder_or_model).startswith(RANDOM_PREFIX):
        try:
            folder = resolve_model(BUNDLED)
        except ModelLoadError as exc:
            if folder_or_model is None:
                raise
            from kvfleet.runtime.models.byte_tokenizer import byte_tokenizer

            # str(exc), not exc: a log record that keeps the exception keeps its traceback,
            # and with it the engine being built (a whole GPU's KV cache), for as long as any
            # handler holds the record.
            log.warning(
                "%s; %s uses a built-in byte-level tokenizer instead (one token a byte)",
                str(exc),
                folder_or_model,
            )
            return byte_tokenizer()
    elif isinstance(folder_or_model, Path) and folder_or_model.is_dir():
        folder = folder_or_model
    else:
        folder = resolve_model(str(folder_or_model))
    return load_folder_tokenizer(folder)


def load_folder_tokenizer(folder: Path) -> Any:
    """`AutoTokenizer.from_pretrained(folder)`, without its cost where its answer is known.

    AutoTokenizer reads the model's config with transformers' config classes, whose imports
    pull in torch and torch.distributed (3-4 s of a 2-core host's start, in every process that
    serves or benchmarks). For the folders it would answer with the generic fast tokenizer,
    that class is loaded directly; every other folder goes through AutoTokenizer."""
    backend = _generic_backend() if _autotokenizer_picks_generic(folder) else None
    if backend is not None:
        return backend.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


# What a tokenizer_config.json names when the tokenizer is the generic one over tokenizer.json
# (transformers 5 spells it TokenizersBackend and keeps PreTrainedTokenizerFast as its alias).
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# Model types for which AutoTokenizer registers no class of its own, or the generic one, and
# that it does not list as having a wrong class on the Hub: for these it takes the generic
# class a tokenizer_config.json names. (qwen2 is not one: AutoTokenizer gives Qwen2Tokenizer
# whatever the folder names.) A test holds this to the installed transformers.
GENERIC_TOKENIZER_MODEL_TYPES = ("llama", "mistral")


def _autotokenizer_picks_generic(folder: Path) -> bool:
    """Whether AutoTokenizer loads `folder` with the generic fast tokenizer: it names that class,
    its model type has no class of its own, no remote code is declared, and tokenizer.json holds
    the whole tokenizer."""
    try:
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(tokenizer_config, dict) or not isinstance(config, dict):
        return False
    return (
        tokenizer_config.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES
        and config.get("model_type") in GENERIC_TOKENIZER_MODEL_TYPES
        and "auto_map" not in tokenizer_config
        and "auto_map" not in config
        and (folder / "tokenizer.json").is_file()
    )


def _generic_backend() -> Any:
    """transformers' generic fast tokenizer class; None before transformers 5, whose
    AutoTokenizer then decides."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    return TokenizersBackend
