"""Copies between the host and the device that do not make the host wait for the device.

`torch.tensor(values, device="cuda")` copies from pageable memory, which CUDA does only once
the stream's earlier work is done: the host stalls until the step already running ends. With
async scheduling (async_step.py) the host builds step N+1 while the device runs step N, so its
copies go through pinned memory instead: `to_device` from the caching host allocator (which
keeps a block until the copy reading it has run), and `DeferredTokens` back, read only when
the host needs them. On CPU both are plain tensors.
"""

from __future__ import annotations

import torch


def to_device(values: list[int] | list[float], dtype: torch.dtype, device: torch.device):
    """`values` as a tensor on `device`; on a GPU copied without waiting for the stream."""
    return upload(torch.tensor(values, dtype=dtype), device)


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` (itself on CPU), through pinned memory on a GPU: the copy
    queues behind the stream's work instead of waiting for it."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class DeferredTokens:
    """A step's sampled token ids on their way to the host: on a GPU the copy is queued as
    soon as they are sampled, so reading them waits for that copy, not for the steps queued
    behind it."""

    def __init__(self, tokens: torch.Tensor | list[int]) -> None:
        self.device_tokens: torch.Tensor | None = None
        self._ready: torch.cuda.Event | None = None
        if isinstance(tokens, list):  # already on the host (the one-call CPU step's argmax)
            self._host: torch.Tensor | list[int] = tokens
            return
        self.device_tokens = tokens
        if tokens.device.type == "cuda":
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = tokens

    def on(self, device: torch.device) -> torch.Tensor:
        """The tokens as a tensor on `device`, for the next step's inputs."""
        if self.device_tokens is None:
            return to_device(self._host, torch.long, device)  # type: ignore[arg-type]
        return self.device_tokens

    def tolist(self) -> list[int]:
        """The tokens on the host (waits for their copy)."""
        if self._ready is not None:
            self._ready.synchronize()
        host = self._host
        return host if isinstance(host, list) else host.tolist()


class TokenFills:
    """Input rows whose token is one the step before sampled (async scheduling): their input
    ids hold placeholders until filled, on the host where the tokens are there (CPU), else on
    the device, where the tokens are, in stream order."""

    def __init__(self, tokens: DeferredTokens) -> None:
        self.tokens = tokens
        self.rows: list[int] = []  # positions in the step's input ids
        self.sources: list[int] = []  # the rows of `tokens` that go there

    def add(self, row: int, source: int) -> None:
        self.rows.append(row)
        self.sources.append(source)

    def fill_host(self, input_ids: list[int]) -> None:
        tokens = self.tokens.tolist()
        for row, source in zip(self.rows, self.sources, strict=True):
            input_ids[row] = tokens[source]

    def fill(self, input_ids: torch.Tensor) -> None:
        dev = input_ids.device
        sources = self.tokens.on(dev).index_select(0, to_device(self.sources, torch.long, dev))
        input_ids.index_copy_(0, to_device(self.rows, torch.long, dev), sources)
