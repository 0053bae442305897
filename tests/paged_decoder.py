"""A paged-cache test harness for the model's forward: sequences in a head-major paged cache
(blocks from a shuffled pool), a prefill step through the per-op path, then decode steps,
forkable so two paths can run the same steps on the same cache bytes."""

from __future__ import annotations

import copy

import torch
from kvfleet.kernels.cpu import cpu_decode_logits
from kvfleet.kernels.metadata import AttentionMetadata
from kvfleet.runtime.models.llama import LlamaModel


class Decoder:
    """Sequences in a head-major paged cache (blocks from a shuffled pool): one prefill step
    through the per-op path, then decode steps."""

    def __init__(self, net: LlamaModel, lengths: list[int], block_size: int = 16, seed: int = 0):
        cfg = net.config
        dtype = net.embed_tokens.dtype
        gen = torch.Generator().manual_seed(seed)
        self.net, self.block_size = net, block_size
        per_seq = (max(lengths) + 8) // block_size + 1
        num_blocks = len(lengths) * per_seq + 3
        self.kv = [
            net.kernels.allocate_kv_cache(
                num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, torch.device("cpu")
            )
            for _ in range(cfg.num_layers)
        ]
        pool = torch.randperm(num_blocks, generator=gen)
        self.tables = pool[: len(lengths) * per_seq].reshape(len(lengths), per_seq).to(torch.int32)
        self.lens = [0] * len(lengths)
        self.gen = gen
        # The fused decode step over these caches, as the model runner builds it (None where
        # the model's kernels offer none): decode steps through `forward` take it.
        self.stack = net.build_decode_stack(self.kv)
        self.step([torch.randint(0, 1000, (n,), generator=gen).tolist() for n in lengths])

    def step(self, chunks: list[list[int]]) -> torch.Tensor:
        """One forward over every sequence's chunk; the final hidden states."""
        ids, positions, slots, q_lens = [], [], [], []
        for s, tokens in enumerate(chunks):
            for pos in range(self.lens[s], self.lens[s] + len(tokens)):
                block = int(self.tables[s, pos // self.block_size])
                slots.append(block * self.block_size + pos % self.block_size)
                positions.append(pos)
            ids += tokens
            q_lens.append(len(tokens))
            self.lens[s] += len(tokens)
        num_decodes = 0  # decodes come first, as the scheduler orders a batch
        while num_decodes < len(q_lens) and q_lens[num_decodes] == 1:
            num_decodes += 1
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).int(),
            seq_lens=torch.tensor(self.lens, dtype=torch.int32),
            block_tables=self.tables,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            num_decodes=num_decodes,
            max_query_len=max(q_lens),
            max_seq_len=max(self.lens),
            query_lens_host=q_lens,
            seq_lens_host=list(self.lens),
        )
        with torch.inference_mode():
            return self.net(torch.tensor(ids), torch.tensor(positions), self.kv, meta, self.stack)

    def fork(self, net: LlamaModel | None = None) -> Decoder:
        """A copy with the same cache bytes, tables and token stream, on `net` (a model with
        the same weights, under a kernel policy of its own) or else on the same model."""
        twin = copy.copy(self)
        twin.net = net if net is not None else self.net
        twin.kv = [(k.clone(), v.clone()) for k, v in self.kv]
        twin.stack = twin.net.build_decode_stack(twin.kv)
        twin.lens, twin.tables = list(self.lens), self.tables.clone()
        twin.gen = torch.Generator().set_state(self.gen.get_state())
        return twin

    def decode(self) -> torch.Tensor:
        """A decode step of every sequence (random next tokens) through the model's forward."""
        return self.step([[int(t)] for t in self._next_tokens()])

    def decode_one_call(
        self, one_call: cpu_decode_logits.DecodeLogits, argmax: bool = False
    ) -> tuple[torch.Tensor, list[int] | None]:
        """The same step as `decode` (the same tokens), through the one-call step under the
        model's kernel policy: its logits and, asked, their argmaxes."""
        ids = [int(t) for t in self._next_tokens()]
        positions = list(self.lens)
        slots = [
            int(self.tables[s, pos // self.block_size]) * self.block_size + pos % self.block_size
            for s, pos in enumerate(positions)
        ]
        self.lens = [n + 1 for n in self.lens]
        tables = [
            row[: -(-n // self.block_size)].tolist()
            for row, n in zip(self.tables, self.lens, strict=True)
        ]
        return one_call.run(
            ids, positions, slots, list(self.lens), tables, argmax, policy=self.net.kernels.policy
        )

    def _next_tokens(self) -> torch.Tensor:
        return torch.randint(0, 1000, (len(self.lens),), generator=self.gen)


def count_fused_steps(monkeypatch) -> list[int]:
    """The row count of every fused decode step (`DecodeStack.run`) from here on."""
    from kvfleet.kernels.cpu import cpu_decode_step

    calls: list[int] = []
    run = cpu_decode_step.DecodeStack.run

    def counted(self, hidden, positions, meta, policy):
        calls.append(hidden.shape[0])
        return run(self, hidden, positions, meta, policy)

    monkeypatch.setattr(cpu_decode_step.DecodeStack, "run", counted)
    return calls
