"""The tokenizer an engine's model needs, and the imports its first load costs. Torch-free, so
that a server process starts its engine core before it imports anything heavy."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfleet.runtime.engine.config import EngineConfig

log = logging.getLogger(__name__)


def load_engine_tokenizer(config: EngineConfig, model_folder: str | None) -> Any:
    """The tokenizer a core's model needs: --tokenizer, else the model's own folder, else the
    model value (random:* models get the bundled one); with --chat-template's template."""
    from kvfleet.runtime.models.loader import load_tokenizer, resolve_tokenizer

    if config.tokenizer:
        tokenizer = load_tokenizer(resolve_tokenizer(config.tokenizer))
    else:
        tokenizer = load_tokenizer(model_folder if model_folder is not None else config.model)
    if config.chat_template is not None:
        tokenizer.chat_template = config.chat_template
    return tokenizer


def preload_tokenizer_code() -> None:
    """Import what a tokenizer's first load pulls in: transformers' auto classes read the
    model's config, and its config module imports torch.distributed and more (2-3 s on a
    2-core host). A server does this while its core process loads the model."""
    import importlib

    for name in ("transformers.models.auto.tokenization_auto", "transformers.activations"):
        try:
            importlib.import_module(name)
        except ImportError:  # another transformers layout: the first load imports what it needs
            log.debug("could not preload %s", name, exc_info=True)
