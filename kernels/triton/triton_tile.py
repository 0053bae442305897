"""One K/V tile of paged attention's online softmax, shared by the decode and prefill kernels.

Each program keeps, per query row, the running max `m_i`, the running sum `l_i` of exp2(score -
max) and the unnormalised output `acc`; a tile of BLOCK_N context tokens, gathered through the
block table, updates all three (flash-attention's rescaling by exp2(old max - new max)).
"""

from __future__ import annotations

import triton
import triton.language as tl
from kvfleet.kernels.triton.triton_dot import mma
from kvfleet.kernels.triton.triton_paged import paged_kv_offsets

# Which keys of a tile a row may not see (the `MASK` argument): none (prefill's tiles before
# the diagonal, seen whole by every row); those at or past `end` (decode's last, partial tile);
# those, and the keys past each row's position `pos` (prefill's diagonal tiles).
NO_MASK = tl.constexpr(0)
CONTEXT_END = tl.constexpr(1)
CAUSAL = tl.constexpr(2)


@triton.jit
def attend_tile(
    q,
    m_i,
    l_i,
    acc,
    n0,
    end,
    pos,
    table,
    kvh,
    offs_d,
    d_mask,
    k_cache_ptr,
    v_cache_ptr,
    scale_log2,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    WIDEN_KV: tl.constexpr,  # fp8 cache: widen K/V tiles to the query's dtype after loading
    MASK: tl.constexpr,
):
    """(m_i, l_i, acc) updated by keys n0..n0 + BLOCK_N of the context before `end`. Every row
    must have seen a key by the end of the tile, in it or an earlier one, so that its max is
    finite."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < end
    kv_off = paged_kv_offsets(
        table, offs_n, n_mask, kvh, offs_d, stride_cb, stride_cs, stride_ch, BLOCK_SIZE
    )
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    if WIDEN_KV:
        k = k.to(q.dtype)
    qk = mma(q.to(k.dtype), tl.trans(k), UPCAST, PRECISION) * scale_log2
    if MASK == CAUSAL:
        qk = tl.where(n_mask[None, :] & (offs_n[None, :] <= pos[:, None]), qk, float("-inf"))
    elif MASK == CONTEXT_END:
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    if WIDEN_KV:
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, UPCAST, PRECISION)
    return m_new, l_i, acc
