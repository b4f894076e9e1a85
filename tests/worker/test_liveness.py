"""Liveness of the engine loop: the verdict over a pulse (fake clock), and the pulse
the real engine thread gives (idle beats, step failures counted in a row, the stall hook)."""
from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from worker.engine.async_engine import AsyncEngine
from worker.engine.engine import Engine, EngineConfig
from worker.engine.request import prompt_input
from worker.engine.sampling import SamplingParams
from worker.server.liveness import EnginePulse, Liveness, watch


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_verdict_timeout_failures_and_stickiness() -> None:
    clock = Clock()
    liveness = Liveness(timeout_s=10.0, max_step_failures=3, clock=clock)
    assert liveness.check() is None                       # loading: no pulse yet, live
    clock.now += 1000
    assert liveness.check() is None
    pulse = EnginePulse(clock)
    liveness.attach(pulse)
    clock.now += 10.0
    assert liveness.check() is None                       # exactly the timeout: still live
    pulse.beat()
    for _ in range(2):
        pulse.step_failed(RuntimeError("CUDA error: an illegal memory access"))
    pulse.step_ok()                                       # a good step resets the count
    pulse.step_failed(RuntimeError("x"))
    pulse.step_failed(RuntimeError("x"))
    assert pulse.step_failures == 2 and liveness.check() is None
    pulse.step_failed(RuntimeError("CUDA error: sticky"))
    reason = liveness.check()
    assert reason is not None and "3 engine steps in a row" in reason and "CUDA error: sticky" in reason
    pulse.step_ok()
    pulse.beat()
    assert liveness.check() == reason                     # not recoverable in-process


def test_verdict_stall_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    liveness = Liveness(timeout_s=2.0, max_step_failures=3, clock=clock, worker_id="w-9")
    pulse = EnginePulse(clock)
    liveness.attach(pulse)
    clock.now += 2.5
    with caplog.at_level(logging.ERROR, logger="kvmesh.worker"):
        reason = liveness.check()
        assert reason is not None and "not made progress for 2.5 s" in reason and "--liveness-timeout-s 2" in reason
        pulse.beat()
        clock.now += 10
        assert all(liveness.check() == reason for _ in range(3))
    assert [r.getMessage() for r in caplog.records] == [
        f"WORKER w-9 IS NOT LIVE: {reason}. Liveness and readiness are NOT_SERVING for good, it leaves the "
        "registry and refuses engine calls; restart it (the kubelet does)."]


@pytest.mark.parametrize(("timeout_s", "failures", "match"), [(0.0, 3, "liveness_timeout_s"),
                                                              (1.0, 0, "max_step_failures"),
                                                              (1.0, True, "max_step_failures")])
def test_bad_settings(timeout_s: float, failures: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Liveness(timeout_s, failures)


def test_watch_returns_the_reason() -> None:
    clock = Clock()
    liveness = Liveness(timeout_s=1.0, max_step_failures=1, clock=clock)
    liveness.attach(pulse := EnginePulse(clock))

    async def run() -> str:
        task = asyncio.create_task(watch(liveness, period_s=0.01))
        await asyncio.sleep(0.05)
        assert not task.done()
        pulse.step_failed(ValueError("boom"))
        return await asyncio.wait_for(task, 2)
    assert "ValueError: boom" in asyncio.run(run())


# -- the engine thread's pulse ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir: Any) -> Engine:
    return Engine(EngineConfig(model=str(tiny_model_dir("llama-gqa")), block_size=4, num_blocks=256))


def wait_for(pred: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_idle_engine_beats(tiny_engine: Engine) -> None:
    ae = AsyncEngine(tiny_engine)
    try:
        t0 = time.monotonic()
        wait_for(lambda: ae.pulse.last_beat > t0 + 1.0, timeout=5)   # idle ticks are 0.5 s apart
        assert time.monotonic() - ae.pulse.last_beat < 1.0
    finally:
        ae.shutdown()


def test_failing_steps_are_counted_in_a_row(tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    real_step = tiny_engine.step
    failing = [True]

    def step() -> Any:
        if failing[0]:
            raise RuntimeError("CUDA error: device-side assert triggered")
        return real_step()
    monkeypatch.setattr(tiny_engine, "step", step)
    ae = AsyncEngine(tiny_engine)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    async def one(rid: str) -> list[int]:
        outs = [o async for o in ae.generate(prompt_input([5, 6, 7], params, rid))]
        return [t for out in outs for t in out.new_token_ids]
    try:
        for i in range(3):
            with pytest.raises(RuntimeError, match="device-side assert"):
                asyncio.run(one(f"f{i}"))
            assert ae.pulse.step_failures == i + 1
        failing[0] = False
        assert len(asyncio.run(one("ok"))) == 3                      # the loop carried on
        assert ae.pulse.step_failures == 0
        assert not tiny_engine.has_unfinished() and tiny_engine.store.pool.num_used_blocks == 0
    finally:
        ae.shutdown()


def test_stall_file_blocks_the_loop_until_removed(tiny_engine: Engine, tmp_path: Path) -> None:
    stall = tmp_path / "stall"
    ae = AsyncEngine(tiny_engine, stall_file=stall)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    async def one() -> int:
        return len([t async for o in ae.generate(prompt_input([9, 8, 7], params, "s")) for t in o.new_token_ids])
    try:
        stall.touch()
        time.sleep(0.7)                      # the loop reaches the hook (an idle tick is 0.5 s)
        beat = ae.pulse.last_beat
        time.sleep(0.5)
        assert ae.pulse.last_beat == beat    # stalled: no beats
        stall.unlink()
        wait_for(lambda: ae.pulse.last_beat > beat, timeout=3)
        assert asyncio.run(one()) == 2
    finally:
        ae.shutdown()


def test_a_load_snapshot_does_not_wait_out_a_long_step(tiny_engine: Engine, tmp_path: Path) -> None:
    """GetLoad's `snapshot`: the engine's own answer while it answers; while the thread is
    held mid-loop (a long prefill, here the stall hook), the figures of its last step after
    `wait_s` — a router probing a busy worker must not take it for a dead one."""
    stall = tmp_path / "stall"
    ae = AsyncEngine(tiny_engine, stall_file=stall)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    async def run() -> None:
        [o async for o in ae.generate(prompt_input([9, 8, 7, 6], params, "s"))]
        fresh = await ae.snapshot(wait_s=5.0)                 # answered by the engine thread
        assert fresh.num_running == 0 and fresh.num_used_blocks == 0
        stall.touch()
        await asyncio.sleep(0.7)                             # the loop reaches the hook
        t = time.perf_counter()
        held = await ae.snapshot(wait_s=0.3)
        assert time.perf_counter() - t < 2.0
        assert held == fresh                                  # the last recorded figures
        stall.unlink()
        assert (await ae.snapshot(wait_s=5.0)) == fresh       # and the engine answers again
    try:
        asyncio.run(run())
    finally:
        stall.unlink(missing_ok=True)
        ae.shutdown()


def test_a_peer_read_of_cached_blocks_does_not_wait_out_a_long_step(tiny_engine: Engine, tmp_path: Path) -> None:
    """`read_blocks` (a peer's SendBlocks) copies cached blocks while the engine thread is held
    mid-loop (a long prefill, here the stall hook), where the `ReadBlocks` command waits."""
    import torch

    from kvstore.keys import block_hashes
    from worker.engine.commands import ReadBlocks
    stall = tmp_path / "stall"
    ae = AsyncEngine(tiny_engine, stall_file=stall)
    prompt = list(range(60, 77))                           # 4 full blocks + 1 token
    hashes = tuple(block_hashes(prompt, 4, tiny_engine.salt))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    async def run() -> None:
        [o async for o in ae.generate(prompt_input(prompt, params, "p"))]
        between = await ae.run(ReadBlocks(hashes, torch.device("cpu")))
        stall.touch()
        await asyncio.sleep(0.7)                             # the loop reaches the hook
        t = time.perf_counter()
        beside = await asyncio.wait_for(ae.read_blocks(hashes, torch.device("cpu")), 2.0)
        assert time.perf_counter() - t < 2.0
        assert beside.num_blocks == between.num_blocks == 4 and torch.equal(beside.blocks, between.blocks)
        waiting = asyncio.ensure_future(ae.run(ReadBlocks(hashes, torch.device("cpu"))))
        await asyncio.sleep(0.3)
        assert not waiting.done()                            # the command waits for the thread
        stall.unlink()
        assert (await asyncio.wait_for(waiting, 5.0)).num_blocks == 4
    try:
        asyncio.run(run())
    finally:
        stall.unlink(missing_ok=True)
        ae.shutdown()
