"""The OpenAI-compatible HTTP API: POST /v1/chat/completions, POST /v1/completions, GET /v1/models.

Each request runs on its own gRPC stream to Triton, exactly as a websocket generation does, and
holds it inside `aclosing`: a client that goes away cancels its handler (the server runs with
handler_cancellation), leaving the `async with` cancels the stream, and Triton marks the request
cancelled, so the engine stops generating it. A streamed answer starts only once the model's
first response arrived, so an invalid request still gets a 400, not a 200 with an error inside.
The same token and Origin rules as the websocket apply (the token is the API key).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace

from aiohttp import web

from clients.bridge import http
from clients.bridge.openai_errors import (
    ApiError,
    forbidden_origin,
    from_generation_error,
    invalid,
    not_ready,
    unauthorized,
)
from clients.bridge.openai_errors import path_error as _path_error
from clients.bridge.openai_request import ApiRequest, check_model, parse_chat, parse_completion
from clients.bridge.openai_response import (
    SSE_DONE,
    Answer,
    delta_chunks,
    finish_chunk,
    model_card,
    models_list,
    role_chunk,
    sse,
    usage_chunk,
    whole_response,
)
from clients.bridge.openai_tools import ToolCallParser
from clients.bridge.upstream import Upstream
from clients.library.chunk import Chunk, GenerationError
from streaming_backend.sampling.request_keys import GUIDED_KEYS
from streaming_backend.wire import INTERNAL, UNAVAILABLE

log = logging.getLogger("tokenstream.bridge")

API_PREFIX = "/v1"
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # a reverse proxy must not buffer the tokens
}
Parser = Callable[[object, str], ApiRequest]


def add_routes(app: web.Application, bridge: Upstream) -> None:
    """Add the API's routes (and its shutdown hook) to the bridge's application."""
    api = OpenAIApi(bridge)
    app.router.add_post(f"{API_PREFIX}/chat/completions", api.chat_completions)
    app.router.add_post(f"{API_PREFIX}/completions", api.completions)
    app.router.add_get(f"{API_PREFIX}/models", api.models)
    app.router.add_get(f"{API_PREFIX}/models/{{model}}", api.model)
    app.on_shutdown.append(api.shutdown)


def is_api_path(path: str) -> bool:
    """True for the paths of this API (their 404 and 405 use OpenAI's error object)."""
    return path == API_PREFIX or path.startswith(f"{API_PREFIX}/")


def path_error(status: int, request: web.Request) -> web.Response:
    """404 or 405 in OpenAI's error format."""
    return error_response(_path_error(status, request.method, request.path))


def error_response(error: ApiError) -> web.Response:
    """An error answer: OpenAI's error object, its status, Retry-After where it helps."""
    return http.json_response(error.status, error.body(), error.headers())


class OpenAIApi:
    """The API's handlers and the streams they hold open."""

    def __init__(self, bridge: Upstream) -> None:
        self.bridge, self.cfg = bridge, bridge.cfg
        self.created = int(time.time())
        self.tasks: set[asyncio.Task] = set()  # handlers holding a generation
        self.closing = False

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        return await self._answer(request, parse_chat)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        return await self._answer(request, parse_completion)

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models."""
        try:
            self._check_access(request)
        except ApiError as exc:
            return error_response(exc)
        return http.json_response(200, models_list(self.cfg.model, self.created))

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{model}."""
        try:
            self._check_access(request)
            name = check_model(request.match_info["model"], self.cfg.model)
        except ApiError as exc:
            return error_response(exc)
        return http.json_response(200, model_card(name, self.created))

    async def shutdown(self, app: web.Application) -> None:
        """Cancel the running generations; each tells its client (an on_shutdown hook)."""
        self.closing = True
        for task in list(self.tasks):
            task.cancel()

    def _check_access(self, request: web.Request) -> None:
        """The websocket's rules: a foreign browser Origin is refused; the token is required."""
        origin = request.headers.get("Origin")
        if not http.origin_allowed(origin, request.headers.get("Host"), self.cfg.origins):
            raise forbidden_origin(origin or "")
        if self.cfg.token is not None:
            offered = http.bearer(request.headers, request.query)
            if offered is None or not http.token_matches(offered, self.cfg.token):
                raise unauthorized()

    async def _answer(self, request: web.Request, parse: Parser) -> web.StreamResponse:
        """Check, parse, generate; any failure before the first byte is an error response."""
        task = asyncio.current_task()
        self.tasks.add(task)
        try:
            self._check_access(request)
            api_request = parse(await _read_json(request, self.cfg.max_body_bytes), self.cfg.model)
            if not self.bridge.ready:
                raise not_ready(self.cfg.triton_url)
            return await self._generate(request, api_request)
        except ApiError as exc:
            return error_response(exc)
        except asyncio.CancelledError:
            if not self.closing:
                raise  # the client went away: nobody to answer
            return error_response(_shutting_down())
        except Exception as exc:  # a bug, not the client's fault: say so without a traceback
            log.exception("OpenAI API request failed")
            return error_response(_internal(exc))
        finally:
            self.tasks.discard(task)

    async def _generate(self, request: web.Request, api: ApiRequest) -> web.StreamResponse:
        """One gRPC stream per choice; leaving this function cancels them upstream.

        Choice 0 starts first: once its first token came, its prompt is prefilled and the
        other choices reuse it from the prefix cache instead of computing it again.
        """
        parser = ToolCallParser(frozenset(t.name for t in api.tools.tools)) if api.tools else None
        first = Answer(api.kind, api.model, api.include_usage, logprobs=api.logprobs is not None)
        first.tools = parser
        answers = [first, *(first.choice(i) for i in range(1, api.n))]
        async with contextlib.AsyncExitStack() as stack:
            streams = []
            for choice_request in api.choice_requests():
                chunks = self.bridge.generate(choice_request, f"oai-{uuid.uuid4().hex[:12]}")
                streams.append(await stack.enter_async_context(contextlib.aclosing(chunks)))
            try:
                firsts = [await _next(streams[0])]
                firsts += await _all([_next(s) for s in streams[1:]])
            except ApiError as exc:
                raise _grammar_param(exc, api) from None
            for answer, chunk in zip(answers, firsts):  # before the role chunk, which names it
                answer.system_fingerprint = chunk.system_fingerprint if chunk else None
            merged = await stack.enter_async_context(contextlib.aclosing(_merged(streams, firsts)))
            if api.stream:
                return await self._stream(request, answers, merged)
            return await _collect(answers, merged)

    async def _stream(
        self, request: web.Request, answers: Sequence[Answer], merged: AsyncIterator
    ) -> web.StreamResponse:
        """Server-sent events: role, one event per token, finish, usage if asked, [DONE]."""
        response = web.StreamResponse(headers={**http.SECURITY_HEADERS, **SSE_HEADERS})
        await response.prepare(request)
        try:
            for answer in answers:
                opening = role_chunk(answer)
                if opening is not None:
                    await response.write(sse(opening))
            async for index, chunk in merged:
                answer = answers[index]
                if chunk is None:
                    await response.write(sse(finish_chunk(answer)))
                    continue
                for payload in delta_chunks(answer, answer.add(chunk)):
                    await response.write(sse(payload))
            if answers[0].include_usage:
                await response.write(sse(usage_chunk(answers)))
        except ConnectionError:
            return response  # the client went away (its handler is being cancelled too)
        except ApiError as exc:  # the generation failed midway: tell the client in the stream
            await _write_quietly(response, sse(exc.body()))
        except asyncio.CancelledError:
            if not self.closing:
                raise  # the client went away
            await _write_quietly(response, sse(_shutting_down().body()))
        except Exception as exc:  # a bug: the stream is already open, so say it in the stream
            log.exception("OpenAI API stream failed")
            await _write_quietly(response, sse(_internal(exc).body()))
        await _write_quietly(response, SSE_DONE)
        return response


async def _collect(answers: Sequence[Answer], merged: AsyncIterator) -> web.Response:
    """The non-streamed answer: every chunk of every choice, then one JSON body."""
    async for index, chunk in merged:
        if chunk is not None:
            answers[index].add(chunk)
    return http.json_response(200, whole_response(answers))


async def _merged(
    streams: Sequence[AsyncIterator[Chunk]], firsts: Sequence[Chunk | None]
) -> AsyncIterator[tuple[int, Chunk | None]]:
    """(choice index, chunk) as each choice's chunks arrive; (index, None) when it ends."""
    if len(streams) == 1:  # one choice: no task per chunk
        chunk = firsts[0]
        while chunk is not None:
            yield 0, chunk
            chunk = await _next(streams[0])
        yield 0, None
        return
    pending: dict[asyncio.Future, int] = {}
    try:
        for index, chunk in enumerate(firsts):
            yield index, chunk
            if chunk is not None:
                pending[asyncio.ensure_future(_next(streams[index]))] = index
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):
                index = pending.pop(task)
                chunk = task.result()  # a failed choice fails the answer (ApiError)
                yield index, chunk
                if chunk is not None:
                    pending[asyncio.ensure_future(_next(streams[index]))] = index
    finally:
        await _cancel(pending)


async def _all(awaitables: Sequence[Awaitable]) -> list:
    """Await all together; if one fails, cancel the others and raise its error."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        await _cancel(tasks)


async def _cancel(tasks) -> None:
    """Cancel tasks still running and wait until they have ended."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _grammar_param(error: ApiError, api: ApiRequest) -> ApiError:
    """A grammar's error names the OpenAI field it came from (response_format, tool_choice)."""
    if error.param in GUIDED_KEYS and api.grammar_param is not None:
        return replace(error, param=api.grammar_param)
    return error


async def _next(chunks: AsyncIterator[Chunk]) -> Chunk | None:
    """The next chunk, None at the end; a failed generation raises ApiError."""
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return None
    except GenerationError as exc:
        raise from_generation_error(exc.code, exc.message) from None


async def _read_json(request: web.Request, limit: int) -> object:
    """The request body as JSON; too big, not JSON, or not Unicode text: an ApiError."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"the request body is over {limit} bytes") from None
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        message = "the request holds text that is not valid Unicode (a lone surrogate?)"
        raise invalid(message) from None
    return body


def _internal(exc: Exception) -> ApiError:
    message = f"{INTERNAL.prefix}: the bridge failed ({type(exc).__name__}); see its log"
    return ApiError(500, message, "server_error", None, INTERNAL.code)


def _shutting_down() -> ApiError:
    message = f"{UNAVAILABLE.prefix}: the server is shutting down; retry shortly"
    return ApiError(503, message, "server_error", None, UNAVAILABLE.code, 1)


async def _write_quietly(response: web.StreamResponse, data: bytes) -> None:
    """Write the end of a stream; a client already gone is not an error."""
    with contextlib.suppress(ConnectionError):
        await response.write(data)
        await response.write_eof()
