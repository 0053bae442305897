"""EngineCore: sequences in, new tokens out, one scheduled forward pass per `step()`.

The core does four things and nothing else: schedule, run the model, sample, append. It holds
no tokenizer: prompts arrive as token ids (the input processor's work), and what it returns
per step is each sequence's new token ids (the output processor detokenizes them and looks
for stop strings). It runs in its own process under `kvfleet serve` (core_process.py) and in
the caller's process under the offline `LLM` (llm_engine.py); either way one thread calls it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from kvfleet.runtime.engine.async_step import AsyncSteps
from kvfleet.runtime.engine.config import ConfigError, EngineConfig
from kvfleet.runtime.engine.core_messages import (
    CoreInfo,
    CoreRequest,
    EngineStats,
    SequenceOutput,
    failure_message,
)
from kvfleet.runtime.engine.cpu_allocator import keep_freed_memory
from kvfleet.runtime.engine.device import model_dtype, resolve_device, resolve_kv_cache_dtype
from kvfleet.runtime.engine.grammar_matchers import CompilingRequests, GrammarCompiler
from kvfleet.runtime.engine.kv_budget import engine_kv_budget, kv_blocks
from kvfleet.runtime.engine.kv_cache_manager import KVCacheManager
from kvfleet.runtime.engine.lora_slots import LoraSlots
from kvfleet.runtime.engine.model_runner import ModelRunner, StepLogits, kv_bytes_per_token
from kvfleet.runtime.engine.request import Request
from kvfleet.runtime.engine.sampler import Sampler, sample_isolated
from kvfleet.runtime.engine.scheduler import ScheduledBatch, Scheduler, scheduler_config
from kvfleet.runtime.engine.speculator import (
    Pick,
    build_speculator,
    load_draft_model,
    verified_rows,
)
from kvfleet.runtime.engine.step_log import StepLog
from kvfleet.runtime.engine.step_time import StepTimeModel
from kvfleet.runtime.engine.token_logprob import TokenLogprob
from kvfleet.runtime.engine.tp_start import start_tensor_parallel
from kvfleet.runtime.engine.tp_workers import TPWorkers, threads_per_rank, usable_cores
from kvfleet.runtime.engine.transfers import DeferredTokens
from kvfleet.runtime.models.lora import LoraError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineCounters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason → count
    steps: int = 0
    received: int = 0  # sequences added, ever


class EngineCore:
    """The model, its KV cache, the scheduler and the sampler; `step()` runs one batch."""

    def __init__(self, config: EngineConfig) -> None:
        self.workers: TPWorkers | None = None  # the other tensor-parallel ranks, if any
        try:
            self._build(config)
        except BaseException:
            self.close()  # workers started before the failure must not outlive it
            raise

    def _build(self, config: EngineConfig) -> None:
        from kvfleet.runtime.models.loader import load_model

        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = model_dtype(config, self.device)
        tp_size = config.tensor_parallel_size
        if tp_size > 1:
            torch.set_num_threads(threads_per_rank(usable_cores(), tp_size, config.num_threads))
        elif config.num_threads:
            torch.set_num_threads(config.num_threads)
        if self.device.type == "cpu":
            keep_freed_memory()  # steps reuse freed activations' pages instead of faulting in new
        torch.manual_seed(config.seed)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        if tp_size > 1:
            started = start_tensor_parallel(
                config, self.device, self.dtype, self.kv_dtype, self._kv_budget, self._set_workers
            )
            self.model, self.model_config, folder, num_blocks = started
        else:
            self.model, self.model_config, folder = load_model(
                config.model, self.dtype, self.device, config.revision, config.hf_token,
                policy=config.kernel_policy, quantization=config.quantization,
            )  # fmt: skip
            self.model.prepack()
            num_blocks = -1  # from the budget, below
        self.model_folder = folder  # None for random:* models
        mc = self.model_config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ConfigError(
                f"max_model_len: {self.max_model_len} exceeds the model's context length "
                f"{mc.max_position_embeddings}"
            )
        # A draft model (speculative decoding) loads before the budget is read, and its cache
        # shares the budget token for token with the model's.
        draft = load_draft_model(self) if config.speculative_config else None
        # Per rank: its own KV heads (under tensor parallelism, a shard of them).
        per_token = kv_bytes_per_token(mc, self.kv_dtype, self.model.layout.num_kv_heads)
        per_token += draft.kv_bytes_per_token if draft is not None else 0
        budget = self._kv_budget()
        num_blocks = kv_blocks(config, budget, per_token, self.max_model_len, num_blocks)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        # Adapters' slots sized from the flags: their memory comes before the first request.
        self.loras = (
            LoraSlots(mc, config.max_loras, config.max_lora_rank,
                      config.max_cpu_loras or config.max_loras, self.dtype, self.device)
            if config.enable_lora else None
        )  # fmt: skip
        self.scheduler = Scheduler(scheduler_config(config, self.max_model_len), self.kv)
        # Decode steps replay CUDA graphs on a GPU (one process: the graphs hold no collectives).
        graphs = self.device.type == "cuda" and not config.enforce_eager and self.workers is None
        self.runner = ModelRunner(
            self.model,
            mc,
            self.kv,
            self.kv_dtype,
            self.device,
            self.workers,
            graph_max_batch=config.max_num_seqs if graphs else 0,
            max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs,
            loras=self.loras,
        )
        self.sampler = Sampler(config.seed, self.device)
        self.speculator = build_speculator(self, draft) if config.speculative_config else None
        self.pipeline = AsyncSteps(self) if config.async_scheduling else None
        self.grammars = GrammarCompiler(mc.vocab_size, self._load_tokenizer)
        # Constrained sequences join the scheduler once their grammar is compiled, so a new
        # schema never holds up the step loop.
        self._compiling = CompilingRequests(self.grammars)
        self.counters = EngineCounters()
        self.step_log = StepLog(config.step_log) if config.step_log else None  # --step-log
        # Output tokens already reported, by request id: a step's outputs hold only what is new.
        self._sent: dict[str, int] = {}
        log.info(
            "engine ready: %s on %s/%s, %d KV blocks of %d tokens (%.2f GiB, %s), max_model_len %d",
            config.model,
            self.device,
            str(self.dtype).removeprefix("torch."),
            num_blocks,
            config.block_size,
            num_blocks * config.block_size * per_token / 1024**3,
            str(self.kv_dtype).removeprefix("torch."),
            self.max_model_len,
        )

    def _load_tokenizer(self) -> object:
        """The model's tokenizer, for the grammar compiler's view of the vocabulary (the core
        needs it for nothing else)."""
        from kvfleet.runtime.engine.engine_tokenizer import load_engine_tokenizer

        folder = str(self.model_folder) if self.model_folder is not None else None
        return load_engine_tokenizer(self.config, folder)

    def _set_workers(self, workers: TPWorkers) -> None:
        self.workers = workers  # from here on a failure in __init__ closes them

    def _kv_budget(self) -> int:
        return engine_kv_budget(self.config, self.device)

    @property
    def info(self) -> CoreInfo:
        """The limits and locations the server's input and output processors need."""
        folder, mc, kv = self.model_folder, self.model_config, self.kv
        return CoreInfo(
            model_folder=str(folder) if folder is not None else None,
            vocab_size=mc.vocab_size, max_model_len=self.max_model_len,
            eos_token_ids=list(mc.eos_token_ids), block_size=kv.block_size,
            num_blocks=kv.num_blocks, enable_prefix_caching=kv.enable_prefix_caching,
            kv_cache_dtype=self.config.kv_cache_dtype,
        )  # fmt: skip

    def check_health(self) -> None:
        """Raise TPWorkerError if a tensor-parallel worker has died (else nothing: a
        one-process core's health is its own)."""
        if self.workers is not None:
            self.workers.check_alive()

    def close(self) -> None:
        """Stop the tensor-parallel workers and leave the process group (no-op without)."""
        import torch.distributed as dist

        if getattr(self, "grammars", None) is not None:
            self.grammars.close()
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
            if dist.is_initialized():
                dist.destroy_process_group()

    # --- requests ----------------------------------------------------------------------------
    def add(self, requests: list[CoreRequest]) -> None:
        """Queue sequences (a group's siblings together: the first one's prompt blocks are
        published when allocated, so the others hit them in the same step)."""
        built = [
            Request(
                request_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                params=r.params,
                eos_token_ids=r.eos_token_ids,
                max_tokens=r.max_tokens,
                group_id=r.group_id,
                index=r.index,
                arrival_time=r.arrival_time,
                lora_id=r.lora_id,
            )
            for r in requests
        ]
        for r in built:
            if r.request_id in self.scheduler.requests or r.request_id in self._compiling:
                raise ValueError(f"request_id: {r.request_id!r} is already in use")
            if r.lora_id and (self.loras is None or self.loras.name_of(r.lora_id) is None):
                raise ValueError(f"lora_id: adapter {r.lora_id} is not loaded")
        for r, sent in zip(built, requests, strict=True):
            if r.lora_id:
                self.loras.retain(r.lora_id)  # type: ignore[union-attr]
            if sent.grammar is not None:
                self._compiling.add(r, sent.grammar)
            else:
                self.scheduler.add(r)
            self._sent[r.request_id] = -1  # nothing reported yet, not even the first output
            if r.index == 0:  # n completions share one prompt: counted once, as vLLM does
                self.counters.prompt_tokens += len(r.prompt_token_ids)
        self.counters.received += len(built)

    def abort(self, request_ids: list[str], reason: str = "abort") -> None:
        """End sequences at once and free their blocks (unknown or finished ids are skipped).
        `reason` is what the server decided: "abort", or "stop" for a stop string."""
        for rid in request_ids:
            request = self.scheduler.requests.get(rid) or self._compiling.pop(rid, None)
            if request is not None:
                self._finish(request, reason)
            self._sent.pop(rid, None)

    @property
    def num_waiting(self) -> int:
        """Sequences not yet admitted: queued, or waiting for their grammar."""
        return self.scheduler.num_waiting + len(self._compiling)

    def has_unfinished(self) -> bool:
        return self._busy() or bool(self._compiling)

    def _busy(self) -> bool:  # sequences to run, or a step in flight to read
        in_flight = self.pipeline is not None and self.pipeline.in_flight is not None
        return self.scheduler.has_unfinished() or in_flight

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.num_waiting,
            kv_cache_usage=self.kv.usage,
            prompt_tokens=self.counters.prompt_tokens,
            generation_tokens=self.counters.generation_tokens,
            finished=dict(self.counters.finished),
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv.stats.queries,
            prefix_cache_hits=self.kv.stats.hits,
            received=self.counters.received,
            **(self.loras.names_in_use(self.scheduler, self._compiling) if self.loras else {}),
            **(self.speculator.stats_fields() if self.speculator else {}),
        )

    def warm_up(self) -> None:
        """Short generations outside every counter (core_warm_up.py), before serving."""
        from kvfleet.runtime.engine.core_warm_up import warm_up

        warm_up(self)

    # --- LoRA adapters ---------------------------------------------------------------------------
    def add_lora(self, lora_id: int, name: str, path: str) -> None:
        """Load adapter `name` from PEFT folder `path` (LoraError: why it cannot run here)."""
        if self.loras is None:
            raise LoraError(f"adapter {name!r}: LoRA is not enabled (start with --enable-lora)")
        self.loras.add(lora_id, name, path)

    def remove_lora(self, lora_id: int) -> None:
        """Unload an adapter; sequences already running it finish first."""
        if self.loras is not None:
            self.loras.remove(lora_id)

    # --- the step ----------------------------------------------------------------------------
    def step(self) -> list[SequenceOutput]:
        """Schedule and run one batch; return the sequences that gained tokens or ended (under
        async scheduling, those of the batch before this one: async_step.py)."""
        self.check_health()
        if self._compiling:
            # With nothing else to run, wait (briefly, not spinning) for a compile to end.
            for r in self._compiling.take_ready(wait=not self._busy()):
                self.scheduler.add(r)
        batch = self.scheduler.schedule()
        failed = self._drop_unreadable_loras(batch) if self.loras is not None else []
        if self.pipeline is not None:
            return self.pipeline.step(batch) + failed
        if not batch:
            return failed
        started = time.perf_counter()
        result, context = self.launch(batch)
        rows, drafts = result.sample_rows, result.draft_tokens
        picks = sample_isolated(self.sampler, result.logits, rows, result.argmax, drafts)
        self.observe(batch, result, context, started)  # with sampling
        touched: list[Request] = []
        now = time.monotonic()
        spec = self.speculator
        for v in verified_rows(spec, rows, picks, drafts):
            r = v.request
            r.num_computed_tokens -= v.rejected  # their K/V is overwritten by the next step
            for pick in v.picks:
                if r.finished:  # stopped, or a sibling failed and took the group down
                    break
                failed.extend(self.take(r, pick, now))
            if v.rejected and not r.finished:
                self.kv.trim(r, r.num_tokens)
            touched.append(r)
        if spec is not None:
            spec.propose(self.scheduler.running, self.max_model_len)
        return self.outputs(touched) + failed

    def launch(
        self, batch: ScheduledBatch, previous: DeferredTokens | None = None
    ) -> tuple[StepLogits, int]:
        """Run the batch's forward pass and count its tokens computed: its logits, and its
        prompt chunks' context for step-time observers. `previous`: the tokens in flight."""
        self.counters.steps += 1
        # Who learns from the step's time: the scheduler's model (under a step bound, to size
        # the next steps' prompt share by) and --step-log. Only they need the prompt context.
        context = batch.prompt_context() if self._observers() else 0
        try:
            result = self.runner.execute(batch, previous)
        except Exception as exc:
            self.check_health()  # a collective failed as a worker died: name the rank instead
            raise exc
        for r, n in zip(batch.requests, batch.num_tokens, strict=True):
            r.num_computed_tokens += n
        for r in batch.preempted if self.speculator is not None else ():
            self.speculator.forget(r)
        for r, entries in result.prompt_logprobs:
            r.prompt_logprobs.extend(entries)  # type: ignore[union-attr]
        return result, context

    def _observers(self) -> list[StepTimeModel | StepLog]:
        # Built per step: the warm-up swaps both objects.
        return [o for o in (self.scheduler.step_times, self.step_log) if o is not None]

    def observe(self, batch: ScheduledBatch, result: StepLogits, context: int, t0: float) -> None:
        """Tell the step-time observers how long the batch took from `t0`."""
        seconds, decodes = time.perf_counter() - t0, result.decode_rows
        for observer in self._observers():
            observer.observe(batch.total_tokens - decodes, decodes, seconds, context)

    def take(self, r: Request, pick: Pick | Exception, now: float) -> list[SequenceOutput]:
        """Append one sampled token to `r`; the group's failure outputs where it cannot."""
        if isinstance(pick, Exception):
            return self._fail_group(r, pick)
        if r.grammar is not None:
            try:
                r.grammar.accept(pick[0])
            except Exception as exc:
                return self._fail_group(r, exc)
        self._append_token(r, *pick, now)
        if r.grammar is not None and r.grammar.terminated:
            self._finish(r, "stop")  # complete: e.g. under ignore_eos, nothing may follow
        return []

    def _drop_unreadable_loras(self, batch: ScheduledBatch) -> list[SequenceOutput]:
        assert self.loras is not None
        return [o for r, exc in self.loras.make_resident(batch) for o in self._fail_group(r, exc)]

    def _fail_group(self, request: Request, exc: Exception) -> list[SequenceOutput]:
        """Give up on one request: every sequence of its group ends with reason "error" (blocks
        freed at once), each output saying why. Nobody else is touched."""
        log.error("request %s failed; the engine goes on", request.group_id, exc_info=exc)
        message = failure_message(exc)
        live = [*self.scheduler.requests.values(), *self._compiling]
        siblings = [r for r in live if r.group_id == request.group_id]
        outputs = []
        for r in [request, *(s for s in siblings if s is not request)]:
            self._compiling.pop(r.request_id, None)
            self._finish(r, "error")
            if self._sent.pop(r.request_id, None) is not None:
                outputs.append(
                    SequenceOutput(r.request_id, [], finish_reason="error", error=message)
                )
        return outputs

    def _append_token(self, r: Request, token: int, lp: TokenLogprob | None, now: float) -> None:
        r.all_token_ids.append(token)
        if r.first_token_time is None:
            r.first_token_time = now
        r.last_token_time = now
        self.counters.generation_tokens += 1
        if r.logprobs is not None and lp is not None:
            r.logprobs.append(lp)
        p = r.params
        may_stop = r.num_output_tokens >= p.min_tokens
        if may_stop and not p.ignore_eos and token in r.eos_token_ids:
            self._finish(r, "stop")  # EOS: no stop_reason, as in vLLM's API
        elif may_stop and token in p.stop_token_ids:
            self._finish(r, "stop", token)
        elif r.num_output_tokens >= r.max_tokens or r.num_tokens >= self.max_model_len:
            self._finish(r, "length")

    def _finish(self, r: Request, reason: str, stop_reason: int | None = None) -> None:
        if r.finished:
            return
        self.scheduler.finish(r, reason, stop_reason)
        if self.speculator is not None:
            self.speculator.forget(r)
        if r.lora_id and self.loras is not None:
            self.loras.release(r.lora_id)
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1

    def outputs(self, touched: list[Request]) -> list[SequenceOutput]:
        return [self.output(r) for r in touched if r.request_id in self._sent]

    def output(self, r: Request) -> SequenceOutput:
        """What `r` gained since its last output. A group's first sequence brings the prompt's
        logprobs with its first output: it samples only once its whole prompt is scored."""
        sent = self._sent[r.request_id]
        first = sent < 0
        start = max(sent, 0)
        new = r.all_token_ids[r.num_prompt_tokens + start :]
        logprobs = r.logprobs[start:] if r.logprobs is not None else None
        if r.finished:
            self._sent.pop(r.request_id, None)
        else:
            self._sent[r.request_id] = start + len(new)
        return SequenceOutput(
            r.request_id,
            new,
            logprobs,
            r.finish_reason,
            r.stop_reason if isinstance(r.stop_reason, int) else None,
            first_scheduled_time=r.first_scheduled_time if first else None,
            num_cached_tokens=r.num_cached_tokens if first else 0,
            prompt_logprobs=r.prompt_logprobs if first else None,
        )
