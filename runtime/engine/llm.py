"""The offline API: `LLM(model="bundled").generate(prompts, params)` and `.chat(messages)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from kvfleet.runtime.engine.config import EngineConfig
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.engine.lora_request import LoRARequest
from kvfleet.runtime.engine.request import RequestOutput
from kvfleet.runtime.engine.sampling_params import SamplingParams

Prompt = str | list[int]
Messages = list[dict[str, Any]]


class LLM:
    """Runs the engine to completion for a batch of prompts, all scheduled together."""

    def __init__(self, model: str | EngineConfig = "bundled", **engine_options: Any) -> None:
        """`model` as for --model (with EngineConfig's fields as keyword options: dtype,
        block_size, max_model_len, ...), or a whole EngineConfig."""
        if isinstance(model, EngineConfig):
            config = model
        else:
            config = EngineConfig(model=model, **engine_options)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (nothing to do without them; they also
        stop when this process exits)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Completions for each prompt (text or token ids), in the order given, each with
        `lora_request`'s adapter (one for all, or one per prompt; needs enable_lora)."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        param_list = _broadcast(params, len(prompt_list))
        return self._run(prompt_list, param_list, _loras(lora_request, len(prompt_list)))

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Replies to one conversation or several, through the model's chat template.
        `continue_final_message` (with add_generation_prompt=False) extends the last, assistant
        message instead of starting a new one; `chat_template_kwargs` are template variables."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]  # type: ignore[list-item]
        prompts = [
            self.engine.apply_chat_template(
                list(m),  # type: ignore[arg-type]
                add_generation_prompt,
                continue_final_message,
                chat_template_kwargs,
            )
            for m in messages
        ]
        loras = _loras(lora_request, len(prompts))
        return self._run(prompts, _broadcast(params, len(prompts)), loras)

    def _run(
        self,
        prompts: list[Prompt],
        params: list[SamplingParams],
        loras: list[LoRARequest | None],
    ) -> list[RequestOutput]:
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for rid, prompt, p, lora in zip(ids, prompts, params, loras, strict=True):
                self.engine.add_request(rid, prompt, p, lora_request=lora)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[rid] for rid in ids]


def _loras(
    lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int
) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    if len(lora) != n:
        raise ValueError(f"lora_request: got {len(lora)} for {n} prompts")
    return list(lora)


def _broadcast(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"params: got {len(params)} SamplingParams for {n} prompts")
    return list(params)
