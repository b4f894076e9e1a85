"""Drive one `Engine` from asyncio: a dedicated thread runs `step()`, callers await outputs.

The engine is single-threaded. Everything else reaches it through the closed set of typed
commands of `worker.engine.commands`, queued to the engine thread and applied between steps in the
order sent (`AsyncEngine.run`, dispatched by `_apply`), so requests from any number of
coroutines never race it and no step runs while a command reads the KV store. One read is
the exception: a peer's copy of cached blocks (`read_blocks`) runs beside a step on a CPU pool
and is checked afterwards (`KVStore.read_now`), falling back to the `ReadBlocks` command; and
a peer fetch's count of the blocks held here (`count_held`) is a query answered at once.

A load snapshot (`snapshot`, the worker's GetLoad) does not wait out a long step: it is a
`Snapshot` command like any other when the engine answers within `wait_s`, else the figures
the thread recorded after its last step (a CPU prefill of a few thousand tokens runs for
seconds, and a router probing a busy worker must not take it for a dead one).

The thread reports its progress on an `EnginePulse` (worker/server/liveness.py): a beat on every loop
iteration (idle waits included) and the count of steps that raised in a row. A step that raises
fails the requests it was running and the loop carries on; the worker's liveness check decides
when too many in a row mean a broken device.

Test hook (tests only): `stall_file` (the worker's env `KVMESH_TEST_STALL_FILE`, read once by
`kvmesh worker` at start): while that file exists the engine thread blocks at the top of its
loop, neither beating nor stepping nor applying commands, like a hung device; it resumes when
the file is removed. Unset, it costs nothing.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from contracts.requests import GenerateInput
from worker.engine.commands import (
    AbortRequest,
    AddRequest,
    ApplyChatTemplate,
    Command,
    CountHeld,
    HottestBlocks,
    ListRequests,
    ReadBlocks,
    ResetPrefixCache,
    Snapshot,
    StageBlocks,
    Tokenize,
)
from worker.engine.config import EngineStats
from worker.engine.engine import Engine
from worker.engine.request import InvalidRequest, QueueFull, RequestOutput
from worker.server.liveness import EnginePulse

if TYPE_CHECKING:
    import torch

    from kvstore.keys import BlockHash
    from kvstore.store_types import HeldBlocks

log = logging.getLogger("kvmesh.engine")

R = TypeVar("R")


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


@dataclass(frozen=True, slots=True)
class _Open(Command[None]):
    """`AddRequest` with the stream its outputs go to."""

    add: AddRequest
    stream: _Stream


@dataclass(frozen=True, slots=True)
class _Cancel(Command[bool]):
    """Abort `request_id` if it is still the request of `stream` (its consumer went away)."""

    request_id: str
    stream: _Stream


Reply = Callable[[Any, BaseException | None], None]


class AsyncEngine:
    """Owns the engine thread. `generate` validates synchronously (raising InvalidRequest /
    QueueFull before anything is queued) and then yields the request's outputs."""

    def __init__(self, engine: Engine, after_step: Callable[[], None] | None = None,
                 pulse: EnginePulse | None = None, stall_file: str | Path | None = None) -> None:
        """`after_step` runs on the engine thread after every step, once each step is scheduled
        (`Engine.after_schedule`), and every idle tick (~50 ms): the place to publish the KV
        store's events in step with the engine.
        `pulse` (default a new one) is where the thread reports its progress; `stall_file`
        is the test hook of the module docstring."""
        self.engine = engine
        self._after_step = after_step
        if after_step is not None:   # and once each step is scheduled, before its forward pass
            engine.after_schedule = self._run_after_step
        self.pulse = pulse if pulse is not None else EnginePulse()
        self._stall_file = Path(stall_file) if stall_file is not None else None
        self._idle_tick = 0.05 if after_step is not None else 0.5
        self._commands: queue.SimpleQueue[tuple[Command[Any], Reply | None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._latest: EngineStats | None = None   # the figures after the last step or Snapshot
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvmesh-engine", daemon=True)
        self._thread.start()

    # -- public, called from the event loop -----------------------------------------------
    async def generate(self, spec: GenerateInput, staged: StageBlocks | None = None) -> AsyncIterator[RequestOutput]:
        """Send `AddRequest(spec, staged)` and yield the request's outputs until it finishes.
        `spec.request_id` names the stream: it must be set (InvalidRequest)."""
        request_id = spec.request_id
        if not request_id:
            raise InvalidRequest("request_id: empty (the outputs stream by request id)")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        finished = False
        try:
            await self.run(_Open(AddRequest(spec, staged), stream))
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished and item.group_finished:
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
                self._post(_Cancel(request_id, stream), None)

    async def abort(self, request_id: str) -> bool:
        return await self.run(AbortRequest(request_id))

    async def run(self, command: Command[R]) -> R:
        """Apply `command` on the engine thread between steps; its result (or its error)."""
        fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        loop = fut.get_loop()

        def reply(result: Any, error: BaseException | None) -> None:
            if error is not None:
                loop.call_soon_threadsafe(_set_exception, fut, error)
            else:
                loop.call_soon_threadsafe(_set_result, fut, result)
        self._post(command, reply)
        return await fut

    def count_held(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading `hashes` the KV store holds (device, host or disk), answered now,
        beside a running step: `KVStore.lookup` is a query that references and reorders nothing.
        A peer fetch plans with it; the `CountHeld` command (the same count, between steps) would
        wait for the end of the running step, a whole prefill on a busy CPU worker. The count may
        be one step stale: admission looks the blocks up again, so a block evicted since is
        recomputed."""
        return self.engine.store.lookup(tuple(hashes)).num_blocks

    async def read_blocks(self, hashes: Sequence[BlockHash], device: torch.device) -> HeldBlocks:
        """A copy of the leading run of `hashes` held here (a peer's `SendBlocks`): read at
        once beside a running step where the store can check the copy (`KVStore.read_now`, a
        CPU pool), else the `ReadBlocks` command between steps. A peer's fetch then waits for
        the copy only, not for the end of this worker's step (a long prefill's, seconds on a CPU)."""
        held = await asyncio.to_thread(self.engine.store.read_now, tuple(hashes), device)
        if held is not None:
            return held
        return await self.run(ReadBlocks(tuple(hashes), device))

    async def snapshot(self, wait_s: float) -> EngineStats:
        """The engine's figures now (`Snapshot`) if it answers within `wait_s`; else, while a
        step runs on, those recorded after the last one (none yet: it waits for the step)."""
        now = asyncio.ensure_future(self.run(Snapshot()))
        try:
            return await asyncio.wait_for(asyncio.shield(now), wait_s)
        except TimeoutError:
            latest = self._latest
            return latest if latest is not None else await now

    def _post(self, command: Command[Any], reply: Reply | None) -> None:
        if not isinstance(command, Command):
            raise TypeError(f"not an engine command: {command!r}")
        self._commands.put((command, reply))
        self._wake.set()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine thread; wait up to `timeout_s` for it (a hung one is left behind:
        it is a daemon thread)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=timeout_s)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # -- engine thread --------------------------------------------------------------------
    def _apply(self, command: Command[Any]) -> Any:
        """The dispatch: one case per command type."""
        engine = self.engine
        match command:
            case _Open(add, stream):
                return self._add(add, stream)
            case _Cancel(request_id, stream):
                return self._abort(request_id, stream)
            case AddRequest():
                raise TypeError("AddRequest streams outputs: send it with AsyncEngine.generate")
            case AbortRequest(request_id):
                return self._abort(request_id)
            case Tokenize(text):
                return engine.encode(text)
            case ApplyChatTemplate(messages):
                return engine.apply_chat_template([{"role": r, "content": c} for r, c in messages])
            case CountHeld(hashes):
                return self.count_held(hashes)
            case ReadBlocks(hashes, device):
                return engine.store.read(hashes, device)
            case HottestBlocks(max_blocks):
                return tuple(engine.store.hottest(max_blocks))
            case StageBlocks(hashes, data):
                return engine.store.stage(hashes, data)
            case Snapshot():
                self._latest = engine.stats()
                return self._latest
            case ListRequests():
                return tuple(engine.requests)
            case ResetPrefixCache():
                return engine.store.reset_prefix_cache()
        raise TypeError(f"unknown engine command {type(command).__name__}")

    def _run_command(self, command: Command[Any], reply: Reply | None) -> None:
        try:
            result = self._apply(command)
        except Exception as e:  # noqa: BLE001 - handed to the awaiting coroutine
            if reply is None:
                log.exception("engine command %s failed", type(command).__name__)
            else:
                reply(None, e)
        else:
            if reply is not None:
                reply(result, None)

    def _add(self, add: AddRequest, stream: _Stream) -> None:
        request_id = add.spec.request_id
        if request_id in self._streams:
            raise InvalidRequest(f"request_id {request_id!r} is already running")
        if add.staged is not None:
            self.engine.store.stage(add.staged.block_hashes, add.staged.data)
        self.engine.add_request(add.spec)
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
            if out.finished and out.group_finished:
                del self._streams[out.request_id]
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _loop(self) -> None:
        pulse, stall_file = self.pulse, self._stall_file
        while not self._stop.is_set():
            if stall_file is not None:
                self._stall_while(stall_file)
            pulse.beat()
            while True:
                try:
                    self._run_command(*self._commands.get_nowait())
                except queue.Empty:
                    break
            if self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()
                except Exception as e:  # noqa: BLE001 - a bug in a step must not hang every client
                    pulse.step_failed(e)
                    log.error("engine step failed (%d in a row): %s: %s", pulse.step_failures, type(e).__name__, e)
                    self._fail_all(e)
                else:
                    pulse.step_ok()
                    self._latest = self.engine.stats()   # before the outputs: a client that
                    self._deliver(outputs)                # saw them finds them counted
            else:
                self._wake.wait(timeout=self._idle_tick)
                self._wake.clear()
            self._run_after_step()

    def _run_after_step(self) -> None:
        if self._after_step is not None:
            try:
                self._after_step()
            except Exception:  # noqa: BLE001 - metadata trouble must not stop serving
                log.exception("after_step hook failed")

    def _stall_while(self, path: Path) -> None:
        """The test hook: block while `path` exists (or until shutdown), without beating."""
        if not path.exists():
            return
        log.warning("engine thread stalled on purpose while %s exists (test hook)", path)
        while path.exists() and not self._stop.is_set():
            time.sleep(0.05)
        log.warning("engine thread resumed: %s is gone", path)

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
