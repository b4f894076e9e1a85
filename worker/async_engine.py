"""Drive one `Engine` from asyncio: a dedicated thread runs `step()`, callers await outputs.

The engine is single-threaded; every mutation (add, abort) is queued to the engine thread
and applied between steps, so requests from any number of coroutines never race it.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from worker.engine import Engine, Prompt
from worker.request import InvalidRequest, QueueFull, RequestOutput
from worker.sampling import SamplingParams

log = logging.getLogger("kvmesh.engine")


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    """Owns the engine thread. `generate` validates synchronously (raising InvalidRequest /
    QueueFull before anything is queued) and then yields the request's outputs."""

    def __init__(self, engine: Engine, after_step: Callable[[], None] | None = None) -> None:
        """`after_step` runs on the engine thread after every step and every idle tick
        (~50 ms): the place to publish the pool's KV events in step with the engine."""
        self.engine = engine
        self._after_step = after_step
        self._idle_tick = 0.05 if after_step is not None else 0.5
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvmesh-engine", daemon=True)
        self._thread.start()

    # -- public, called from the event loop -----------------------------------------------
    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str,
                       priority: int = 0,
                       before_add: Callable[[], None] | None = None) -> AsyncIterator[RequestOutput]:
        """`before_add` runs on the engine thread right before the request is added, with no
        step in between (the peer plane stores fetched blocks in the host tier there)."""
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        finished = False
        try:
            await self.call(lambda: self._add(prompt, params, request_id, priority, stream, before_add))
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        except (InvalidRequest, QueueFull):
            finished = True          # nothing was queued
            raise
        finally:
            if not finished:
                # Cancelled, deadline passed, or the consumer stopped early. Commands run in
                # order on the engine thread, so this abort lands after the add even when the
                # caller was cancelled while the add was still queued: the blocks are freed.
                self.submit(lambda: self._abort(request_id, stream))

    async def abort(self, request_id: str) -> bool:
        return await self.call(lambda: self._abort(request_id))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between steps; return its result (or raise its error)."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        loop = fut.get_loop()

        def run() -> None:
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                loop.call_soon_threadsafe(_set_result, fut, result)
        self.submit(run)
        return await fut

    def submit(self, fn: Callable[[], None]) -> None:
        self._commands.put(fn)
        self._wake.set()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # -- engine thread --------------------------------------------------------------------
    def _add(self, prompt: Prompt, params: SamplingParams, request_id: str, priority: int,
             stream: _Stream, before_add: Callable[[], None] | None = None) -> None:
        if request_id in self._streams:
            raise InvalidRequest(f"request_id {request_id!r} is already running")
        if before_add is not None:
            before_add()
        self.engine.add_request(prompt, params, request_id=request_id, priority=priority)
        self._streams[request_id] = stream

    def _abort(self, request_id: str, stream: _Stream | None = None) -> bool:
        if stream is not None and self._streams.get(request_id) is not stream:
            return False             # that request already ended; the id may be reused now
        out = self.engine.abort(request_id)
        self._deliver([out] if out is not None else [])
        return out is not None

    def _deliver(self, outputs: Sequence[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _loop(self) -> None:
        while not self._stop.is_set():
            while True:
                try:
                    self._commands.get_nowait()()
                except queue.Empty:
                    break
            if self.engine.has_unfinished():
                try:
                    self._deliver(self.engine.step())
                except Exception as e:  # noqa: BLE001 - a bug in a step must not hang every client
                    self._fail_all(e)
            else:
                self._wake.wait(timeout=self._idle_tick)
                self._wake.clear()
            if self._after_step is not None:
                try:
                    self._after_step()
                except Exception:  # noqa: BLE001 - metadata trouble must not stop serving
                    log.exception("after_step hook failed")

    def _fail_all(self, error: Exception) -> None:
        for rid, stream in list(self._streams.items()):
            self.engine.abort(rid)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
        self._streams.clear()


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)
