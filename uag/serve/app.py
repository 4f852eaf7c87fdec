"""``uag serve``'s HTTP side: an OpenAI-compatible ASGI app (FastAPI, served by uvicorn) over one
``Engine``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the target's own chat template),
``GET /v1/models``, ``GET /health``, ``GET /metrics``. Every answer that is not a success is
OpenAI's error shape with its status: 400 a bad request, 401 a wrong or missing key, 404 an
unknown model or route, 413 a body over the limit, 429 a full queue, 503 while shutting down.
``temperature`` 0 is greedy (lossless: the target's own text); left out, the target's own
generation defaults sample, as ``uag generate --sample`` does.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from uag import api
from uag.errors import UagError
from uag.serve.config import ServeConfig
from uag.serve.engine import Done, Engine, Event, Failed, Job, QueueFull, Text
from uag.serve.protocol import ApiError, ChatRequest, CompletionRequest, Shape

COMPLETION_DEFAULT_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions``."""
R = TypeVar("R", bound=BaseModel)
DISCONNECT_POLL_S = 0.5
"""How often a waiting request checks that its client is still there."""


@dataclass(frozen=True)
class Served:
    """What every request is answered from: the engine, the model's name, the limits."""

    engine: Engine
    model_id: str
    config: ServeConfig


def create_app(*, engine: Engine, model_id: str, config: ServeConfig) -> FastAPI:
    """The ASGI app serving ``engine``'s pair under the name ``model_id``."""
    app = FastAPI(title="uag", docs_url=None, redoc_url=None, openapi_url=None)
    served = Served(engine, model_id, config)
    started = int(time.time())

    @app.exception_handler(ApiError)
    async def api_error(_: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        body = ApiError(err.status_code, str(err.detail), type=kind).body()
        return JSONResponse(body, status_code=err.status_code)

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Any:
        """The key on every route but /health; the body limit before anything is read."""
        if config.api_key is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
                err = ApiError(401, "invalid or missing API key", type="authentication_error")
                return JSONResponse(
                    err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"}
                )
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_body:
            err = ApiError(413, f"request body over {config.max_body} bytes", code="body_too_large")
            return JSONResponse(err.body(), status_code=413)
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_id, "queue": engine.depth}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(model_id, started)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        _check_model(name, model_id)
        return _model_card(model_id, started)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = engine.metrics.render(in_flight=int(engine.busy))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        req = await _parse(request, CompletionRequest, config)
        prompt = _uag(lambda: api.check_prompt(req.prompt))
        return await _answer(request, req, prompt, chat=False, served=served)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        req = await _parse(request, ChatRequest, config)
        prompt = _uag(lambda: api.render_chat(engine.pair, req.conversation()))
        return await _answer(request, req, prompt, chat=True, served=served)

    return app


def _model_card(model_id: str, created: int) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "uag"}


def _check_model(name: str, model_id: str) -> None:
    if name != model_id:
        raise ApiError(
            404,
            f"model {name!r} does not exist: this server serves {model_id!r}",
            type="not_found_error",
            code="model_not_found",
            param="model",
        )


def _uag(call: Any) -> Any:
    """``call()``, its ``UagError`` (bad input, said in one line) answered 400."""
    try:
        return call()
    except UagError as err:
        raise ApiError(400, str(err)) from None


async def _parse(request: Request, kind: type[R], config: ServeConfig) -> R:
    body = await request.body()
    if len(body) > config.max_body:  # a chunked body has no content-length to check first
        raise ApiError(413, f"request body over {config.max_body} bytes", code="body_too_large")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the body is not valid JSON: {err}") from None
    try:
        return kind.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        message = (
            f"unrecognized request argument: {where}"
            if first["type"] == "extra_forbidden"
            else f"{where}: {first['msg']}"
        )
        raise ApiError(400, message, param=where) from None


async def _answer(
    request: Request,
    req: CompletionRequest | ChatRequest,
    prompt: str,
    *,
    chat: bool,
    served: Served,
) -> Any:
    """Queue the request's job and answer it: one JSON body, or a stream of chunks."""
    job = _job(req, prompt, chat=chat, served=served)
    try:
        served.engine.submit(job)
    except QueueFull:
        raise ApiError(
            429,
            f"the queue is full ({served.config.queue} requests waiting): retry later",
            type="server_busy",
            code="queue_full",
        ) from None
    first = await _next(job, request)
    if isinstance(first, Failed):
        raise first.error
    shape = Shape.new(chat=chat, model=served.model_id)
    if req.stream:
        return StreamingResponse(
            _chunks(first, job, shape, usage=req.include_usage()), media_type="text/event-stream"
        )
    event: Event = first
    while not isinstance(event, Done):
        if isinstance(event, Failed):
            raise event.error
        event = await _next(job, request)
    return shape.whole(event.text, event.finish, event.usage)


def _job(req: CompletionRequest | ChatRequest, prompt: str, *, chat: bool, served: Served) -> Job:
    """The request's generation, checked: model, fields uag does not do, budget, sampling."""
    config = served.config
    _check_model(req.model, served.model_id)
    why = req.unsupported()
    if why is not None:
        raise ApiError(400, why)
    try:
        stops = req.stops()
    except ValueError as err:
        raise ApiError(400, str(err), param="stop") from None
    asked = req.max_tokens or (req.max_completion_tokens if isinstance(req, ChatRequest) else None)
    max_tokens = asked or (config.max_tokens if chat else COMPLETION_DEFAULT_TOKENS)
    if max_tokens > config.max_tokens:
        raise ApiError(
            400,
            f"max_tokens {max_tokens} is over this server's limit of {config.max_tokens} "
            "(uag serve --max-tokens)",
            param="max_tokens",
        )
    sampling = None
    if req.temperature != 0:  # None: the target's own defaults, as uag generate --sample
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        sampling = served.engine.pair.sampling(
            temperature=req.temperature, top_p=req.top_p, seed=seed
        )
    return Job(
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=sampling,
        stops=stops,
        endpoint="chat" if chat else "completions",
        loop=asyncio.get_running_loop(),
    )


async def _next(job: Job, request: Request) -> Event:
    """The job's next event; a client that leaves meanwhile cancels the job."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                job.cancel()
                raise ApiError(499, "the client closed the request") from None


async def _chunks(first: Event, job: Job, shape: Shape, *, usage: bool) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending with ``[DONE]``. Starlette stops
    iterating when the client leaves: the ``finally`` then cancels the job."""
    try:
        if shape.chat:
            yield _sse(shape.chunk("", first=True))
        event = first
        while True:
            if isinstance(event, Text):
                yield _sse(shape.chunk(event.text))
            elif isinstance(event, Done):
                yield _sse(shape.chunk(None, event.finish))
                if usage:
                    yield _sse(shape.usage_chunk(event.usage))
                break
            else:
                yield _sse(event.error.body())
                break
            event = await job.events.get()
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class _Server(uvicorn.Server):
    """uvicorn's server, telling the engine first when a signal asks it to stop: the
    generation in flight halts at its next round and waiting requests are answered 503."""

    def __init__(self, config: uvicorn.Config, engine: Engine) -> None:
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.engine.close()
        super().handle_exit(sig, frame)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``, or a one-line ``UagError`` (port taken, bad host)."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
    except OSError as err:
        raise UagError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    sock.set_inheritable(True)
    return sock


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def run(*, engine: Engine, model_id: str, config: ServeConfig, sock: socket.socket) -> int:
    """Serve until SIGTERM or Ctrl-C: then stop taking requests, halt the one in flight at its
    next round, and return 0."""
    app = create_app(engine=engine, model_id=model_id, config=config)
    server = _Server(
        uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, lifespan="off"),
        engine,
    )
    # uvicorn re-raises the signal that stopped it once it has shut down; these handlers take
    # it, so a graceful stop exits 0 (and a traceback-free KeyboardInterrupt never happens).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    host, port = sock.getsockname()[:2]
    print(
        f"uag serve: {model_id} on http://{host}:{port}/v1 (OpenAI-compatible; Ctrl-C stops)",
        file=sys.stderr,
        flush=True,
    )
    server.run(sockets=[sock])
    engine.join(timeout=10)
    return 0
