"""Owns the model and the KV cache tensors; turns a scheduled batch into one forward pass."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from kvfleet.kernels import dispatch
from kvfleet.kernels.metadata import AttentionMetadata, LoraMapping
from kvfleet.runtime.engine.decode_graphs import DecodeGraphs
from kvfleet.runtime.engine.kv_cache_manager import KVCacheManager
from kvfleet.runtime.engine.request import Request
from kvfleet.runtime.engine.scheduler import ScheduledBatch
from kvfleet.runtime.engine.token_logprob import TokenLogprob
from kvfleet.runtime.engine.transfers import DeferredTokens, TokenFills, to_device, upload
from kvfleet.runtime.models.config import ModelConfig

if TYPE_CHECKING:
    from kvfleet.kernels.cpu.cpu_decode_logits import DecodeLogits
    from kvfleet.kernels.cpu.cpu_decode_step import DecodeStack
    from kvfleet.runtime.engine.lora_slots import LoraSlots
    from kvfleet.runtime.models.lora_layer import LoraLayer

# Prompt logprobs turn hidden rows into full-vocabulary logits; this many at a time bounds the
# memory that costs (a long prompt chunk times a large vocabulary would not fit otherwise).
PROMPT_LOGITS_ROWS = 256


def kv_bytes_per_token(mc: ModelConfig, dtype: torch.dtype, num_kv_heads: int | None = None) -> int:
    """K and V, every layer: what one cached token costs (for `num_kv_heads` heads: one
    tensor-parallel rank's; default all of the model's)."""
    elem = torch.empty((), dtype=dtype).element_size()
    heads = mc.num_kv_heads if num_kv_heads is None else num_kv_heads
    return 2 * mc.num_layers * heads * mc.head_dim * elem


@dataclass(slots=True)
class StepLogits:
    """What one forward pass hands the engine."""

    sample_rows: list[Request]  # the requests that now need a sampled token
    # Their float32 last-token logits [len(sample_rows), vocab], on the model's device: the
    # sampler runs there, so a GPU returns tokens, not a vocabulary-wide block per row.
    logits: torch.Tensor
    # Prompt logprobs this step computed, per request that asked, in prompt order.
    prompt_logprobs: list[tuple[Request, list[TokenLogprob]]] = field(default_factory=list)
    # Each row's argmax of `logits`, where the step computed it (the one-call CPU step, when
    # every row samples greedily); else None.
    argmax: list[int] | None = None
    # Speculative decoding: a request with draft tokens has one row per token it computed,
    # consecutive; each row's draft token (the one the row's logits verify), -1 for a row
    # that verifies none. None when no row of the step carries a draft.
    draft_tokens: list[int] | None = None
    # Rows that decode (a verify step's draft rows among them), for the step-time model: the
    # step's other tokens are prompt tokens.
    decode_rows: int = 0


@dataclass(slots=True)
class _PromptSpan:
    """Positions [lo, hi) of `request`, at hidden rows from `first_row`, owe prompt logprobs."""

    request: Request
    first_row: int
    lo: int
    hi: int


@dataclass(slots=True)
class StepInputs:
    """Everything a forward pass needs, as plain host data: what rank 0 sends every other
    tensor-parallel rank each step (pickled, a few KB), and what each rank turns into tensors."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_table: np.ndarray  # int32 [seqs, max blocks]
    num_decodes: int
    # Hidden rows whose logits are computed, one `compute_logits` call per entry, in order:
    # each prompt-logprobs chunk, then the rows to sample. Every rank makes the same calls.
    logit_rows: list[list[int]]


def forward_step(
    model: torch.nn.Module,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    inputs: StepInputs,
    device: torch.device,
    stack: DecodeStack | None = None,
    lora: list[LoraLayer] | None = None,
    fills: TokenFills | None = None,
) -> torch.Tensor:
    """The model's final hidden states [T, hidden] for the step's tokens (K/V written to
    `kv_caches`), through the fused decode `stack` where it takes the step; with `lora`, the
    step's adapters added to each layer's projections; with `fills`, input ids put in place on
    the device."""
    qsl = np.zeros(len(inputs.query_lens) + 1, dtype=np.int32)
    np.cumsum(inputs.query_lens, out=qsl[1:])
    meta = AttentionMetadata(
        query_start_loc=upload(torch.from_numpy(qsl), device),
        seq_lens=to_device(inputs.seq_lens, torch.int32, device),
        block_tables=upload(torch.from_numpy(inputs.block_table), device),
        slot_mapping=to_device(inputs.slots, torch.int64, device),
        num_decodes=inputs.num_decodes,
        max_query_len=max(inputs.query_lens),
        max_seq_len=max(inputs.seq_lens),
        query_lens_host=inputs.query_lens,
        seq_lens_host=inputs.seq_lens,
    )
    input_ids = to_device(inputs.input_ids, torch.long, device)
    if fills is not None:
        fills.fill(input_ids)
    return model(
        input_ids,
        to_device(inputs.positions, torch.long, device),
        kv_caches,
        meta,
        stack,
        lora,
    )


def allocate_kv_caches(
    model_config: ModelConfig,
    num_kv_heads: int,
    num_blocks: int,
    block_size: int,
    kv_dtype: torch.dtype,
    device: torch.device,
    kernels: dispatch.Kernels,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's K/V cache for `num_kv_heads` heads (a tensor-parallel rank's own), in the
    layout the backend of `kernels` (the model's) reads; on CPU on huge pages, since decode
    attention streams them as a step streams the weights."""
    arena = dispatch.memory_arena(device)
    return [
        kernels.allocate_kv_cache(
            num_blocks, block_size, num_kv_heads, model_config.head_dim, kv_dtype, device, arena
        )
        for _ in range(model_config.num_layers)
    ]


class StepBroadcaster(Protocol):
    """Rank 0's channel to the other tensor-parallel ranks (`tp_workers.TPWorkers`)."""

    def send_step(self, inputs: StepInputs) -> None: ...


class ModelRunner:
    """Runs a model's forward passes over the KV caches it allocates for it, in the layout and
    with the one-call step the model's kernel policy (`model.kernels.policy`) chooses."""

    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        kv: KVCacheManager,
        kv_dtype: torch.dtype,  # the cache's: the model's, or fp8 (--kv-cache-dtype)
        device: torch.device,
        workers: StepBroadcaster | None = None,  # the other tensor-parallel ranks, if any
        graph_max_batch: int = 0,  # capture decode steps up to this batch (0: no graphs)
        max_model_len: int = 0,  # the longest context a graph or one-call step must serve
        max_num_seqs: int = 0,  # the most sequences a step holds (for the one-call step)
        loras: LoraSlots | None = None,  # the LoRA adapters' slots, under --enable-lora
    ) -> None:
        self.model = model
        self.loras = loras
        self.kv = kv
        self.device = device
        self.workers = workers
        self.kv_caches = allocate_kv_caches(
            model_config,
            model.layout.num_kv_heads,
            kv.num_blocks,
            kv.block_size,
            kv_dtype,
            device,
            model.kernels,
        )
        # How steps run is chosen here, once, for these caches: on a GPU decode-only steps
        # replay CUDA graphs; on CPU steps run the fused decoder stack in one C call (decodes,
        # and prompt chunks beside them where the prefill kernel takes them), and decode-only
        # steps of up to `one_call_max_rows` sequences go from token ids to logits in one call
        # over it (cpu_decode_logits: the same bits, without the torch calls around the stack,
        # which run from cold caches after it); everything else (steps with LoRA adapters, or
        # past the C GEMMs' rows), and every tensor-parallel step, runs op by op. Each step
        # still asks the path whether it takes it under the model's current kernel policy (a
        # benchmark may swap it).
        self.graphs: DecodeGraphs | None = None
        if graph_max_batch:
            with torch.inference_mode():
                self.graphs = DecodeGraphs(
                    model, self.kv_caches, graph_max_batch, max_model_len, kv.block_size, device
                )
        build_stack = getattr(model, "build_decode_stack", None)
        self.stack: DecodeStack | None = (
            build_stack(self.kv_caches)
            if build_stack is not None and device.type == "cpu" and workers is None
            else None
        )
        rows = min(max_num_seqs, model.kernels.policy.one_call_max_rows)
        self.one_call: DecodeLogits | None = None
        if self.stack is not None and rows > 0 and max_model_len:
            max_blocks = -(-max_model_len // kv.block_size)
            self.one_call = model.build_decode_logits(self.stack, rows, max_blocks)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, previous: DeferredTokens | None = None) -> StepLogits:
        """Run every scheduled token; return the logits of the requests that now need a
        sampled token, and the prompt logprobs owed by the scheduled positions. `previous`:
        the tokens the step before sampled, where some requests' last tokens are placeholders
        for them (async scheduling: `Request.pending_row`)."""
        bs = self.kv.block_size
        # A request with draft tokens (speculative decoding) runs as one decode row per token,
        # its last token's then each draft's, over the same blocks: every layer writes the
        # step's K/V before attention reads, so row j sees the rows before it, as a causal
        # prompt chunk would. The fused CPU step, the one-call logits and the decode graphs
        # take such a step as they take any decode step.
        decoding = [
            n == 1 or r.num_computed_tokens == r.num_tokens - 1
            for r, n in zip(batch.requests, batch.num_tokens, strict=True)
        ]
        order = [i for i, d in enumerate(decoding) if d]
        num_seq_decodes = len(order)
        order += [i for i, d in enumerate(decoding) if not d]
        slot_of = self._lora_slots(batch)
        if slot_of is not None:
            # Each adapter's rows consecutive (decodes still first): one matmul pair per run.
            order = sorted(order[:num_seq_decodes], key=slot_of.__getitem__) + sorted(
                order[num_seq_decodes:], key=slot_of.__getitem__
            )
        num_decodes = sum(batch.num_tokens[i] for i in order[:num_seq_decodes])
        drafts: list[int] | None = None
        token_slots: list[int] = []
        fills = TokenFills(previous) if previous is not None else None

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[Request] = []
        logits_index: list[int] = []
        prompt_spans: list[_PromptSpan] = []
        for i in order:
            r = batch.requests[i]
            n = batch.num_tokens[i]
            start = r.num_computed_tokens
            end = start + n
            blocks = self.kv.blocks_of(r.request_id)
            owed = r.prompt_logprob_position
            if owed is not None:
                # Position p's logits score prompt token p + 1; the last prompt position's
                # logits are for sampling. A recompute after preemption owes nothing twice.
                lo, hi = max(start, owed), min(end, r.num_prompt_tokens - 1)
                if lo < hi:
                    prompt_spans.append(_PromptSpan(r, len(input_ids) + lo - start, lo, hi))
            if slot_of is not None:
                token_slots.extend([slot_of[i]] * n)
            if decoding[i] and n > 1:
                spec = r.spec_token_ids[: n - 1]
                drafts = [-1] * len(sample_rows) if drafts is None else drafts
                drafts.extend([*spec, -1])
                logits_index.extend(range(len(input_ids), len(input_ids) + n))
                input_ids.append(r.all_token_ids[start])
                input_ids.extend(spec)
                for pos in range(start, end):
                    positions.append(pos)
                    slots.append(blocks[pos // bs] * bs + pos % bs)
                    query_lens.append(1)
                    seq_lens.append(pos + 1)
                    tables.append(blocks)
                    sample_rows.append(r)
                continue
            if n == 1:
                if r.pending_row >= 0 and start == r.num_tokens - 1:
                    fills.add(len(input_ids), r.pending_row)  # type: ignore[union-attr]
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
                if drafts is not None:
                    drafts.append(-1)

        if fills is not None and not fills.rows:
            fills = None
        elif fills is not None and self.device.type == "cpu":
            fills.fill_host(input_ids)  # the tokens are on the host already
            fills = None
        max_blocks = max(len(t) for t in tables)
        # One token per sequence, every one sampled (a one-token chunk inside a prompt is not,
        # and its row would have logits no request takes), no prompt logprobs.
        one_row_each = num_decodes == len(seq_lens) == len(sample_rows) and not prompt_spans
        one_call = self.one_call if one_row_each and slot_of is None else None
        policy = self.model.kernels.policy
        if one_call is not None and one_call.accepts(num_decodes, max_blocks, policy):
            greedy = all(r.params.greedy for r in sample_rows)
            logits, argmax = one_call.run(
                input_ids, positions, slots, seq_lens, tables, greedy, policy=policy
            )
            return StepLogits(sample_rows, logits, [], argmax, drafts, num_decodes)
        table = np.zeros((len(tables), max_blocks), dtype=np.int32)
        for row, t in enumerate(tables):
            table[row, : len(t)] = t
        logit_rows = [
            list(range(s.first_row + a, s.first_row + b))
            for s in prompt_spans
            for a, b in _chunks(s.hi - s.lo)
        ]
        if sample_rows:
            logit_rows.append(logits_index)
        inputs = StepInputs(
            input_ids, positions, slots, query_lens, seq_lens, table, num_decodes, logit_rows
        )
        if self.workers is not None:
            self.workers.send_step(inputs)
        graphs = self.graphs if slot_of is None else None
        lora = self._lora_layers(token_slots) if slot_of is not None else None
        if graphs is not None and graphs.accepts(len(seq_lens), num_decodes, max_blocks):
            hidden = graphs.run(input_ids, positions, slots, seq_lens, table, fills)
        else:
            hidden = forward_step(
                self.model, self.kv_caches, inputs, self.device, self.stack, lora, fills
            )
        calls = iter(inputs.logit_rows)

        def next_logits() -> torch.Tensor:
            rows = to_device(next(calls), torch.long, self.device)
            return self.model.compute_logits(hidden[rows])

        prompt_logprobs = [(s.request, self._prompt_logprobs(next_logits, s)) for s in prompt_spans]
        if not sample_rows:
            return StepLogits([], torch.empty(0), prompt_logprobs, decode_rows=num_decodes)
        logits = next_logits()
        return StepLogits(
            sample_rows, logits, prompt_logprobs, draft_tokens=drafts, decode_rows=num_decodes
        )

    def _lora_slots(self, batch: ScheduledBatch) -> list[int] | None:
        """Each scheduled request's LoRA slot (-1: the base model), or None for a step that
        runs no adapter (it then takes the fused and graphed paths as before)."""
        if self.loras is None or not any(r.lora_id for r in batch.requests):
            return None
        # The core made the step's adapters resident (LoraSlots.make_resident) before it ran.
        slot_of = self.loras.slot_of
        return [slot_of[r.lora_id] if r.lora_id else -1 for r in batch.requests]

    def _lora_layers(self, token_slots: list[int]) -> list[LoraLayer]:
        assert self.loras is not None
        segments = []
        start = 0
        for row in range(1, len(token_slots) + 1):
            if row == len(token_slots) or token_slots[row] != token_slots[start]:
                if token_slots[start] >= 0:
                    segments.append((token_slots[start], start, row))
                start = row
        slots = to_device(token_slots, torch.long, self.device)
        return self.loras.layers(self.model.kernels, LoraMapping(slots, segments))

    def _prompt_logprobs(
        self, next_logits: Callable[[], torch.Tensor], span: _PromptSpan
    ) -> list[TokenLogprob]:
        """log_softmax (float32) at each position of the span, gathered at the next prompt
        token, with the top-k alternatives; only these small results leave the device."""
        r = span.request
        k = r.params.prompt_logprobs or 0
        targets = r.prompt_token_ids[span.lo + 1 : span.hi + 1]
        target_ids = torch.tensor(targets, dtype=torch.long, device=self.device)
        entries: list[TokenLogprob] = []
        for s, e in _chunks(len(targets)):
            logprobs = torch.log_softmax(next_logits().float(), dim=-1)
            chosen = logprobs.gather(1, target_ids[s:e, None]).squeeze(1).tolist()
            if k:
                vals, ids = logprobs.topk(k, dim=-1)
                tops = [
                    list(zip(i, v, strict=True))
                    for i, v in zip(ids.tolist(), vals.tolist(), strict=True)
                ]
            else:
                tops = [[] for _ in chosen]
            entries.extend(
                TokenLogprob(t, lp, top)
                for t, lp, top in zip(targets[s:e], chosen, tops, strict=True)
            )
        return entries


def _chunks(n: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of at most PROMPT_LOGITS_ROWS covering [0, n)."""
    return [(s, min(s + PROMPT_LOGITS_ROWS, n)) for s in range(0, n, PROMPT_LOGITS_ROWS)]
