"""Decode steps replayed from CUDA graphs.

A decode step of a 1B model on a GPU is a few hundred small kernels whose launches from Python
cost more than the kernels run (measured on an H200: 24 ms a step at 128 sequences, where the
weights and KV cache take about 1 ms to read). So, as vLLM does, decode-only steps are captured
once per batch-size bucket at start and replayed: one launch per step. The graph reads its
inputs from static buffers that each step fills; a step of n sequences replays the smallest
bucket of at least n, with the rows past n padded so they touch nothing real (cache slot -1 is
never written, a one-token context reads an existing block).

The decode kernel's split count depends on the longest context, a host-side choice that a graph
freezes: each graph is captured as if every context were `max_model_len` long, and programs for
splits past a sequence's real end exit at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from kvfleet.kernels.metadata import AttentionMetadata
from kvfleet.runtime.engine.transfers import TokenFills

log = logging.getLogger(__name__)

# Buckets as vLLM's: every size up to 8 that is a power of two, then steps of 16 (a padded row
# costs a little weight-streaming time; a bucket per size would cost a capture each).
SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16
MAX_GRAPH_BATCH = 256


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The bucket sizes captured for decode batches of up to `max_batch` sequences (ascending;
    the last is the first bucket that holds max_batch)."""
    if max_batch < 1:
        raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
    sizes: list[int] = []
    for s in SMALL_BUCKETS:
        sizes.append(s)
        if s >= max_batch:
            return sizes
    s = BUCKET_STEP
    while True:
        sizes.append(s)
        if s >= max_batch:
            return sizes
        s += BUCKET_STEP


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding `num_seqs` sequences, or None when none does."""
    for s in sizes:
        if s >= num_seqs:
            return s
    return None


@dataclass(slots=True)
class _Captured:
    replay: Callable[[], None]
    hidden: torch.Tensor  # [bucket, hidden]: the graph's output, rewritten by each replay


class DecodeGraphs:
    """Static input buffers and one replayable forward per batch bucket.

    `capture=False` builds the same buffers and padding but runs each "replay" eagerly: the
    padding logic is then testable on a machine without CUDA."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_batch: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        capture: bool = True,
    ) -> None:
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.max_model_len = max_model_len
        self.sizes = graph_batch_sizes(min(max_batch, MAX_GRAPH_BATCH))
        n = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, self.max_blocks), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        # One pinned host row per buffer: a step's inputs go up in four small async copies.
        pin = device.type == "cuda"
        self._host = torch.zeros((4, n), dtype=torch.int64, pin_memory=pin)
        self._host_table = torch.zeros((n, self.max_blocks), dtype=torch.int32, pin_memory=pin)
        # Recorded after their copies: async scheduling writes the next step's inputs while
        # the device may not have read the last ones yet.
        self._copied = torch.cuda.Event() if pin else None
        self._graphs: dict[int, _Captured] = {}
        self._capture = capture
        self._pool = None
        for size in reversed(self.sizes):  # largest first: smaller ones reuse its pool memory
            self._graphs[size] = self._build(size)

    def accepts(self, num_seqs: int, num_decodes: int, table_width: int) -> bool:
        """True for a decode-only step these graphs hold."""
        return (
            num_decodes == num_seqs
            and num_seqs <= self.sizes[-1]
            and table_width <= self.max_blocks
        )

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slots[:size],
            num_decodes=size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens_host=[1] * size,
            # Capacity, not this step's lengths: the split choice must hold for every replay.
            seq_lens_host=[self.max_model_len] * size,
        )
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)

    def _build(self, size: int) -> _Captured:
        if not self._capture:
            holder = _Captured(lambda: None, torch.empty(0))

            def run_eagerly() -> None:
                holder.hidden = self._forward(size)

            holder.replay = run_eagerly
            return holder
        # Eager runs first, on a side stream as torch asks: Triton compiles its kernels and
        # cuBLAS picks its algorithms outside the capture.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(size)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = self._forward(size)
        if self._pool is None:
            self._pool = graph.pool()
        return _Captured(graph.replay, hidden)

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        seq_lens: list[int],
        block_table: np.ndarray,
        fills: TokenFills | None = None,
    ) -> torch.Tensor:
        """Final hidden states [n, hidden] of a decode-only step of n sequences; valid until
        the next call. `fills`: input ids the step before sampled, put in place on the device."""
        n = len(input_ids)
        size = bucket_for(n, self.sizes)
        if size is None:
            raise ValueError(f"decode graphs: {n} sequences, more than {self.sizes[-1]}")
        host = self._host
        if self._copied is not None:
            self._copied.synchronize()
        host[0, :n] = torch.tensor(input_ids)
        host[1, :n] = torch.tensor(positions)
        host[2, :n] = torch.tensor(slots)
        host[3, :n] = torch.tensor(seq_lens)
        # Padding rows: token 0 at position 0, written nowhere, with a one-token context in
        # whatever block row 0 of their (stale but valid) table names.
        host[:, n:size] = torch.tensor([[0], [0], [-1], [1]])
        width = block_table.shape[1]
        self._host_table[:n, :width] = torch.from_numpy(block_table)
        nb = self.device.type == "cuda"
        self.input_ids[:size].copy_(host[0, :size], non_blocking=nb)
        self.positions[:size].copy_(host[1, :size], non_blocking=nb)
        self.slots[:size].copy_(host[2, :size], non_blocking=nb)
        self.seq_lens[:size].copy_(host[3, :size], non_blocking=nb)
        self.block_tables[:n, :width].copy_(self._host_table[:n, :width], non_blocking=nb)
        if self._copied is not None:
            self._copied.record()
        if fills is not None:
            fills.fill(self.input_ids[:n])
        captured = self._graphs[size]
        captured.replay()
        return captured.hidden[:n]
