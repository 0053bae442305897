"""The OpenAI-compatible HTTP server: aiohttp routes over an AsyncEngine.

Handlers parse (`protocol`), then hand the body to the engine's input processor — tokenize and
render chat templates in a worker thread (the event loop never waits on a tokenizer), validate
against the model's limits — and the resulting sequences to `generation`, which streams the
output processor's deltas; the forward passes run in the engine core's own process. Admission
is refused (503) while loading, while draining, and when more than `max_waiting_requests`
sequences are already queued. Every error, expected or
not, reaches the client in OpenAI's shape: a response, or an error event ending a stream.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web
from kvfleet.runtime.engine.request_limits import RequestError
from kvfleet.runtime.server import protocol as proto
from kvfleet.runtime.server import responses
from kvfleet.runtime.server.errors import APIError, api_error
from kvfleet.runtime.server.generation import ResponseWriter
from kvfleet.runtime.server.json_body import read_json_body
from kvfleet.runtime.server.lora_adapters import LoraAdapters
from kvfleet.runtime.server.openapi import OPENAPI_PATH, openapi_document
from kvfleet.runtime.server.tool_calls.chat_reply import tool_call_replies
from prometheus_client import CONTENT_TYPE_LATEST

from kvfleet import __version__, contract

if TYPE_CHECKING:
    from kvfleet.runtime.engine.async_engine import AsyncEngine
    from kvfleet.runtime.engine.core_messages import CoreRequest
    from kvfleet.runtime.engine.input_processor import InputProcessor
    from kvfleet.runtime.engine.sampling_params import SamplingParams
    from kvfleet.runtime.server.metrics import RuntimeMetrics

log = logging.getLogger(__name__)
T = TypeVar("T")

OPEN_PATHS = frozenset(
    {contract.HEALTH_PATH, contract.METRICS_PATH, contract.VERSION_PATH, OPENAPI_PATH}
)
RETRY_AFTER_S = 1


@dataclass(slots=True)
class ServerSettings:
    """The HTTP layer's own limits (the engine's are in EngineConfig)."""

    model_name: str
    api_key: str | None = None
    max_waiting_requests: int = 256
    max_body_bytes: int = 1024 * 1024
    tool_call_parser: str | None = None  # --tool-call-parser: how tool_choice auto reads calls
    auto_tool_choice: bool = False  # --enable-auto-tool-choice
    enable_lora: bool = False  # --enable-lora: adapters answer by name (lora_adapters.py)


class OpenAIServer:
    """Routes and admission state. `ready` is set after the warm-up generation; `draining`
    by the SIGTERM handler."""

    def __init__(
        self, engine: AsyncEngine, metrics: RuntimeMetrics, settings: ServerSettings
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.settings = settings
        self.ready = False
        self.draining = False
        self._active = 0  # API requests being handled, for the drain
        self._idle = asyncio.Event()
        self._idle.set()
        self._created = responses.now()
        self._token_text_cache: dict[int, str] = {}
        # Tokenizing and template rendering run here, off the event loop. One thread: the HF
        # tokenizer is not safe to call from several at once, and it releases the GIL while it
        # encodes, so /health and the streams keep going.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="kvfleet-tokenizer")
        self._writer = ResponseWriter(engine, settings.model_name, self._token_text)
        self.loras = LoraAdapters(
            engine, settings.model_name, settings.enable_lora, engine.config.hf_token
        )

    # --- app ---------------------------------------------------------------------------------
    def app(self) -> web.Application:
        # The body limit is checked by us (for the OpenAI error shape); aiohttp's own limit is
        # set just above it as a backstop.
        app = web.Application(
            middlewares=[self._errors, self._auth], client_max_size=self.settings.max_body_bytes + 1
        )
        app.router.add_get(contract.HEALTH_PATH, self.health)
        app.router.add_get(contract.METRICS_PATH, self.metrics_page)
        app.router.add_get(contract.VERSION_PATH, self.version)
        app.router.add_get(contract.MODELS_PATH, self.models)
        app.router.add_get(OPENAPI_PATH, self.openapi)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        self.loras.add_routes(app, self._json)
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, app: web.Application) -> None:
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no API request is in flight; False if `timeout` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    # --- middlewares -------------------------------------------------------------------------
    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _error_response(APIError(exc.status, exc.reason or str(exc)))
        except ConnectionError:
            raise  # the client is gone: nobody to answer
        except Exception as exc:
            return _error_response(api_error(exc, request))

    @web.middleware
    async def _auth(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        key = self.settings.api_key
        if key and request.path not in OPEN_PATHS:
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            # Constant-time comparison: response timing must not reveal the key's prefix.
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), key.encode()
            ):
                raise APIError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                )
        return await handler(request)

    # --- open endpoints ----------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if self.ready and not self.engine.is_alive:
            return web.json_response({"status": "engine stopped"}, status=503)
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        if not self.ready:
            return web.json_response({"status": "loading"}, status=503)
        return web.json_response({"status": "ok"})

    async def metrics_page(self, request: web.Request) -> web.Response:
        resp = web.Response(body=self.metrics.exposition())
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return resp

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def openapi(self, request: web.Request) -> web.Response:
        """The OpenAPI document of these routes, for this server: `model` may name only the
        model served, and the API asks for a key only if the server has one."""
        doc = openapi_document([self.settings.model_name], api_key=bool(self.settings.api_key))
        return web.json_response(doc)

    async def models(self, request: web.Request) -> web.Response:
        info = self.engine.info
        card = {
            "id": self.settings.model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "kvfleet",
            "root": self.engine.config.model,
            "max_model_len": info.max_model_len if info is not None else None,
        }
        cards = [card, *self.loras.cards(self._created)]
        return web.json_response({"object": "list", "data": cards})

    # --- generation --------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        req = proto.parse_completion_request(body)
        _log_ignored(request, req.ignored)
        lora_id = self._admit(req.model, len(req.prompts) * req.params.n)
        inputs = self._inputs()

        def prepare() -> tuple[list[list[int]], list[str] | None]:
            prompts = [
                self._encode(inputs, p, "prompt") if isinstance(p, str) else list(p)
                for p in req.prompts
            ]
            echo = None
            if req.echo:
                echo = [
                    p if isinstance(p, str) else inputs.tokenizer.decode(p) for p in req.prompts
                ]
            return prompts, echo

        if any(isinstance(p, str) for p in req.prompts) or req.echo:
            token_ids, echo_texts = await self._off_loop(prepare)
        else:
            # Token ids need no tokenizer: the thread hop would cost more than the copy.
            token_ids, echo_texts = prepare()
        prompts = self._sequences(inputs, token_ids, req.params, lora_id=lora_id)
        with self._track():
            if req.stream:
                return await self._writer.stream_completion(request, req, prompts, echo_texts)
            return await self._writer.full_completion(req, prompts, echo_texts)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        req = proto.parse_chat_request(body)
        _log_ignored(request, req.ignored)
        s = self.settings
        replies = tool_call_replies(req.tools, req.params, s.tool_call_parser, s.auto_tool_choice)
        lora_id = self._admit(req.model, req.params.n)
        inputs = self._inputs()
        tools = req.tools.template_tools() if req.tools is not None else None

        def prepare() -> list[int]:
            text = _render_chat(inputs, req.messages, req.template, tools)
            # The template wrote the special tokens: none are added.
            return self._encode(inputs, text, "messages", add_special_tokens=False)

        token_ids = await self._off_loop(prepare)
        (prompt,) = self._sequences(inputs, [token_ids], req.params, "messages", lora_id)
        with self._track():
            if req.stream:
                return await self._writer.stream_chat(request, req, prompt, replies)
            return await self._writer.full_chat(req, prompt, replies)

    # --- tokenizer (vLLM's extra endpoints: count tokens, see ids, without generating) --------
    async def tokenize(self, request: web.Request) -> web.Response:
        req = proto.parse_tokenize_request(await self._json(request))
        self._check_model(req.model)
        inputs = self._inputs()

        def run() -> tuple[list[int], list[str] | None]:
            if req.messages is not None:
                text = _render_chat(inputs, req.messages, req.template)
            else:
                text = req.prompt or ""
            ids = inputs.encode(text, req.add_special_tokens)
            strs = inputs.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
            return ids, strs

        ids, strs = await self._off_loop(run)
        return web.json_response(
            {
                "count": len(ids),
                "max_model_len": inputs.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        model, tokens = proto.parse_detokenize_request(await self._json(request))
        self._check_model(model)
        inputs = self._inputs()
        vocab = inputs.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(
                400, f"tokens: ids must be in [0, {vocab}), got {bad[0]}", param="tokens"
            )
        text = await self._off_loop(lambda: inputs.tokenizer.decode(tokens))
        return web.json_response({"prompt": text})

    async def _off_loop(self, fn: Callable[[], T]) -> T:
        """Run `fn` (tokenizing, rendering a template) in the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn)

    @staticmethod
    def _encode(
        inputs: InputProcessor, text: str, field: str, add_special_tokens: bool = True
    ) -> list[int]:
        """A prompt's token ids; a text too long to fit max_model_len tokens whatever it holds
        is refused by its length before the tokenizer spends time on it."""
        limit = inputs.max_prompt_chars
        if limit is not None and len(text) > limit:
            raise APIError(
                400,
                f"{field}: {len(text)} characters cannot fit in max_model_len "
                f"{inputs.max_model_len} tokens (at most {limit} characters could)",
                param=field,
                code="context_length_exceeded",
            )
        return inputs.encode(text, add_special_tokens=add_special_tokens)

    # --- admission ---------------------------------------------------------------------------
    async def _json(self, request: web.Request) -> Any:
        return await read_json_body(request, self.settings.max_body_bytes)

    def _admit(self, model: str | None, num_sequences: int) -> int:
        """Refuse a request the queue has no room for: it would queue `num_sequences`
        sequences (prompts x n), as many as it asks the engine to generate. Returns the LoRA
        adapter `model` names (0: the base model)."""
        if self.draining:
            raise _unavailable("the server is shutting down; retry on another replica")
        if not self.ready:
            raise _unavailable("the model is still loading")
        lora_id = self._check_model(model)
        limit = self.settings.max_waiting_requests
        if num_sequences > limit:
            # No amount of waiting makes room for it: a client error, not a 503 to retry.
            raise APIError(
                400,
                f"n: the request asks for {num_sequences} sequences (prompts x n), more than "
                f"the {limit} this server queues (--max-waiting-requests)",
                param="n",
                code="too_many_sequences",
            )
        pending = self.engine.num_pending
        if pending + num_sequences > limit:
            raise _unavailable(
                f"{pending} sequences are already waiting (--max-waiting-requests {limit}); "
                f"retry after {RETRY_AFTER_S} s",
                code="queue_full",
            )
        return lora_id

    def _check_model(self, model: str | None) -> int:
        """The LoRA adapter `model` names (0: the base model or none); 404 for another."""
        return self.loras.lora_id(model)

    def _inputs(self) -> InputProcessor:
        inputs = self.engine.inputs
        if inputs is None:
            raise _unavailable("the model is still loading")
        return inputs

    @staticmethod
    def _sequences(
        inputs: InputProcessor,
        prompts: list[list[int]],
        params: SamplingParams,
        prompt_field: str = "prompt",
        lora_id: int = 0,
    ) -> list[list[CoreRequest]]:
        """Each prompt's sequences for the core, checked once against the model's limits
        (400 naming the field; a chat's prompt is its messages)."""
        request_id = uuid.uuid4().hex
        now = time.monotonic()
        try:
            return [
                inputs.sequences(f"{request_id}-{i}", ids, params, now, lora_id=lora_id)
                for i, ids in enumerate(prompts)
            ]
        except RequestError as exc:
            if exc.field != "prompt":
                raise APIError(400, str(exc), param=exc.field) from exc
            message = f"{prompt_field}: {str(exc).removeprefix('prompt: ')}"
            raise APIError(400, message, param=prompt_field) from exc

    def _track(self) -> _Tracker:
        return _Tracker(self)

    def _token_text(self, token_id: int) -> str:
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self._inputs().tokenizer.decode([token_id])
            if len(self._token_text_cache) < 200_000:
                self._token_text_cache[token_id] = text
        return text


class _Tracker:
    """Counts an API request as in flight for the drain."""

    __slots__ = ("_server",)

    def __init__(self, server: OpenAIServer) -> None:
        self._server = server

    def __enter__(self) -> None:
        self._server._active += 1
        self._server._idle.clear()

    def __exit__(self, *exc: object) -> None:
        self._server._active -= 1
        if self._server._active == 0:
            self._server._idle.set()


def _render_chat(
    inputs: InputProcessor,
    messages: list[dict[str, Any]],
    opts: proto.ChatTemplateOptions,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    try:
        return inputs.render_chat(
            messages, opts.add_generation_prompt, opts.continue_final_message, opts.kwargs, tools
        )
    except Exception as exc:  # a template that rejects the conversation (e.g. role order)
        raise APIError(
            400, f"messages: the chat template rejected them: {exc}", param="messages"
        ) from exc


def _unavailable(message: str, code: str = "unavailable") -> APIError:
    return APIError(503, message, code=code)


def _error_response(exc: APIError) -> web.Response:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
    return web.json_response(exc.body(), status=exc.status, headers=headers)


def _log_ignored(request: web.Request, names: tuple[str, ...]) -> None:
    """Name, in the log, the fields of a request that this server does not know and so
    ignores (vLLM's behaviour): whoever sent them can find out why they had no effect."""
    if names:
        log.warning(
            "%s: ignored fields this server does not know: %s", request.path, ", ".join(names)
        )
