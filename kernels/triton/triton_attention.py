"""Mixed-batch paged attention on Triton: the decode kernel for the leading decodes, the varlen
prefill kernel for the rest.

Two kernels rather than one unified kernel: decode is memory-bound with one query row, so it
packs a KV head's whole query group into one MMA and splits long contexts across programs;
prefill is compute-bound and tiles query tokens. A unified kernel would pad every decode to a
query tile and lose the split-K path that keeps small batches with long contexts busy.
"""

from __future__ import annotations

import torch
from kvfleet.kernels.metadata import AttentionMetadata
from kvfleet.kernels.triton.triton_decode import decode_attention
from kvfleet.kernels.triton.triton_prefill import prefill_attention


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention for a mixed batch ([tokens, heads, D] → same), reading K/V from the cache."""
    out = torch.empty_like(query)
    nd = meta.num_decodes
    if nd:
        decode_attention(
            query[:nd],
            k_cache,
            v_cache,
            meta.block_tables[:nd],
            meta.seq_lens[:nd],
            max(meta.seq_lens_host[:nd]),
            scale,
            out=out[:nd],
        )
    if meta.num_seqs > nd:
        prefill_attention(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            max(meta.query_lens_host[nd:]),
            scale,
            first_seq=nd,
            out=out,
        )
    return out
