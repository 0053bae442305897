"""The one error a `--model` value that cannot be loaded raises (torch-free: `kvfleet download`
and the server's edge use it without loading torch)."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """The `model` value cannot be loaded; the message says what was expected or what to do."""
