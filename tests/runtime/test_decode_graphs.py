"""Decode steps through the CUDA-graph buffers: buckets, padding and the frozen split choice.

Capture itself needs a GPU; here the same buffers and padded batches run eagerly through the
Triton kernels (an engine whose kernel policy's backend is Triton; interpreted on CPU), which is
what a replay computes."""

import numpy as np
import pytest
import torch
from kvfleet.kernels.policy import KernelPolicy
from kvfleet.runtime.engine import decode_graphs
from kvfleet.runtime.engine.decode_graphs import DecodeGraphs, bucket_for, graph_batch_sizes

PROMPTS = [
    "The quick brown fox jumps over the lazy dog because",
    "Hello",
    "Once upon a time",
]


def test_buckets_cover_every_batch_up_to_the_limit():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 8]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 48]
    sizes = graph_batch_sizes(256)
    assert sizes[-1] == 256 and sizes == sorted(sizes)
    for n in range(1, 257):
        b = bucket_for(n, sizes)
        assert b is not None and b >= n
        assert b - n < 16  # never more than a bucket step of padding
    assert bucket_for(257, sizes) is None
    with pytest.raises(ValueError, match="max_batch"):
        graph_batch_sizes(0)


def _generate(model: str, graphs: bool, monkeypatch) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of PROMPTS with the Triton backend; with `graphs`, every decode-only step
    goes through DecodeGraphs (eager replays). Also returns the batch sizes the graphs ran."""
    from kvfleet.runtime import LLM, SamplingParams

    ran: list[int] = []
    # 1024 tokens of capacity: buckets below 64 sequences take the split-K path.
    triton = KernelPolicy(backend="triton")
    llm = LLM(model=model, dtype="float32", max_model_len=1024, block_size=8, kernel_policy=triton)
    if graphs:
        runner = llm.engine.runner
        runner.graphs = DecodeGraphs(
            runner.model, runner.kv_caches, 8, 1024, 8, runner.device, capture=False
        )
        real_run = runner.graphs.run

        def counting_run(input_ids, *args):
            ran.append(len(input_ids))
            return real_run(input_ids, *args)

        monkeypatch.setattr(runner.graphs, "run", counting_run)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0))
    return [list(o.outputs[0].token_ids) for o in outs], ran


def test_padded_graph_decode_gives_the_eager_tokens(tiny_llama_dir, monkeypatch):
    want, _ = _generate(str(tiny_llama_dir), graphs=False, monkeypatch=monkeypatch)
    got, ran = _generate(str(tiny_llama_dir), graphs=True, monkeypatch=monkeypatch)
    assert all(len(t) == 6 for t in want)
    assert got == want
    # Three sequences decode together: bucket 4, one padded row that must write nothing.
    assert 3 in ran


def test_capacity_decides_the_split_count(monkeypatch):
    """A graph is captured with every context at max_model_len: the split count it freezes
    must be the one the longest context needs."""
    seen: list[int] = []
    real = decode_graphs.AttentionMetadata

    def recording(**kw):
        seen.append(max(kw["seq_lens_host"]))
        return real(**kw)

    monkeypatch.setattr(decode_graphs, "AttentionMetadata", recording)

    class EchoModel(torch.nn.Module):
        def forward(self, ids, positions, caches, meta):
            return ids[:, None].float()

    graphs = DecodeGraphs(EchoModel(), [], 4, 700, 16, torch.device("cpu"), capture=False)
    table = np.zeros((3, 1), dtype=np.int32)
    hidden = graphs.run([5, 6, 7], [0, 1, 2], [3, 4, 5], [1, 2, 3], table)
    assert seen and set(seen) == {700}
    assert hidden[:, 0].tolist() == [5.0, 6.0, 7.0]
    # The padded row: token 0, slot -1 (written nowhere), a one-token context.
    assert graphs.slots[:4].tolist() == [3, 4, 5, -1]
    assert graphs.seq_lens[:4].tolist() == [1, 2, 3, 1]
    assert graphs.max_blocks == 44
