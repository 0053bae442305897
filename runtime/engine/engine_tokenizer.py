"""The tokenizer an engine's model needs, and the imports its first load costs. Torch-free, so
that a server process starts its engine core before it imports anything heavy."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfleet.runtime.engine.config import EngineConfig

log = logging.getLogger(__name__)


def load_engine_tokenizer(config: EngineConfig, model_folder: str | None) -> Any:
    """The tokenizer a core's model needs: --tokenizer, else the model's own folder, else the
    model value (random:* models get the bundled one); with --chat-template's template."""
    from kvfleet.runtime.models.tokenizer_loader import load_tokenizer, resolve_tokenizer

    if config.tokenizer:
        tokenizer = load_tokenizer(resolve_tokenizer(config.tokenizer))
    else:
        tokenizer = load_tokenizer(model_folder if model_folder is not None else config.model)
    if config.chat_template is not None:
        tokenizer.chat_template = config.chat_template
    return tokenizer


def tokenizer_known_ahead(config: EngineConfig) -> bool:
    """Whether the tokenizer can be loaded before the core has resolved the model: a
    --tokenizer, a random:* model (the bundled tokenizer) or a local folder. Not 'bundled', a
    .gguf file or a Hub id, which the core converts or downloads first."""
    from kvfleet.runtime.models.model_files import RANDOM_PREFIX

    model = config.model
    return (
        bool(config.tokenizer)
        or model.startswith(RANDOM_PREFIX)
        or Path(model).expanduser().is_dir()
    )


def preload_tokenizer_code(config: EngineConfig) -> None:
    """Import what the tokenizer's first load will need, while the core resolves the model: the
    generic fast tokenizer always, and AutoTokenizer where the class is known only once the
    folder exists (a .gguf file or a Hub id: its config classes import torch.distributed and
    more, 2-3 s on a 2-core host). 'bundled' converts to a folder of the generic class."""
    import importlib

    from kvfleet.runtime.models.model_files import BUNDLED

    names = ["transformers.tokenization_utils_tokenizers"]
    if config.model != BUNDLED:
        names += ["transformers.models.auto.tokenization_auto", "transformers.activations"]
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:  # another transformers layout: the first load imports what it needs
            log.debug("could not preload %s", name, exc_info=True)
