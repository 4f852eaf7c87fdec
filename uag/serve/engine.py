"""One generation at a time from a bounded FIFO queue, on a thread of its own: what a CPU box
can serve without two generations fighting over its cores.

A request becomes a ``Job``; the engine's thread runs it through ``uag.generate`` (the same
call, plan and defaults as the library and ``uag generate``) and hands what it produces back
to the request's event loop as ``Text``, ``Done`` or ``Failed`` events. A job halts at the next
round when its client leaves, a stop string appears, or the server shuts down.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from uag import api
from uag.decoding.plan import Plan
from uag.decoding.sampling import SamplingConfig
from uag.errors import UagError
from uag.serve.metrics import Metrics
from uag.serve.protocol import ApiError, FinishReason, Usage


@dataclass(frozen=True)
class Text:
    """Text the client may be sent now (held back while it could start a stop string)."""

    text: str


@dataclass(frozen=True)
class Done:
    text: str
    """The whole completion: ``uag generate``'s text, cut before a stop string if one came."""
    finish: FinishReason
    usage: Usage


@dataclass(frozen=True)
class Failed:
    error: ApiError


Event = Text | Done | Failed


class StopCut:
    """Cuts generated text at the first of ``stops``, and says how much of it is safe to send:
    everything but the longest tail that could still grow into a stop string."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.text = ""
        self.sent = 0
        self.matched = False

    def feed(self, piece: str) -> str:
        """Add ``piece``; return the text that may be sent now (sets ``matched`` at a stop)."""
        self.text += piece
        hits = [i for s in self.stops if (i := self.text.find(s, self.sent)) >= 0]
        if hits:
            self.text, self.matched = self.text[: min(hits)], True
            return self._send(len(self.text))
        hold = max(
            (k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])),
            default=0,
        )
        return self._send(len(self.text) - hold)

    def flush(self) -> str:
        """The held-back tail, once no more text comes."""
        return self._send(len(self.text))

    def _send(self, upto: int) -> str:
        out = self.text[self.sent : max(upto, self.sent)]
        self.sent = max(upto, self.sent)
        return out


@dataclass(kw_only=True)
class Job:
    """One request's generation: what to run and where its events go."""

    prompt: str
    """The text both models see (the chat template already applied)."""
    max_tokens: int
    sampling: SamplingConfig | None
    stops: tuple[str, ...] = ()
    endpoint: str = "completions"
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)

    def emit(self, event: Event) -> None:
        """From the engine's thread: queue ``event`` on the request's event loop."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self) -> None:
        """The client left: the job halts at its next round (or never starts)."""
        self.cancelled.set()


class QueueFull(Exception):
    pass


class Engine:
    """The prepared pair, its plans, and the one thread that generates with them."""

    def __init__(
        self,
        *,
        pair: api.Pair,
        plans: Callable[[bool], Plan | None],
        queue_size: int,
        metrics: Metrics,
    ) -> None:
        self.pair = pair
        self.plans = plans
        """The plan for greedy (False) or sampled (True) requests."""
        self.metrics = metrics
        self._jobs: queue.Queue[Job] = queue.Queue(maxsize=queue_size)
        self._closing = threading.Event()
        self._current: Job | None = None
        self._thread = threading.Thread(target=self._work, name="uag-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job``, or raise ``QueueFull`` (the queue holds ``queue_size`` waiting jobs
        besides the one running) or ``ApiError`` 503 once shutting down."""
        if self._closing.is_set():
            raise ApiError(503, "the server is shutting down", type="server_error")
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull from None
        self.metrics.queue_depth = self._jobs.qsize()

    def close(self) -> None:
        """Stop taking jobs; halt the one running at its next round and answer the waiting
        ones 503. Safe from a signal handler (it only sets flags and queues events)."""
        self._closing.set()
        current = self._current
        if current is not None:
            current.cancel()

    def join(self, timeout: float) -> None:
        self._closing.set()
        self._thread.join(timeout)

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=0.1)
            except queue.Empty:
                if self._closing.is_set():
                    return
                continue
            self.metrics.queue_depth = self._jobs.qsize()
            if self._closing.is_set():
                job.emit(Failed(ApiError(503, "the server is shutting down", type="server_error")))
                continue
            if job.cancelled.is_set():
                continue  # its client left while it waited
            self._current = job
            try:
                self._run(job)
            finally:
                self._current = None

    def _run(self, job: Job) -> None:
        cut = StopCut(job.stops)
        first: list[float] = []

        def on_text(piece: str) -> bool:
            if not first:
                first.append(time.perf_counter())
            out = cut.feed(piece)
            if out:
                job.emit(Text(out))
            return cut.matched or job.cancelled.is_set() or self._closing.is_set()

        try:
            result = api.generate(
                self.pair,
                job.prompt,
                plan=self.plans(job.sampling is not None),
                max_new_tokens=job.max_tokens,
                on_text=on_text,
                sampling=job.sampling,
            )
        except UagError as err:
            code = "context_length_exceeded" if "context" in str(err) else None
            job.emit(Failed(ApiError(400, str(err), code=code)))
            self.metrics.failed(job.endpoint)
            return
        except Exception as exc:  # a bug: say so on the server's stderr, answer 500
            traceback.print_exc(file=sys.stderr)
            first_line = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
            job.emit(Failed(ApiError(500, f"generation failed: {first_line}", type="server_error")))
            self.metrics.failed(job.endpoint)
            return
        rest = cut.flush()
        if rest:
            job.emit(Text(rest))
        # The whole text is uag generate's own (its decode) unless a stop string cut it.
        text = cut.text if cut.matched else result.text
        finish: FinishReason = "length" if result.stop_reason == "max_new_tokens" else "stop"
        usage = Usage(prompt_tokens=result.prompt_tokens, completion_tokens=result.new_tokens)
        job.emit(Done(text=text, finish=finish, usage=usage))
        self.metrics.finished(
            job.endpoint,
            result=result,
            first_token_s=(first[0] - job.submitted) if first else None,
        )

    @property
    def depth(self) -> int:
        """Requests waiting."""
        return self._jobs.qsize()

    @property
    def busy(self) -> bool:
        """A request is generating now."""
        return self._current is not None
