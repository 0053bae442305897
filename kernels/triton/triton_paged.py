"""Where a tile of context tokens lives in the paged KV cache, for the Triton attention kernels.

Token t of a sequence sits in physical block `block_table[t // BLOCK_SIZE]` at offset
`t % BLOCK_SIZE`; decode and prefill kernels read K and V tiles through the same arithmetic.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_kv_offsets(
    table,  # pointer to this sequence's row of the block table
    offs_n,  # [BLOCK_N] token positions of the tile
    n_mask,  # [BLOCK_N] which positions are inside the context
    kvh,  # the KV head
    offs_d,  # [D_PAD] head-dim offsets
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
):
    """[BLOCK_N, D_PAD] element offsets of the tile in a cache with the given strides."""
    blk = tl.load(table + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    return (
        blk[:, None] * stride_cb
        + (offs_n % BLOCK_SIZE)[:, None] * stride_cs
        + kvh * stride_ch
        + offs_d[None, :]
    )
