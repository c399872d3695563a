"""Asyncio front end: the engine's step loop on its own thread, one asyncio stream per request.

The loop thread is the only one that touches the `LLMEngine`. Callers hand it new requests and
aborts through lists guarded by one condition; it takes them at each step boundary, steps, and
pushes each `RequestOutput` to its request's queue, one `loop.call_soon_threadsafe` per event
loop a step. With no work it sleeps on the condition.

A consumer that stops iterating (breaks out, is cancelled, times out, or its event loop closes)
aborts its request, whose blocks are freed at the next step boundary. A failure while serving
one request ends that request with finish reason "error" (the engine retries a failed batch
request by request); a crash of the loop itself raises `EngineDeadError` in every open stream.

    engine = AsyncLLMEngine(llm.engine)
    async with contextlib.aclosing(engine.generate(ids, params)) as stream:
        async for out in stream:
            print(out.text, end="")
    engine.shutdown()
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncGenerator, Sequence
from typing import NamedTuple

import torch

from localllm.config import SamplingParams
from localllm.engine.engine import LLMEngine, RequestOutput
from localllm.engine.metrics import EngineSnapshot, engine_snapshot
from localllm.errors import LocalLLMError, RequestError

log = logging.getLogger("localllm")

_ids = itertools.count()

StreamItem = RequestOutput | BaseException


class EngineDeadError(LocalLLMError):
    """The engine loop has stopped (shut down or crashed); it serves no more requests."""


class _Stream(NamedTuple):
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[StreamItem]

    def put(self, item: StreamItem) -> bool:
        """Thread-safe; False when the consumer's event loop is closed."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            return False
        return True


def _deliver(items: list[tuple[_Stream, RequestOutput]]) -> None:
    # on the consumers' event loop
    for stream, out in items:
        stream.queue.put_nowait(out)


class _NewRequest(NamedTuple):
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


class AsyncLLMEngine:
    """`num_threads`: torch threads of the loop thread (default: what the caller has now).

    NOTE: with libgomp, a second thread that runs parallel torch ops while the first one's
    OpenMP team is alive runs them 2-3x slower (both teams fall back to sleeping instead of
    spinning). Callers that step through this engine should do their own torch work with one
    thread (`torch.set_num_threads(1)` before loading the model) and pass the wanted count
    here; `localllm chat` does.
    """

    def __init__(self, engine: LLMEngine, num_threads: int | None = None) -> None:
        self.engine = engine
        self.num_threads = num_threads or torch.get_num_threads()
        self._cond = threading.Condition()
        # NOTE: the four fields below are guarded by _cond.
        self._new: list[_NewRequest] = []
        self._aborts: list[str] = []
        self._streams: dict[str, _Stream] = {}
        self._stopping = False
        self._dead: str | None = None  # why the loop stopped
        self._thread: threading.Thread | None = None
        self._snapshot = engine_snapshot(engine)

    # ----------------------------------------------------------------- public interface
    def start(self) -> None:
        """Start the loop thread (generate() does this on first use)."""
        with self._cond:
            self._check_alive()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="localllm-engine",
                                                daemon=True)
                self._thread.start()

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Stream the outputs of one request; the last has `finished` set. An invalid request
        raises RequestError here; a dead engine raises EngineDeadError."""
        rid = request_id if request_id is not None else f"async-{next(_ids)}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self.start()
        with self._cond:
            self._check_alive()
            if rid in self._streams:
                raise RequestError(f"request id {rid!r} is already in use")
            self._streams[rid] = stream
            self._new.append(_NewRequest(rid, list(prompt_ids), params))
            self._cond.notify()
        done = False
        try:
            while not done:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                yield item
        finally:
            if not done:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request ends (reason "abort") at the next step boundary."""
        with self._cond:
            if any(n.request_id == request_id for n in self._new):
                self._new = [n for n in self._new if n.request_id != request_id]
                self._streams.pop(request_id, None)
                return
            self._aborts.append(request_id)
            self._cond.notify()

    def stats(self) -> EngineSnapshot:
        """The metrics as of the last step boundary; safe from any thread."""
        return self._snapshot

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, timeout: float | None = None) -> None:
        """Abort every open request (streams end with reason "abort"), stop and join the loop."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
            thread = self._thread
            if thread is None:
                self._dead = self._dead or "the engine was shut down"
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # ----------------------------------------------------------------- the loop thread
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")

    def _has_work(self) -> bool:
        return bool(self._stopping or self._new or self._aborts or self.engine.has_unfinished())

    def _loop(self) -> None:
        torch.set_num_threads(self.num_threads)
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(self._has_work)
                    if self._stopping:
                        break
                    new, self._new = self._new, []
                    aborts, self._aborts = self._aborts, []
                self._step(new, aborts)
            self._stop()
        except BaseException as e:  # every stream must hear of it
            log.exception("the engine loop crashed")
            self._fail(f"the engine loop crashed: {type(e).__name__}: {e}")

    def _step(self, new: list[_NewRequest], aborts: list[str]) -> None:
        for n in new:
            try:
                self.engine.add_request(n.prompt_ids, n.params, n.request_id)
            except Exception as e:  # RequestError, or a bug that concerns only this request
                self._close_stream(n.request_id, e)
        for rid in aborts:
            self.engine.abort(rid)
        outputs = self.engine.step()
        self._snapshot = engine_snapshot(self.engine)
        # one wake-up per event loop a step (8 streams took 8 of them, 0.25 ms a step)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        with self._cond:
            for out in outputs:
                stream = (self._streams.pop(out.request_id, None) if out.finished
                          else self._streams.get(out.request_id))
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the consumers' event loop is gone
                for _, out in items:
                    if not out.finished:
                        self.abort(out.request_id)

    def _close_stream(self, request_id: str, error: BaseException) -> None:
        with self._cond:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(error)

    def _stop(self) -> None:
        with self._cond:
            live = list(self._streams)
            new, self._new = self._new, []
        for n in new:
            self._close_stream(n.request_id, EngineDeadError("the engine was shut down"))
        for rid in live:
            self.engine.abort(rid)
        self._step([], [])  # applies the aborts; their final outputs reach the streams
        self._fail("the engine was shut down")

    def _fail(self, reason: str) -> None:
        with self._cond:
            self._dead = reason
            streams, self._streams = self._streams, {}
            self._new, self._aborts = [], []
        for stream in streams.values():
            stream.put(EngineDeadError(reason))
