"""Owns the model and the KV cache tensors; turns a scheduled batch into one forward pass."""

from __future__ import annotations

import numpy as np
import torch
from kvfleet.kernels import dispatch
from kvfleet.kernels.metadata import AttentionMetadata
from kvfleet.runtime.kv_cache_manager import KVCacheManager
from kvfleet.runtime.model_config import ModelConfig
from kvfleet.runtime.request import Request
from kvfleet.runtime.scheduler import ScheduledBatch


def kv_bytes_per_token(mc: ModelConfig, dtype: torch.dtype) -> int:
    """K and V, every layer: what one cached token costs."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * elem


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        kv: KVCacheManager,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        self.kv_caches = [
            dispatch.allocate_kv_cache(
                kv.num_blocks,
                kv.block_size,
                model_config.num_kv_heads,
                model_config.head_dim,
                dtype,
                device,
            )
            for _ in range(model_config.num_layers)
        ]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Request], torch.Tensor]:
        """Run every scheduled token; return the requests that now need a sampled token and
        their float32 logits (CPU), in the same order."""
        bs = self.kv.block_size
        order = [i for i, n in enumerate(batch.num_tokens) if n == 1]
        num_decodes = len(order)
        order += [i for i, n in enumerate(batch.num_tokens) if n != 1]

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[Request] = []
        logits_index: list[int] = []
        for i in order:
            r = batch.requests[i]
            n = batch.num_tokens[i]
            start = r.num_computed_tokens
            end = start + n
            blocks = self.kv.blocks_of(r.request_id)
            if n == 1:
                input_ids.append(r.all_token_ids[start])
                positions.append(start)
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                input_ids.extend(r.all_token_ids[start:end])
                pos = np.arange(start, end)
                positions.extend(pos.tolist())
                slots.extend((np.asarray(blocks)[pos // bs] * bs + pos % bs).tolist())
            query_lens.append(n)
            seq_lens.append(end)
            tables.append(blocks)
            if end == r.num_tokens:
                sample_rows.append(r)
                logits_index.append(len(input_ids) - 1)

        max_blocks = max(len(t) for t in tables)
        table = np.zeros((len(tables), max_blocks), dtype=np.int32)
        for row, t in enumerate(tables):
            table[row, : len(t)] = t
        dev = self.device
        qsl = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=qsl[1:])
        meta = AttentionMetadata(
            query_start_loc=torch.from_numpy(qsl).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(table).to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decodes=num_decodes,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_caches,
            meta,
        )
        if not sample_rows:
            return [], torch.empty(0)
        logits = self.model.compute_logits(hidden[torch.tensor(logits_index, device=dev)])
        return sample_rows, logits.float().cpu()
