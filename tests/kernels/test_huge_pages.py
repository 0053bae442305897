"""HugePageArena (kernels/cpu/huge_pages.py): tensors hold what is written, their mappings are
marked for huge pages, and a mapping goes back to the system with the last tensor carved from
it. tests/runtime/test_huge_page_weights.py checks that a model's weights and caches use it."""

import gc
import itertools

import pytest
import torch
from kvfleet.kernels.cpu import huge_pages
from kvfleet.kernels.cpu.huge_pages import HugePageArena

needs_thp = pytest.mark.skipif(
    not huge_pages.enabled(), reason="no transparent huge pages on this kernel"
)


def test_arena_tensors_hold_what_is_written_and_do_not_overlap():
    arena = HugePageArena()
    a = arena.copy(torch.arange(1000, dtype=torch.float32).reshape(10, 100))
    b = arena.empty((7, 3), torch.bfloat16).fill_(2.5)
    c = arena.copy(torch.full((5,), -1, dtype=torch.int64))
    assert torch.equal(a, torch.arange(1000, dtype=torch.float32).reshape(10, 100))
    assert torch.equal(b, torch.full((7, 3), 2.5, dtype=torch.bfloat16))
    assert torch.equal(c, torch.full((5,), -1, dtype=torch.int64))
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in (a, b, c))
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    assert all(t.data_ptr() % huge_pages.ALIGN == 0 and t.is_contiguous() for t in (a, b, c))


@needs_thp
def test_arena_memory_is_marked_for_huge_pages_and_2mib_aligned():
    t = HugePageArena().empty((1024,), torch.float32)
    assert huge_pages.on_huge_pages(t)
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0  # the first tensor opens the mapping
    assert not huge_pages.on_huge_pages(
        torch.empty(1 << 20)
    )  # the ordinary allocator: no such mark


def test_turned_off_the_arena_hands_out_ordinary_tensors(monkeypatch):
    monkeypatch.setenv("KVFLEET_HUGE_PAGES", "0")
    assert not huge_pages.enabled()
    t = HugePageArena().copy(torch.ones(3))
    assert torch.equal(t, torch.ones(3)) and not huge_pages.on_huge_pages(t)


@needs_thp
def test_a_mapping_is_unmapped_with_the_last_tensor_from_it(monkeypatch):
    monkeypatch.setattr(huge_pages, "CHUNK_BYTES", 4 << 20)
    arena = HugePageArena()
    first, second = arena.empty((16,), torch.float32), arena.empty((16,), torch.float32)
    big = arena.empty((3 << 20,), torch.float32)  # 12 MiB, past a chunk: a mapping of its own
    third = arena.empty((16,), torch.float32)  # the chunk goes on where it was
    assert third.data_ptr() == second.data_ptr() + huge_pages.ALIGN
    assert big.data_ptr() % huge_pages.HUGE_PAGE == 0 and huge_pages.on_huge_pages(big)
    address, big_address = first.data_ptr(), big.data_ptr()
    del arena, first
    gc.collect()
    assert huge_pages.mapping_of(address) is not None  # `second` still holds the chunk
    del second, third, big
    gc.collect()
    assert huge_pages.mapping_of(address) is None and huge_pages.mapping_of(big_address) is None
