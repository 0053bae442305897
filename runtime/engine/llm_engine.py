"""LLMEngine: the three parts in one process, for the offline `LLM`, benchmarks and tests.

The input processor turns prompts into sequences, the engine core runs one scheduled forward
pass per `step()`, and the output processor turns each step's new tokens into text; `step()`
returns each touched request's cumulative `RequestOutput` (what `LLM.generate` gives back).
`kvfleet serve` runs the same parts with the core in its own process (async_engine.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvfleet.runtime.engine.config import EngineConfig
from kvfleet.runtime.engine.core import EngineCore
from kvfleet.runtime.engine.engine_tokenizer import load_engine_tokenizer
from kvfleet.runtime.engine.input_processor import InputProcessor
from kvfleet.runtime.engine.lora_request import LoRARequest
from kvfleet.runtime.engine.output_processor import (
    OutputProcessor,
    RequestDelta,
    SequenceObserver,
)
from kvfleet.runtime.engine.request import CompletionOutput, RequestOutput
from kvfleet.runtime.engine.request_limits import RequestError
from kvfleet.runtime.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class _Collected:
    """A request's output so far, built from its deltas (appends only: no copy per step)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[Any] | None = None
    error: str | None = None
    touched: bool = field(default=False)

    def take(self, delta: RequestDelta) -> None:
        self.touched = True
        self.finished = delta.finished
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.error is not None:
            self.error = delta.error
            for c in self.completions:
                c.finish_reason = c.finish_reason or "error"
        for d in delta.completions:
            c = self.completions[d.index]
            c.text += d.text
            c.token_ids.extend(d.token_ids)
            if d.logprobs is not None:
                assert c.logprobs is not None
                c.logprobs.extend(d.logprobs)
            c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=self.completions,
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
            error=self.error,
        )


class LLMEngine:
    """Requests in, cumulative outputs out; single-threaded: whoever calls `step()` owns the
    model."""

    def __init__(self, config: EngineConfig, observer: SequenceObserver | None = None) -> None:
        if config.tokenizer:
            from kvfleet.runtime.models.tokenizer_loader import resolve_tokenizer

            resolve_tokenizer(config.tokenizer)  # a wrong --tokenizer fails before the weights
        self.config = config
        self.core = EngineCore(config)
        try:
            folder = self.core.info.model_folder
            self.tokenizer = load_engine_tokenizer(config, folder)
            self.inputs = InputProcessor(self.tokenizer, self.core.info)
        except BaseException:
            self.core.close()
            raise
        self.outputs = OutputProcessor(self.tokenizer, observer)
        self._requests: dict[str, _Collected] = {}

    # The core's parts, for benchmarks and tests that look inside.
    kv = property(lambda self: self.core.kv)
    scheduler = property(lambda self: self.core.scheduler)
    runner = property(lambda self: self.core.runner)
    model = property(lambda self: self.core.model)
    model_config = property(lambda self: self.core.model_config)
    model_folder = property(lambda self: self.core.model_folder)
    counters = property(lambda self: self.core.counters)
    workers = property(lambda self: self.core.workers)
    device = property(lambda self: self.core.device)
    dtype = property(lambda self: self.core.dtype)
    kv_dtype = property(lambda self: self.core.kv_dtype)
    max_model_len = property(lambda self: self.core.max_model_len)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.inputs.eos_token_ids

    @property
    def model_name(self) -> str:
        from kvfleet.runtime.engine.served_name import served_model_name

        return served_model_name(self.config)

    def close(self) -> None:
        """Stop the tensor-parallel workers and leave the process group (no-op without)."""
        self.core.close()

    def check_health(self) -> None:
        self.core.check_health()

    # --- requests ----------------------------------------------------------------------------
    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.inputs.encode(prompt, add_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], *args: Any, **kwargs: Any) -> str:
        return self.inputs.render_chat(messages, *args, **kwargs)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], *args: Any, **kw: Any
    ) -> list[int]:
        return self.inputs.apply_chat_template(messages, *args, **kw)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        return self.inputs.validate(prompt_token_ids, params)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a prompt (text or token ids) with its n completions, run with `lora_request`'s
        adapter if given (loaded on first use: LoraError when it cannot run on this model);
        RequestError (naming the field) for what the model cannot take."""
        if request_id in self._requests:
            raise RequestError("request_id", f"{request_id!r} is already in use")
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        now = arrival_time if arrival_time is not None else time.monotonic()
        lora_id = self._lora_id(lora_request)
        sequences = self.inputs.sequences(request_id, ids, params, now, lora_id=lora_id)
        collected = _Collected(
            request_id,
            prompt if isinstance(prompt, str) else None,
            ids,
            [
                CompletionOutput(i, "", [], logprobs=[] if params.logprobs is not None else None)
                for i in range(params.n)
            ],
        )
        self.outputs.add(0, sequences, collected.take)
        try:
            self.core.add(sequences)
        except BaseException:
            self.outputs.abort(request_id, now)
            raise
        self._requests[request_id] = collected

    def _lora_id(self, lora: LoRARequest | None) -> int:
        if lora is None:
            return 0
        loaded = self.core.loras.name_of(lora.lora_int_id) if self.core.loras else None
        if loaded is None:
            self.core.add_lora(lora.lora_int_id, lora.lora_name, lora.lora_path)
        elif loaded != lora.lora_name:
            raise RequestError(
                "lora_request",
                f"lora_int_id {lora.lora_int_id} is adapter {loaded!r}, not {lora.lora_name!r}",
            )
        return lora.lora_int_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request at once and free its blocks; False if it is unknown or done."""
        if self._requests.pop(request_id, None) is None:
            return False
        self.core.abort(self.outputs.abort(request_id, time.monotonic()))
        return True

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished()

    @property
    def num_running(self) -> int:
        return self.core.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.core.num_waiting

    def warm_up(self) -> None:
        self.core.warm_up()

    def step(self) -> list[RequestOutput]:
        """Run one batch; return the requests it advanced, each as its whole output so far."""
        outputs = self.core.step()
        for reason, ids in self.outputs.process(outputs, time.monotonic()).items():
            self.core.abort(ids, reason)
        results = []
        for rid, collected in list(self._requests.items()):
            if not collected.touched:
                continue
            collected.touched = False
            results.append(collected.output())
            if collected.finished:
                del self._requests[rid]
        return results
