"""Torch reference implementations: the specification of every kernel, and the CPU path.

Because the CPU engine runs these for real, they are vectorised: decode attention for all
decoding sequences is one gather and two batched matmuls per layer; only prefill sequences
(a few per step) are handled one by one.

Cache shape per layer: [num_blocks, block_size, num_kv_heads, head_dim]. Any strides work; when
the storage is head-major ([kv_heads, blocks, block, dim] permuted to that shape, as
`allocate_kv_cache(head_major=True)` makes it), decode attention gathers whole blocks of one head
as contiguous rows, and the batched matmuls read contiguous K/V.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from kvfleet.kernels.metadata import AttentionMetadata

if TYPE_CHECKING:
    from kvfleet.kernels.cpu.huge_pages import HugePageArena

# fp8 KV caches (--kv-cache-dtype fp8): the largest finite value of each format. Writes
# saturate to it, as vLLM's fp8 cache writes do, rather than overflow to NaN; reads widen to
# the attention's dtype. No scale factor: vLLM's default without calibration is 1.0 too.
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_MAX


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache's dtype; into fp8 with saturation (a plain cast turns overflow into NaN)."""
    if is_fp8(dtype) and x.dtype != dtype:
        limit = FP8_MAX[dtype]
        return x.clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def rows_for_cache(
    key: torch.Tensor, value: torch.Tensor, cache_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's new K/V rows as an fp8 cache stores them (saturated, rounded to nearest even
    by torch), so every write path (this one, C, Triton) stores the same bytes and only copies;
    rows for other caches are returned as they are."""
    if is_fp8(cache_dtype):
        return to_cache_dtype(key, cache_dtype), to_cache_dtype(value, cache_dtype)
    return key, value


def attention_dtype(cache_dtype: torch.dtype, query_dtype: torch.dtype) -> torch.dtype:
    """The dtype attention computes in: the cache's, except that fp8 caches are widened to the
    query's (the model's) dtype."""
    return query_dtype if is_fp8(cache_dtype) else cache_dtype


def allocate_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    head_major: bool = False,
    arena: HugePageArena | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V caches, zeroed (masked slots are multiplied by 0: garbage NaNs would
    leak through), shaped [num_blocks, block_size, num_kv_heads, head_dim]; CPU storage from
    `arena` if given."""

    def zeros(*shape: int) -> torch.Tensor:
        if arena is not None:
            return arena.empty(shape, dtype).zero_()
        return torch.zeros(*shape, dtype=dtype, device=device)

    def one() -> torch.Tensor:
        if head_major:
            return zeros(num_kv_heads, num_blocks, block_size, head_dim).permute(1, 2, 0, 3)
        return zeros(num_blocks, block_size, num_kv_heads, head_dim)

    return one(), one()


def _is_head_major(cache: torch.Tensor) -> bool:
    """Whether a [blocks, block, kv_heads, D] cache is a view of contiguous [kv_heads, blocks,
    block, D] storage. Asked several times per layer by the CPU kernels' checks: the strides
    allocate_kv_cache gives are compared first, the permuted view (which also accepts the
    layouts that size-1 dimensions make equivalent) built only when they differ."""
    blocks, block, _, dim = cache.shape
    if cache.stride() == (block * dim, dim, blocks * block * dim, 1):
        return True
    return cache.permute(2, 0, 1, 3).is_contiguous()


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V ([tokens, kv_heads, head_dim]) into their cache slots; slot -1 is skipped."""
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    key, value = rows_for_cache(key, value, k_cache.dtype)
    k_cache[blocks, offsets] = key.to(k_cache.dtype)
    v_cache[blocks, offsets] = value.to(v_cache.dtype)


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` cached tokens as [length, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    nblocks = (length + block_size - 1) // block_size
    return cache[block_table[:nblocks].long()].flatten(0, 1)[:length]


def _gather_head_major(
    cache: torch.Tensor, table: torch.Tensor, num_seqs: int, nblocks: int
) -> torch.Tensor:
    """[kv_heads, seqs, nblocks * block, D] from head-major storage: one index_select of whole
    blocks (contiguous rows), far faster than advanced indexing of a 5-D gather."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    rows = cache.permute(2, 0, 1, 3).reshape(num_kv_heads * num_blocks, block_size * head_dim)
    heads = torch.arange(num_kv_heads, device=cache.device)[:, None] * num_blocks
    index = (heads + table.reshape(1, -1)).reshape(-1)
    return rows.index_select(0, index).view(num_kv_heads, num_seqs, nblocks * block_size, head_dim)


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence ([seqs, heads, head_dim]) over its paged context."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    nblocks = (max_seq_len + block_size - 1) // block_size
    table = block_tables[:num_seqs, :nblocks].long()
    if _is_head_major(k_cache) and _is_head_major(v_cache):
        k = _gather_head_major(k_cache, table, num_seqs, nblocks)  # [kvh, seqs, ctx, D]
        v = _gather_head_major(v_cache, table, num_seqs, nblocks)
    else:
        k = k_cache[table].flatten(1, 2).permute(2, 0, 1, 3)
        v = v_cache[table].flatten(1, 2).permute(2, 0, 1, 3)
    dtype = attention_dtype(k_cache.dtype, query.dtype)
    k, v = k.to(dtype), v.to(dtype)
    q = query.view(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1).to(dtype)
    scores = torch.matmul(q, k.transpose(-1, -2)).float()  # [kvh, seqs, group, ctx]
    ctx = torch.arange(k.shape[2], device=query.device)
    mask = ctx[None, :] >= seq_lens[:, None].to(ctx.dtype)  # [seqs, ctx]
    scores.mul_(scale).masked_fill_(mask[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)  # [kvh, seqs, group, D]
    return out.transpose(0, 1).reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def context_mask(
    q_len: int, seq_len: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Additive mask [q_len, seq_len] (0 where allowed, -inf elsewhere) for queries at the last
    q_len of seq_len positions: query i sits at position seq_len - q_len + i and sees keys up to
    it. Additive in the attention dtype, which SDPA takes as is (a bool mask it converts)."""
    rows = torch.arange(q_len, device=device)[:, None] + (seq_len - q_len)
    cols = torch.arange(seq_len, device=device)[None, :]
    mask = torch.zeros(q_len, seq_len, dtype=dtype, device=device)
    return mask.masked_fill_(cols > rows, float("-inf"))


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for one sequence's query tokens ([q, heads, D]), the last q of its
    `seq_len` context tokens, whose earlier part may already be cached (chunked prefill,
    prefix hits). `mask`: `context_mask` for these lengths, if the caller keeps one."""
    q_len, num_heads = query.shape[:2]
    num_kv_heads = k_cache.shape[2]
    dtype = attention_dtype(k_cache.dtype, query.dtype)
    k = _gather_context(k_cache, block_table, seq_len).transpose(0, 1).to(dtype)  # [kvh, ctx, D]
    v = _gather_context(v_cache, block_table, seq_len).transpose(0, 1).to(dtype)
    q = query.transpose(0, 1).to(dtype)  # [heads, q, D]
    if seq_len > q_len and mask is None:
        mask = context_mask(q_len, seq_len, k.dtype, query.device)
    # Without cached context the mask is plain causal: is_causal lets the fused kernel skip the
    # upper triangle (2x faster on a 2048-token prompt than the same mask passed as a tensor).
    out = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        attn_mask=mask if seq_len > q_len else None,
        is_causal=seq_len == q_len,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out.squeeze(0).transpose(0, 1).to(query.dtype)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    decode_fn: Callable[..., torch.Tensor] | None = None,
    prefill_fn: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention for a mixed batch ([tokens, heads, D] → same): decodes batched, prefills each.

    `decode_fn` (default `decode_attention`) computes the decode part: the CPU dispatch passes
    the C kernel, which takes `decode_attention`'s arguments. `prefill_fn`, when given, computes
    each prefill instead of `prefill_attention`: (query, k_cache, v_cache, block_table, seq_len,
    scale, out) writing into `out`, this sequence's rows of the result, and returning True; or
    False to leave that sequence here (with its causal mask built once for every layer)."""
    nd = meta.num_decodes
    decoded = None
    if nd:
        decoded = (decode_fn or decode_attention)(
            query[:nd],
            k_cache,
            v_cache,
            meta.block_tables[:nd],
            meta.seq_lens[:nd],
            max(meta.seq_lens_host[:nd]),
            scale,
        )
        if nd == meta.num_seqs:  # a decode-only step: nothing to assemble
            return decoded
    out = torch.empty_like(query)
    if decoded is not None:
        out[:nd] = decoded
    start = nd
    for i in range(nd, meta.num_seqs):
        q_len, seq_len = meta.query_lens_host[i], meta.seq_lens_host[i]
        rows = slice(start, start + q_len)
        if prefill_fn is not None and prefill_fn(
            query[rows], k_cache, v_cache, meta.block_tables[i], seq_len, scale, out[rows]
        ):
            start += q_len
            continue
        mask = None
        if seq_len > q_len:
            mask = meta.prefill_masks.get(i)
            if mask is None:
                dtype = attention_dtype(k_cache.dtype, query.dtype)
                mask = context_mask(q_len, seq_len, dtype, query.device)
                meta.prefill_masks[i] = mask
        out[start : start + q_len] = prefill_attention(
            query[start : start + q_len],
            k_cache,
            v_cache,
            meta.block_tables[i],
            seq_len,
            scale,
            mask,
        )
        start += q_len
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight in x's dtype, x + residual in float32).

    The residual stream is kept in float32: in bfloat16 its rounding over 30 layers moved the
    bundled model's greedy answers (the chat test's "Paris" became "L'Étoile"), at the cost of
    one float32 [tokens, hidden] tensor per layer."""
    xf = x.float()
    if residual is not None:
        # In place on our own float32 copy; a float32 x comes back from .float() as itself.
        xf = xf.add_(residual) if xf is not x else xf + residual
    # torch's fused rms_norm: one pass instead of five elementwise float32 ops.
    normed = torch.nn.functional.rms_norm(xf, (xf.shape[-1],), weight.float(), eps)
    return normed.to(x.dtype), xf


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: silu(x[..., :d]) * x[..., d:]."""
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]).mul_(x[..., d:])


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ([tokens, heads, D]) and k ([tokens, kv_heads, D]) by their positions.

    cos_sin_cache: [max_position, rotary_dim] holding cos in the first half, sin in the second.
    neox layout rotates (x[:d/2], x[d/2:]) pairs; the GPT-J layout rotates interleaved pairs.
    The angles are float32; the rotation runs in q's dtype (as transformers does), which in
    bfloat16 saves four dtype conversions of q and k per layer.
    """
    cos, sin = cos_sin_cache[positions].to(query.dtype).chunk(2, dim=-1)  # [tokens, rot/2]
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        rot = cos.shape[-1] * 2
        xr = x[..., :rot]
        if is_neox:
            x1, x2 = xr.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        if rot == x.shape[-1]:
            return out.to(x.dtype)
        return torch.cat((out.to(x.dtype), x[..., rot:]), dim=-1)

    return rotate(query), rotate(key)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """Multi-LoRA shrink, the specification the Triton kernel is tested against: [T, R] float32
    whose row t is lora_a[s] @ x[t] for s = token_slots[t], zeros where s is -1 (base model).

    x: [T, in]; lora_a: [L, R, in], one slot per resident adapter, ranks padded with zero rows
    to R. Tokens are grouped by slot, so each adapter is one float32 matmul over its tokens (a
    per-token gather of A would copy R × in values for every token of a prefill)."""
    shrunk = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for slot in token_slots.unique().tolist():
        if slot >= 0:
            rows = token_slots == slot
            shrunk[rows] = x[rows].float() @ lora_a[slot].float().T
    return shrunk


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
) -> None:
    """y[t] += lora_b[s] @ (lora_a[s] @ x[t]) in place for every token t whose slot s =
    token_slots[t] is not -1; the specification the Triton kernel is tested against.

    x: [T, in] the projection's input; y: [T, out] its base output (any strides: a column slice
    of a fused qkv output is updated through the view); lora_a: [L, R, in]; lora_b: [L, out, R]
    with the adapter's alpha / r scaling folded in; token_slots: int64 [T], values in [-1, L).
    The shrink is accumulated in float32 and the delta added to y in float32, then rounded once
    to y's dtype. Rows of slot -1 are not written at all, so they stay bit-identical."""
    shrunk = lora_shrink(x, lora_a, token_slots)
    for slot in token_slots.unique().tolist():
        if slot >= 0:
            rows = token_slots == slot
            delta = shrunk[rows] @ lora_b[slot].float().T
            y[rows] = (y[rows].float() + delta).to(y.dtype)
