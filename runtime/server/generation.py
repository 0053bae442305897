"""An API request's run through the engine, written back as OpenAI responses: one JSON body,
or Server-Sent Events chunks ending in `data: [DONE]` (an error event first when it fails)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from kvfleet.runtime.server import protocol as proto
from kvfleet.runtime.server import responses
from kvfleet.runtime.server.errors import APIError, api_error

if TYPE_CHECKING:
    from kvfleet.runtime.engine.async_engine import AsyncEngine
    from kvfleet.runtime.engine.request import RequestOutput, TokenLogprob
    from kvfleet.runtime.engine.sampling_params import SamplingParams


class ResponseWriter:
    """Runs prompts through the engine and answers in OpenAI's shapes; `token_text` gives a
    token's text for logprobs."""

    def __init__(
        self, engine: AsyncEngine, model_name: str, token_text: Callable[[int], str]
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self._token_text = token_text

    async def _outputs(
        self, prompts: list[list[int]], params: SamplingParams
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run every prompt as one engine request; yield (prompt index, cumulative output) as
        they come. Leaving early aborts whatever is still running."""
        base = uuid.uuid4().hex
        if len(prompts) == 1:
            async for out in self.engine.generate(f"{base}-0", prompts[0], params):
                yield 0, out
            return
        merged: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, ids: list[int]) -> None:
            try:
                async for out in self.engine.generate(f"{base}-{i}", ids, params):
                    merged.put_nowait((i, out))
                merged.put_nowait((i, None))
            except Exception as exc:
                merged.put_nowait((i, exc))

        tasks = [asyncio.create_task(pump(i, ids)) for i, ids in enumerate(prompts)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await merged.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def full_completion(
        self, req: proto.CompletionRequest, prompts: list[list[int]], echo: list[str] | None
    ) -> web.Response:
        n = req.params.n
        final: dict[int, RequestOutput] = {}
        async for i, out in self._outputs(prompts, req.params):
            if out.finished:
                final[i] = out
        choices = []
        completion_tokens = 0
        for i in range(len(prompts)):
            for c in final[i].outputs:
                completion_tokens += len(c.token_ids)
                prefix = echo[i] if echo else ""
                choices.append(
                    {
                        "index": i * n + c.index,
                        "text": prefix + c.text,
                        "logprobs": (
                            responses.completion_logprobs(
                                c.logprobs, self._token_text, 0, _scored_prompt(final[i])
                            )
                            if c.logprobs is not None
                            else None
                        ),
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
        return web.json_response(
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": responses.now(),
                "model": self.model_name,
                "choices": choices,
                "usage": responses.usage(sum(map(len, prompts)), completion_tokens),
            }
        )

    async def full_chat(self, req: proto.ChatRequest, prompt: list[int]) -> web.Response:
        final: RequestOutput | None = None
        async for _, out in self._outputs([prompt], req.params):
            final = out
        assert final is not None and final.finished
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": (
                    responses.chat_logprobs(c.logprobs, self._token_text)
                    if c.logprobs is not None
                    else None
                ),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in final.outputs
        ]
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        return web.json_response(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": responses.now(),
                "model": self.model_name,
                "choices": choices,
                "usage": responses.usage(len(prompt), completion_tokens),
            }
        )

    async def _stream(
        self, request: web.Request, sse: _SSE, events: Callable[[], Awaitable[dict[str, int]]]
    ) -> web.StreamResponse:
        """Open the stream, send `events()`'s chunks, end with usage and [DONE]; once the 200
        is out, whatever fails ends the stream with an error event and [DONE] instead."""
        await sse.open()
        try:
            usage = await events()
        except ConnectionError:
            raise  # the client is gone: nobody to tell
        except Exception as exc:
            await sse.error(api_error(exc, request))
        else:
            await sse.finish(usage)
        return sse.response

    async def stream_completion(
        self,
        request: web.Request,
        req: proto.CompletionRequest,
        prompts: list[list[int]],
        echo: list[str] | None,
    ) -> web.StreamResponse:
        n = req.params.n
        sse = _SSE(
            request,
            f"cmpl-{uuid.uuid4().hex}",
            "text_completion",
            self.model_name,
            req.include_usage,
        )

        async def events() -> dict[str, int]:
            cursors = {
                (i, k): responses.ChoiceCursor() for i in range(len(prompts)) for k in range(n)
            }
            # A scored echo waits for the prompt's logprobs, which come with the first output.
            scored_echo = echo is not None and req.params.prompt_logprobs is not None
            if echo and not scored_echo:
                for i, text in enumerate(echo):
                    for k in range(n):
                        await sse.send([_text_choice(i * n + k, text, None, None)])
            echo_pending = set(range(len(prompts))) if scored_echo else set()
            completion_tokens = 0
            async for i, out in self._outputs(prompts, req.params):
                if i in echo_pending:
                    assert echo is not None
                    echo_pending.discard(i)
                    lp = responses.completion_logprobs([], self._token_text, 0, _scored_prompt(out))
                    end = sum(len(t) for t in lp["tokens"])
                    for k in range(n):
                        cursors[(i, k)].text_offset = end
                        await sse.send([_text_choice(i * n + k, echo[i], lp, None)])
                chunk = []
                for c in out.outputs:
                    cursor = cursors[(i, c.index)]
                    offset = cursor.text_offset
                    delta = responses.take_delta(cursor, c)
                    if delta is None:
                        continue
                    lp = None
                    if c.logprobs is not None:
                        lp = responses.completion_logprobs(delta.logprobs, self._token_text, offset)
                        cursor.text_offset = offset + sum(len(t) for t in lp["tokens"])
                    chunk.append(_text_choice(i * n + c.index, delta.text, lp, delta.finish_reason))
                    if delta.finish_reason is not None:
                        completion_tokens += len(c.token_ids)
                if chunk:
                    await sse.send(chunk)
            return responses.usage(sum(map(len, prompts)), completion_tokens)

        return await self._stream(request, sse, events)

    async def stream_chat(
        self, request: web.Request, req: proto.ChatRequest, prompt: list[int]
    ) -> web.StreamResponse:
        sse = _SSE(
            request,
            f"chatcmpl-{uuid.uuid4().hex}",
            "chat.completion.chunk",
            self.model_name,
            req.include_usage,
        )
        n = req.params.n

        async def events() -> dict[str, int]:
            cursors = [responses.ChoiceCursor() for _ in range(n)]
            await sse.send(
                [
                    _chat_choice(k, {"role": "assistant", "content": ""}, None, None)
                    for k in range(n)
                ]
            )
            completion_tokens = 0
            async for _, out in self._outputs([prompt], req.params):
                chunk = []
                finals = []
                for c in out.outputs:
                    delta = responses.take_delta(cursors[c.index], c)
                    if delta is None:
                        continue
                    lp = (
                        responses.chat_logprobs(delta.logprobs, self._token_text)
                        if c.logprobs is not None
                        else None
                    )
                    if delta.text or lp:
                        chunk.append(_chat_choice(c.index, {"content": delta.text}, lp, None))
                    if delta.finish_reason is not None:
                        # finish_reason travels alone in the choice's last chunk.
                        finals.append(_chat_choice(c.index, {}, None, delta.finish_reason))
                        completion_tokens += len(c.token_ids)
                if chunk:
                    await sse.send(chunk)
                if finals:
                    await sse.send(finals)
            return responses.usage(len(prompt), completion_tokens)

        return await self._stream(request, sse, events)


class _SSE:
    """A Server-Sent Events response of OpenAI chunks, ending in `data: [DONE]`."""

    def __init__(
        self,
        request: web.Request,
        chunk_id: str,
        obj: str,
        model_name: str,
        include_usage: bool,
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
        self._include_usage = include_usage

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def _write(self, payload: str) -> None:
        await self.response.write(f"data: {payload}\n\n".encode())

    async def send(self, choices: list[dict[str, Any]]) -> None:
        chunk = {**self._base, "choices": choices}
        if self._include_usage:
            chunk["usage"] = None
        await self._write(json.dumps(chunk))

    async def finish(self, usage: dict[str, int]) -> None:
        if self._include_usage:
            await self._write(json.dumps({**self._base, "choices": [], "usage": usage}))
        await self._write("[DONE]")
        await self.response.write_eof()

    async def error(self, exc: APIError) -> None:
        """End the stream with an error event and [DONE] (if the client is still there)."""
        with contextlib.suppress(ConnectionError):
            await self._write(json.dumps(exc.body()))
            await self._write("[DONE]")
            await self.response.write_eof()


def _scored_prompt(out: RequestOutput) -> list[tuple[int, TokenLogprob | None]] | None:
    """The prompt's (token id, logprob) pairs, when the request asked for them."""
    if out.prompt_logprobs is None:
        return None
    return list(zip(out.prompt_token_ids, out.prompt_logprobs, strict=True))


def _text_choice(
    index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def _chat_choice(
    index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None, finish_reason: str | None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
