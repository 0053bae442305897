"""LLMEngine: requests in, tokens out, one scheduled forward pass per `step()`.

Single-threaded by design: whoever calls `step()` owns the model (the offline `LLM` calls it in
a loop; the server runs it in its own thread). Everything else is bookkeeping around the
scheduler, the KV cache manager, the model runner and the sampler.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from kvfleet.runtime.engine.config import ConfigError, EngineConfig
from kvfleet.runtime.engine.cpu_allocator import keep_freed_memory
from kvfleet.runtime.engine.detokenizer import IncrementalDetokenizer
from kvfleet.runtime.engine.device import resolve_device, resolve_dtype, resolve_kv_cache_dtype
from kvfleet.runtime.engine.kv_cache_manager import KVCacheManager, PrefixCacheStats
from kvfleet.runtime.engine.model_runner import ModelRunner, kv_bytes_per_token
from kvfleet.runtime.engine.prompt_chars import max_prompt_chars
from kvfleet.runtime.engine.request import CompletionOutput, Request, RequestOutput, TokenLogprob
from kvfleet.runtime.engine.request_limits import RequestError, check_request
from kvfleet.runtime.engine.sampler import Sampler
from kvfleet.runtime.engine.sampling_params import SamplingParams
from kvfleet.runtime.engine.scheduler import Scheduler, SchedulerConfig
from kvfleet.runtime.engine.tp_start import start_tensor_parallel
from kvfleet.runtime.engine.tp_workers import TPWorkers, threads_per_rank, usable_cores

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_MEMORY = 2 * 1024**3


class EngineObserver(Protocol):
    """Hook for metrics: called from the engine thread as requests progress."""

    def on_first_token(self, request: Request, now: float) -> None: ...
    def on_token(self, request: Request, now: float) -> None: ...
    def on_finished(self, request: Request, now: float) -> None: ...


@dataclass(slots=True)
class EngineCounters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason → count
    steps: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig, observer: EngineObserver | None = None) -> None:
        self.workers: TPWorkers | None = None  # the other tensor-parallel ranks, if any
        try:
            self._build(config, observer)
        except BaseException:
            self.close()  # workers started before the failure must not outlive it
            raise

    def _build(self, config: EngineConfig, observer: EngineObserver | None) -> None:
        from kvfleet.runtime.models.loader import load_model, load_tokenizer, resolve_tokenizer

        self.config = config
        self.observer = observer
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        tp_size = config.tensor_parallel_size
        if tp_size > 1:
            torch.set_num_threads(threads_per_rank(usable_cores(), tp_size, config.num_threads))
        elif config.num_threads:
            torch.set_num_threads(config.num_threads)
        if self.device.type == "cpu":
            keep_freed_memory()  # steps reuse freed activations' pages instead of faulting in new
        torch.manual_seed(config.seed)
        # A wrong --tokenizer fails here, before seconds of weight loading.
        tokenizer_folder = resolve_tokenizer(config.tokenizer) if config.tokenizer else None
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        if tp_size > 1:
            started = start_tensor_parallel(
                config, self.device, self.dtype, self.kv_dtype, self._kv_budget, self._set_workers
            )
            self.model, self.model_config, folder, num_blocks = started
        else:
            self.model, self.model_config, folder = load_model(
                config.model, self.dtype, self.device, config.revision, config.hf_token,
                policy=config.kernel_policy,
            )  # fmt: skip
            self.model.prepack()
            num_blocks = -1  # from the budget, below
        self.model_folder = folder  # None for random:* models
        self.tokenizer = load_tokenizer(tokenizer_folder or folder or config.model)
        self._backend_tokenizer = self.tokenizer.backend_tokenizer
        mc = self.model_config

        if len(self.tokenizer) > mc.vocab_size:
            # Some published models ship added tokens past their embedding table and work as
            # long as those never appear; `validate` refuses a prompt that holds one.
            log.warning(
                "tokenizer: has %d tokens, more than the model's vocab_size %d; prompts with "
                "ids past it will be refused",
                len(self.tokenizer),
                mc.vocab_size,
            )
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ConfigError(
                f"max_model_len: {self.max_model_len} exceeds the model's context length "
                f"{mc.max_position_embeddings}"
            )
        # A text prompt longer than this is refused before tokenizing (None: no such bound).
        self.max_prompt_chars = max_prompt_chars(self._backend_tokenizer, self.max_model_len)
        # Per rank: its own KV heads (under tensor parallelism, a shard of them).
        per_token = kv_bytes_per_token(mc, self.kv_dtype, self.model.layout.num_kv_heads)
        budget = self._kv_budget()
        if num_blocks < 0:
            num_blocks = budget // (per_token * config.block_size)
        if num_blocks * config.block_size < self.max_model_len:
            raise ConfigError(
                f"kv_cache_memory: {budget} bytes hold {num_blocks * config.block_size} tokens, "
                f"fewer than max_model_len {self.max_model_len}; raise --kv-cache-memory or lower "
                f"--max-model-len"
            )
        max_batched = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:
            # Without chunking a whole prompt must fit one step.
            max_batched = max(max_batched, self.max_model_len)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                max_batched,
                config.enable_chunked_prefill,
                config.long_prefill_token_threshold,
            ),
            self.kv,
        )
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
        )
        self.sampler = Sampler(config.seed, self.device)
        self.counters = EngineCounters()
        self.eos_token_ids = frozenset(mc.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        self._groups: dict[str, list[Request]] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._prompts: dict[str, str | None] = {}
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

    def _set_workers(self, workers: TPWorkers) -> None:
        self.workers = workers  # from here on a failure in __init__ closes them

    def check_health(self) -> None:
        """Raise TPWorkerError if a tensor-parallel worker has died (else nothing: a
        one-process engine's health is its thread's)."""
        if self.workers is not None:
            self.workers.check_alive()

    def close(self) -> None:
        """Stop the tensor-parallel workers and leave the process group (no-op without)."""
        import torch.distributed as dist

        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
            if dist.is_initialized():
                dist.destroy_process_group()

    def _kv_budget(self) -> int:
        if self.config.kv_cache_memory is not None:
            return int(self.config.kv_cache_memory)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * self.config.kv_cache_memory_fraction)
        return CPU_DEFAULT_KV_MEMORY

    # --- requests ----------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        from kvfleet.runtime.engine.served_name import served_model_name

        return served_model_name(self.config)

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt. By default with the tokenizer's special tokens (the BOS
        of Llama 2/3 or Mistral), as transformers and vLLM encode a completion prompt; a
        rendered chat template already holds them, so it is encoded without."""
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The conversation rendered by the model's chat template. With
        `continue_final_message` the last (assistant) message is left open for the reply to
        extend; `template_kwargs` are extra template variables (e.g. enable_thinking)."""
        return self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **(template_kwargs or {}),
        )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """`render_chat`'s text as token ids (no special tokens added: the template has them)."""
        text = self.render_chat(
            messages, add_generation_prompt, continue_final_message, template_kwargs
        )
        return self.encode(text, add_special_tokens=False)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request against the engine's limits; return its resolved max_tokens."""
        return check_request(
            prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len
        )

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        if request_id in self._groups:
            raise RequestError("request_id", f"{request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        max_tokens = self.validate(ids, params)
        now = arrival_time if arrival_time is not None else time.monotonic()
        # Everything is built before anything is registered, so a failure half-way (a seed
        # torch refuses, a tokenizer error) leaves no state behind for the siblings built first.
        children = [
            Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=ids,
                params=params,
                eos_token_ids=self.eos_token_ids,
                max_tokens=max_tokens,
                group_id=request_id,
                index=i,
                arrival_time=now,
            )
            for i in range(params.n)
        ]
        detoks = {
            r.request_id: IncrementalDetokenizer(
                self._backend_tokenizer,
                params.stop,
                params.skip_special_tokens,
                params.include_stop_str_in_output,
            )
            for r in children
        }
        self._groups[request_id] = children
        self._detok.update(detoks)
        self._prompts[request_id] = text
        # Siblings are queued together: the first one's prompt blocks are published when they
        # are allocated, so the others hit them in the same step (n > 1 shares the prompt).
        for r in children:
            self.scheduler.add(r)
        self.counters.prompt_tokens += len(ids)

    def warm_up(self) -> None:
        """A short generation (a prefill and a decode step) outside every counter and
        observer: proves the model, cache, sampler and detokenizer work before a server
        reports ready, and takes first-call costs out of benchmarks, without showing in
        anyone's metrics."""
        observer, self.observer = self.observer, None
        prompt = self.encode("Hello, how are you?") or [0]
        try:
            self.add_request(
                "__warmup__", prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
            )
            while self.has_unfinished_requests():
                self.step()
        finally:
            self.observer = observer
            self.counters = EngineCounters()
            self.kv.stats = PrefixCacheStats()

    def abort_request(self, request_id: str) -> bool:
        """Stop a request at once and free its blocks; False if it is unknown or done."""
        children = self._groups.get(request_id)
        if children is None:
            return False
        for r in children:
            if not r.finished:
                self.scheduler.finish(r, "abort")
                self._on_finished(r, time.monotonic())
        self._forget(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    # --- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.check_health()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        self.counters.steps += 1
        try:
            result = self.runner.execute(batch)
        except Exception as exc:
            # A collective that failed because a worker died says so in gloo's or NCCL's words;
            # name the rank instead.
            self.check_health()
            raise exc
        for r, n in zip(batch.requests, batch.num_tokens, strict=True):
            r.num_computed_tokens += n
        for r, entries in result.prompt_logprobs:
            r.prompt_logprobs.extend(entries)  # type: ignore[union-attr]
        outputs: list[RequestOutput] = []
        touched: dict[str, None] = {}
        if result.sample_rows:
            picks = self._sample(result.logits, result.sample_rows, result.argmax)
            now = time.monotonic()
            for r, pick in zip(result.sample_rows, picks, strict=True):
                if r.finished:  # a sibling failed earlier in this loop and took the group down
                    continue
                try:
                    if isinstance(pick, Exception):
                        raise pick
                    self._append_token(r, *pick, now)
                except Exception as exc:
                    touched.pop(r.group_id, None)
                    outputs.append(self._fail_group(r.group_id, exc))
                else:
                    touched[r.group_id] = None
        # An output's prompt logprobs are complete or absent. Siblings queue behind the first
        # one, so today none samples before the prompt is scored; should one, its group just
        # reports later (outputs are cumulative).
        for g in touched:
            if self._groups[g][0].prompt_logprob_position is not None:
                continue
            try:
                outputs.append(self._output(g))
            except Exception as exc:
                outputs.append(self._fail_group(g, exc))
        return outputs

    def _sample(
        self, logits: torch.Tensor, rows: list[Request], argmax: list[int] | None = None
    ) -> list[tuple[int, TokenLogprob | None] | Exception]:
        """Each row's (token, logprob); where sampling the batch fails, the rows are sampled one
        at a time so that only the requests whose own rows fail get an exception. `argmax`:
        each row's argmax of `logits`, where the step computed it."""
        try:
            tokens, logprobs = self.sampler(logits, rows, argmax)
            return list(zip(tokens, logprobs, strict=True))
        except Exception:
            log.warning(
                "sampling %d rows failed; sampling them one by one", len(rows), exc_info=True
            )
        picks: list[tuple[int, TokenLogprob | None] | Exception] = []
        for i, r in enumerate(rows):
            try:
                tokens, logprobs = self.sampler(logits[i : i + 1], [r])
                picks.append((tokens[0], logprobs[0]))
            except Exception as exc:
                picks.append(exc)
        return picks

    def _fail_group(self, group_id: str, exc: Exception) -> RequestOutput:
        """Give up on one request: every completion of it finishes with reason "error" (blocks
        freed at once) and the returned output tells its client why. Nobody else is touched."""
        log.error("request %s failed; the engine goes on", group_id, exc_info=exc)
        children = self._groups[group_id]
        now = time.monotonic()
        for r in children:
            if not r.finished:
                self.scheduler.finish(r, "error")
                self._on_finished(r, now)
        out = RequestOutput(
            request_id=group_id,
            prompt=self._prompts.get(group_id),
            prompt_token_ids=children[0].prompt_token_ids,
            outputs=[
                CompletionOutput(r.index, r.output_text, r.output_token_ids, r.finish_reason)
                for r in children
            ],
            finished=True,
            num_cached_tokens=children[0].num_cached_tokens,
            error=f"the engine could not finish this request: {type(exc).__name__}: "
            f"{str(exc)[:200]}",
        )
        self._forget(group_id)
        return out

    def _append_token(self, r: Request, token: int, lp: TokenLogprob | None, now: float) -> None:
        r.all_token_ids.append(token)
        self.counters.generation_tokens += 1
        if r.logprobs is not None and lp is not None:
            r.logprobs.append(lp)
        first = r.first_token_time is None
        if first:
            r.first_token_time = now
        if self.observer is not None:
            (self.observer.on_first_token if first else self.observer.on_token)(r, now)
        r.last_token_time = now

        p = r.params
        may_stop = r.num_output_tokens >= p.min_tokens
        detok = self._detok[r.request_id]
        if may_stop and not p.ignore_eos and token in r.eos_token_ids:
            self._finish(r, "stop", None, now)  # EOS: no stop_reason, as in vLLM's API
            return
        if may_stop and token in p.stop_token_ids:
            self._finish(r, "stop", token, now)
            return
        stop_str = detok.add(token, check_stop=may_stop)
        r.output_text = detok.text
        if stop_str is not None:
            self._finish(r, "stop", stop_str, now)
        elif r.num_output_tokens >= r.max_tokens or r.num_tokens >= self.max_model_len:
            self._finish(r, "length", None, now)

    def _finish(self, r: Request, reason: str, stop_reason: str | int | None, now: float) -> None:
        self.scheduler.finish(r, reason, stop_reason)
        self._on_finished(r, now)

    def _on_finished(self, r: Request, now: float) -> None:
        reason = r.finish_reason or "abort"
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        if self.observer is not None:
            self.observer.on_finished(r, now)

    def _output(self, group_id: str) -> RequestOutput:
        children = self._groups[group_id]
        outputs = []
        for r in children:
            detok = self._detok[r.request_id]
            outputs.append(
                CompletionOutput(
                    index=r.index,
                    text=detok.visible_text(r.finished),
                    token_ids=r.output_token_ids,
                    finish_reason=r.finish_reason,
                    stop_reason=r.stop_reason,
                    logprobs=list(r.logprobs) if r.logprobs is not None else None,
                )
            )
        finished = all(r.finished for r in children)
        out = RequestOutput(
            request_id=group_id,
            prompt=self._prompts.get(group_id),
            prompt_token_ids=children[0].prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=children[0].num_cached_tokens,
            prompt_logprobs=children[0].prompt_logprobs,
        )
        if finished:
            self._forget(group_id)
        return out

    def _forget(self, group_id: str) -> None:
        for r in self._groups.pop(group_id, []):
            self._detok.pop(r.request_id, None)
        self._prompts.pop(group_id, None)
