"""kvfleet.runtime: the paged-attention serving engine.

`LLM`, `SamplingParams` and `StructuredOutputsParams` are loaded on first use so that importing `kvfleet.runtime`
(e.g. for the CLI's `kvfleet operator`) does not pull in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfleet.runtime.engine.llm import LLM
    from kvfleet.runtime.engine.sampling_params import SamplingParams
    from kvfleet.runtime.engine.structured_outputs import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvfleet.runtime.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvfleet.runtime.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from kvfleet.runtime.engine.structured_outputs import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(f"module 'kvfleet.runtime' has no attribute {name!r}")
