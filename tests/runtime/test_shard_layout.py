"""How a model is split over tensor-parallel ranks (pure: no process started): every head,
MLP column and vocabulary row is held exactly once, each rank's query heads read only KV heads
it holds, and a size that cannot split the heads is refused with the model's head counts."""

from __future__ import annotations

import argparse
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvfleet.runtime.engine.config import ConfigError, EngineConfig
from kvfleet.runtime.engine.engine_args import add_engine_args
from kvfleet.runtime.engine.tp_workers import threads_per_rank
from kvfleet.runtime.models.shard_layout import (
    TensorParallelError,
    check_tensor_parallel_size,
    shard_layout,
    split_range,
)


@st.composite
def model_and_size(draw: st.DrawFn) -> tuple[int, int, int, int, int]:
    """(heads, kv heads, intermediate, vocab, size) with a size the heads accept."""
    kv = draw(st.integers(1, 16))
    heads = kv * draw(st.integers(1, 8))
    sizes = [n for n in range(1, 2 * heads + 1) if _fits(heads, kv, n)]
    size = draw(st.sampled_from(sizes))
    return heads, kv, draw(st.integers(1, 5000)), draw(st.integers(1, 200_000)), size


def _fits(heads: int, kv: int, size: int) -> bool:
    try:
        check_tensor_parallel_size(heads, kv, size)
    except TensorParallelError:
        return False
    return True


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_split_range_covers_every_element_once_and_balances(n: int, parts: int) -> None:
    ranges = [split_range(n, parts, i) for i in range(parts)]
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1


@given(model_and_size())
def test_every_head_column_and_token_lives_on_exactly_one_rank(model) -> None:
    heads, kv, inter, vocab, size = model
    group = heads // kv
    layouts = [shard_layout(heads, kv, inter, vocab, size, r) for r in range(size)]
    q_owner = [r for lay in layouts for r in [lay.rank] * lay.num_q_heads]
    assert len(q_owner) == heads
    assert sorted(h for lay in layouts for h in range(*lay.q_heads)) == list(range(heads))
    # Each query head's KV head is on its rank: attention needs no other rank's cache.
    for lay in layouts:
        assert lay.num_q_heads >= 1
        for h in range(*lay.q_heads):
            assert lay.kv_heads[0] <= h // group < lay.kv_heads[1]
    # Every KV head is held somewhere; more than once only when ranks outnumber KV heads.
    held = [h for lay in layouts for h in range(*lay.kv_heads)]
    assert set(held) == set(range(kv))
    assert len(held) == max(kv, size)
    for dim, ranges in (
        (inter, [lay.intermediate for lay in layouts]),
        (vocab, [lay.vocab for lay in layouts]),
    ):
        assert sorted(i for a, b in ranges for i in range(a, b)) == list(range(dim))
    assert layouts[0].vocab_ranges() == [lay.vocab for lay in layouts]


def test_the_bundled_models_three_groups_split_two_and_one_over_two_ranks() -> None:
    # SmolLM2-135M: 9 heads, 3 KV heads, intermediate 1536, vocab 49152.
    r0, r1 = (shard_layout(9, 3, 1536, 49152, 2, r) for r in (0, 1))
    assert (r0.q_heads, r0.kv_heads, r1.q_heads, r1.kv_heads) == ((0, 6), (0, 2), (6, 9), (2, 3))
    assert (r0.intermediate, r1.intermediate) == ((0, 768), (768, 1536))
    assert (r0.vocab, r1.vocab) == ((0, 24576), (24576, 49152))


def test_more_ranks_than_kv_heads_replicate_them() -> None:
    # Llama-3.2-1B's shape: 32 heads, 8 KV heads, over 16 ranks: each KV head on 2 ranks.
    layouts = [shard_layout(32, 8, 8192, 128256, 16, r) for r in range(16)]
    assert [lay.kv_heads for lay in layouts[:4]] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert all(lay.num_q_heads == 2 for lay in layouts)


@pytest.mark.parametrize("size", [4, 5, 10])
def test_a_size_that_cannot_split_the_heads_is_refused_naming_them(size: int) -> None:
    with pytest.raises(TensorParallelError) as err:
        check_tensor_parallel_size(9, 3, size)
    msg = str(err.value)
    assert f"tensor_parallel_size: {size}" in msg
    assert "9 attention heads" in msg and "3 KV heads" in msg


def test_threads_are_shared_out_among_ranks_unless_asked_for() -> None:
    assert threads_per_rank(cores=2, size=2, requested=None) == 1
    assert threads_per_rank(cores=16, size=4, requested=None) == 4
    assert threads_per_rank(cores=2, size=4, requested=None) == 1
    assert threads_per_rank(cores=16, size=2, requested=3) == 3


@pytest.mark.parametrize("size", [0, -1, 65])
def test_tensor_parallel_size_out_of_range_is_a_config_error(size: int) -> None:
    with pytest.raises(ConfigError, match=r"tensor_parallel_size: must be in \[1, 64\]"):
        EngineConfig(tensor_parallel_size=size)


def test_one_pinned_gpu_cannot_hold_several_ranks() -> None:
    with pytest.raises(ConfigError, match="device: cuda:1 pins one GPU"):
        EngineConfig(device="cuda:1", tensor_parallel_size=2)


def test_the_flag_reaches_the_engine_config() -> None:
    from kvfleet.runtime.engine.engine_args import engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--tensor-parallel-size", "2"])
    assert engine_config_from_args(args).tensor_parallel_size == 2


def _slice_of_full(leaf: str, f, lay, cfg):
    """What a shard's parameter `leaf` must hold, cut from the full model's tensor `f`."""
    import torch

    d, inter = cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    (q0, q1), (k0, k1), (i0, i1) = lay.q_heads, lay.kv_heads, lay.intermediate
    if leaf == "embed_tokens":
        return f[lay.vocab[0] : lay.vocab[1]]
    if leaf == "qkv_proj":
        return torch.cat(
            [f[q0 * d : q1 * d], f[q + k0 * d : q + k1 * d], f[q + kv + k0 * d : q + kv + k1 * d]]
        )
    if leaf == "o_proj":
        return f[:, q0 * d : q1 * d]
    if leaf == "gate_up_proj":
        return torch.cat([f[i0:i1], f[inter + i0 : inter + i1]])
    if leaf == "down_proj":
        return f[:, i0:i1]
    return f  # norms: replicated


@pytest.mark.parametrize("size", [2, 4])
def test_a_sharded_random_model_holds_slices_of_the_one_process_model(size: int) -> None:
    """random:* shards draw the values of their slice of the full model, so a benchmark's
    sharded and one-process engines run the same model (and must agree on greedy tokens)."""
    import torch
    from kvfleet.runtime.models.random_models import build_random_model
    from kvfleet.runtime.models.tp_group import TPGroup

    full, cfg = build_random_model("random:tiny", torch.float32, "cpu")
    whole = dict(full.named_parameters())
    for rank in range(size):
        lay = shard_layout(
            cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size, size, rank
        )
        net, _ = build_random_model("random:tiny", torch.float32, "cpu", tp=TPGroup(lay))
        for name, p in net.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            assert torch.equal(p, _slice_of_full(leaf, whole[name], lay, cfg)), (name, rank)
