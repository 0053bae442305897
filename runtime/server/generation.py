"""An API request's run through the engine, written back as OpenAI responses: one JSON body,
or Server-Sent Events chunks ending in `data: [DONE]` (an error event first when it fails)."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web
from kvfleet.runtime.server import protocol as proto
from kvfleet.runtime.server import responses
from kvfleet.runtime.server.errors import APIError, api_error

if TYPE_CHECKING:
    from kvfleet.runtime.engine.async_engine import AsyncEngine
    from kvfleet.runtime.engine.core_messages import CoreRequest
    from kvfleet.runtime.engine.token_logprob import TokenLogprob
    from kvfleet.runtime.server.tool_calls.chat_reply import ToolCallReply

    ReplyFactory = Callable[[], ToolCallReply]


class ResponseWriter:
    """Runs a request's prompts through the engine and answers in OpenAI's shapes; each
    prompt is the input processor's sequences for it. `token_text` gives a token's text for
    logprobs."""

    def __init__(
        self, engine: AsyncEngine, model_name: str, token_text: Callable[[int], str]
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self._token_text = token_text

    async def full_completion(
        self, req: proto.CompletionRequest, prompts: list[list[CoreRequest]], echo: list[str] | None
    ) -> web.Response:
        n = req.params.n
        choices = {(i, k): responses.ChoiceSoFar() for i in range(len(prompts)) for k in range(n)}
        scored: dict[int, list[TokenLogprob | None]] = {}
        async for d in self.engine.generate(uuid.uuid4().hex, prompts):
            if d.prompt_logprobs is not None:
                scored[d.prompt_index] = d.prompt_logprobs
            for c in d.completions:
                choices[(d.prompt_index, c.index)].take(c)
        body = []
        for (i, k), c in choices.items():
            prompt = _scored_prompt(prompts[i], scored.get(i))
            logprobs = None
            if c.logprobs is not None:
                logprobs = responses.completion_logprobs(c.logprobs, self._token_text, 0, prompt)
            body.append(
                {
                    "index": i * n + k,
                    "text": (echo[i] if echo else "") + "".join(c.text),
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        return web.json_response(
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": responses.now(),
                "model": req.model or self.model_name,
                "choices": body,
                "usage": responses.usage(
                    _prompt_tokens(prompts), sum(c.num_tokens for c in choices.values())
                ),
            }
        )

    async def full_chat(
        self,
        req: proto.ChatRequest,
        prompt: list[CoreRequest],
        replies: ReplyFactory | None = None,
    ) -> web.Response:
        """`replies`: where tools were offered, what reads each choice's calls."""
        choices = [responses.ChoiceSoFar() for _ in range(req.params.n)]
        async for d in self.engine.generate(uuid.uuid4().hex, [prompt]):
            for c in d.completions:
                choices[c.index].take(c)
        body = []
        for k, c in enumerate(choices):
            text, finish_reason = "".join(c.text), c.finish_reason
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if replies is not None:
                message, finish_reason = replies().message(text, finish_reason)
            logprobs = None
            if c.logprobs is not None:
                logprobs = responses.chat_logprobs(c.logprobs, self._token_text)
            body.append(
                {
                    "index": k,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        return web.json_response(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": responses.now(),
                "model": req.model or self.model_name,
                "choices": body,
                "usage": responses.usage(
                    _prompt_tokens([prompt]), sum(c.num_tokens for c in choices)
                ),
            }
        )

    async def _stream(
        self, request: web.Request, sse: _SSE, events: Callable[[], Awaitable[None]]
    ) -> web.StreamResponse:
        """Open the stream, send `events()`'s chunks, end with usage and [DONE]; once the 200
        is out, whatever fails ends the stream with an error event and [DONE] instead."""
        await sse.open()
        try:
            await events()
        except ConnectionError:
            raise  # the client is gone: nobody to tell
        except Exception as exc:
            await sse.error(api_error(exc, request))
        else:
            await sse.finish()
        return sse.response

    async def stream_completion(
        self,
        request: web.Request,
        req: proto.CompletionRequest,
        prompts: list[list[CoreRequest]],
        echo: list[str] | None,
    ) -> web.StreamResponse:
        n = req.params.n
        sse = _SSE(
            request,
            f"cmpl-{uuid.uuid4().hex}",
            "text_completion",
            req.model or self.model_name,
            req,
        )
        sse.prompt_tokens = _prompt_tokens(prompts)
        wants_logprobs = req.params.logprobs is not None

        async def events() -> None:
            offsets = {(i, k): 0 for i in range(len(prompts)) for k in range(n)}
            # A scored echo waits for the prompt's logprobs, which come with the first delta.
            scored_echo = echo is not None and req.params.prompt_logprobs is not None
            if echo and not scored_echo:
                for i, text in enumerate(echo):
                    await sse.send([_text_choice(i * n + k, text, None, None) for k in range(n)])
            async for d in self.engine.generate(uuid.uuid4().hex, prompts):
                i = d.prompt_index
                if scored_echo and d.prompt_logprobs is not None:
                    assert echo is not None
                    scored = _scored_prompt(prompts[i], d.prompt_logprobs)
                    lp = responses.completion_logprobs([], self._token_text, 0, scored)
                    end = sum(len(t) for t in lp["tokens"])
                    for k in range(n):
                        offsets[(i, k)] = end
                    await sse.send([_text_choice(i * n + k, echo[i], lp, None) for k in range(n)])
                chunk = []
                for c in d.completions:
                    sse.completion_tokens += len(c.token_ids)
                    if not (c.text or c.logprobs or c.finish_reason):
                        continue  # tokens with no text yet (half a character): said later
                    lp = None
                    if wants_logprobs:
                        offset = offsets[(i, c.index)]
                        lp = responses.completion_logprobs(
                            c.logprobs or [], self._token_text, offset
                        )
                        offsets[(i, c.index)] = offset + sum(len(t) for t in lp["tokens"])
                    chunk.append(_text_choice(i * n + c.index, c.text, lp, c.finish_reason))
                if chunk:
                    await sse.send(chunk)

        return await self._stream(request, sse, events)

    async def stream_chat(
        self,
        request: web.Request,
        req: proto.ChatRequest,
        prompt: list[CoreRequest],
        replies: ReplyFactory | None = None,
    ) -> web.StreamResponse:
        sse = _SSE(
            request,
            f"chatcmpl-{uuid.uuid4().hex}",
            "chat.completion.chunk",
            req.model or self.model_name,
            req,
        )
        sse.prompt_tokens = _prompt_tokens([prompt])
        n = req.params.n
        wants_logprobs = req.params.logprobs is not None
        readers = [replies() for _ in range(n)] if replies is not None else None

        async def events() -> None:
            await sse.send(
                [
                    _chat_choice(k, {"role": "assistant", "content": ""}, None, None)
                    for k in range(n)
                ]
            )
            async for d in self.engine.generate(uuid.uuid4().hex, [prompt]):
                chunk = []
                finals = []
                for c in d.completions:
                    sse.completion_tokens += len(c.token_ids)
                    lp = None
                    if wants_logprobs and c.logprobs:
                        lp = responses.chat_logprobs(c.logprobs, self._token_text)
                    if readers is None:
                        if c.text or lp:
                            chunk.append(_chat_choice(c.index, {"content": c.text}, lp, None))
                        if c.finish_reason is not None:
                            # finish_reason travels alone in the choice's last chunk.
                            finals.append(_chat_choice(c.index, {}, None, c.finish_reason))
                        continue
                    # Tools offered: the text is read for calls; each fragment is a chunk of
                    # its own, as OpenAI streams them (one delta per choice per chunk).
                    reader = readers[c.index]
                    fragments = reader.feed(c.text)
                    if c.finish_reason is not None:
                        rest, reason = reader.finish(c.finish_reason)
                        fragments.extend(rest)
                        finals.append(_chat_choice(c.index, {}, None, reason))
                    for f in fragments:
                        await sse.send([_chat_choice(c.index, f, None, None)])
                if chunk:
                    await sse.send(chunk)
                if finals:
                    await sse.send(finals)

        return await self._stream(request, sse, events)


class _SSE:
    """A Server-Sent Events response of OpenAI chunks, ending in `data: [DONE]`. With
    `continuous_usage_stats` every chunk carries the usage so far (vLLM's extension), so a
    client can count tokens, not chunks."""

    def __init__(
        self,
        request: web.Request,
        chunk_id: str,
        obj: str,
        model_name: str,
        req: proto.CompletionRequest | proto.ChatRequest,
    ) -> None:
        self.request = request
        self.response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        self._base = {
            "id": chunk_id,
            "object": obj,
            "created": responses.now(),
            "model": model_name,
        }
        self._include_usage = req.include_usage
        self._continuous_usage = req.continuous_usage
        self.prompt_tokens = 0
        self.completion_tokens = 0

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def _write(self, payload: bytes) -> None:
        await self.response.write(b"data: " + payload + b"\n\n")

    async def send(self, choices: list[dict[str, Any]]) -> None:
        chunk = {**self._base, "choices": choices}
        if self._continuous_usage:
            chunk["usage"] = responses.usage(self.prompt_tokens, self.completion_tokens)
        elif self._include_usage:
            chunk["usage"] = None
        await self._write(_json(chunk))

    async def finish(self) -> None:
        if self._include_usage:
            usage = responses.usage(self.prompt_tokens, self.completion_tokens)
            await self._write(_json({**self._base, "choices": [], "usage": usage}))
        await self._write(b"[DONE]")
        await self.response.write_eof()

    async def error(self, exc: APIError) -> None:
        """End the stream with an error event and [DONE] (if the client is still there)."""
        with contextlib.suppress(ConnectionError):
            await self._write(_json(exc.body()))
            await self._write(b"[DONE]")
            await self.response.write_eof()


# A chunk is encoded for every token of every stream: msgspec's encoder takes ~1 us where
# json.dumps takes ~10 (compact UTF-8 output, as OpenAI's own API writes it).
_ENCODER = msgspec.json.Encoder()


def _json(obj: dict[str, Any]) -> bytes:
    """`obj` as JSON; what msgspec refuses (a float subclass such as numpy's, a lone
    surrogate, which UTF-8 cannot hold) is written by json.dumps, as every chunk was before."""
    try:
        return _ENCODER.encode(obj)
    except (UnicodeEncodeError, TypeError):
        return json.dumps(obj).encode()


def _scored_prompt(
    prompt: list[CoreRequest], logprobs: list[TokenLogprob | None] | None
) -> list[tuple[int, TokenLogprob | None]] | None:
    """The prompt's (token id, logprob) pairs, when the request asked for them."""
    if logprobs is None:
        return None
    return list(zip(prompt[0].prompt_token_ids, logprobs, strict=True))


def _prompt_tokens(prompts: list[list[CoreRequest]]) -> int:
    return sum(len(seqs[0].prompt_token_ids) for seqs in prompts)


def _text_choice(
    index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def _chat_choice(
    index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None, finish_reason: str | None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
