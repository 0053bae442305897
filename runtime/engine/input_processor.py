"""The input processor: what turns a prompt into sequences the core can run.

The only place that tokenizes, renders chat templates and validates a request against the
model's limits; it runs in the server process (the engine core never sees text) and, for the
offline `LLM`, in the caller's. A request with n completions becomes n `CoreRequest`s here.
"""

from __future__ import annotations

import logging
from typing import Any

from kvfleet.runtime.engine.core_messages import CoreInfo, CoreRequest
from kvfleet.runtime.engine.prompt_chars import max_prompt_chars
from kvfleet.runtime.engine.request_limits import RequestError, check_request
from kvfleet.runtime.engine.sampling_params import SamplingParams
from kvfleet.runtime.engine.structured_outputs import StructuredOutputError, grammar_of

log = logging.getLogger(__name__)


class InputProcessor:
    """Tokenizer, chat template and the model's limits, for one loaded core."""

    def __init__(self, tokenizer: Any, info: CoreInfo) -> None:
        self.tokenizer = tokenizer
        self.backend_tokenizer = tokenizer.backend_tokenizer
        self.vocab_size = info.vocab_size
        self.max_model_len = info.max_model_len
        self.eos_token_ids = frozenset(info.eos_token_ids) | (
            {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        )
        # A text prompt longer than this is refused before tokenizing (None: no such bound).
        self.max_prompt_chars = max_prompt_chars(self.backend_tokenizer, self.max_model_len)
        if len(tokenizer) > info.vocab_size:
            # Some published models ship added tokens past their embedding table and work as
            # long as those never appear; `validate` refuses a prompt that holds one.
            log.warning(
                "tokenizer: has %d tokens, more than the model's vocab_size %d; prompts with "
                "ids past it will be refused",
                len(tokenizer),
                info.vocab_size,
            )

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
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The conversation rendered by the model's chat template. With
        `continue_final_message` the last (assistant) message is left open for the reply to
        extend; `template_kwargs` are extra template variables (e.g. enable_thinking);
        `tools` the functions offered, in OpenAI's form, for templates that show them."""
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
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
        """Check a request against the model's limits (RequestError naming the field); return
        its resolved max_tokens."""
        return check_request(prompt_token_ids, params, self.vocab_size, self.max_model_len)

    def grammar(self, params: SamplingParams) -> str | None:
        """The request's structured-output constraint converted for the core (RequestError
        naming `structured_outputs.<kind>` when it cannot be enforced), or None."""
        if params.structured_outputs is None:
            return None
        try:
            return grammar_of(params.structured_outputs)
        except StructuredOutputError as exc:
            raise RequestError(f"structured_outputs.{exc.field}", exc.message) from None

    def sequences(
        self,
        group_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        max_tokens: int | None = None,
        lora_id: int = 0,
    ) -> list[CoreRequest]:
        """The n sequences of one prompt, validated (RequestError) unless `max_tokens` says it
        was already, run with LoRA adapter `lora_id` (0: the base model). Ids: the group's own
        for n = 1, `group#i` for each of n > 1."""
        if max_tokens is None:
            max_tokens = self.validate(prompt_token_ids, params)
        grammar = self.grammar(params)
        return [
            CoreRequest(
                group_id if params.n == 1 else f"{group_id}#{i}",
                prompt_token_ids,
                params,
                self.eos_token_ids,
                max_tokens,
                group_id,
                i,
                arrival_time,
                grammar,
                lora_id,
            )
            for i in range(params.n)
        ]
