"""AsyncEngine: concurrent streams equal the sync engine; cancellation frees blocks; typed
commands are dispatched to the engine thread."""
from __future__ import annotations

import asyncio

import pytest
import torch

from kvstore.keys import BlockHash, block_hashes
from kvstore.store_types import NoHostTier
from worker.engine.async_engine import AsyncEngine
from worker.engine.commands import AbortRequest, CountHeld, ListRequests, ReadBlocks, Snapshot, StageBlocks, Tokenize
from worker.engine.engine import Engine, EngineConfig
from worker.engine.request import InvalidRequest, prompt_input
from worker.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    return Engine(EngineConfig(model=str(tiny_model_dir("llama-gqa")), block_size=4, num_blocks=256,
                               check_integrity=True))


def test_concurrent_streams_match_sync_and_cancel_frees(tiny_engine):
    prompts = [[5 + i, 17, 33, 99, 4 + i, 250] * (i + 1) for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in tiny_engine.generate(prompts, params)]
    ae = AsyncEngine(tiny_engine)

    async def collect(i: int) -> tuple[int, ...]:
        toks: list[int] = []
        async for out in ae.generate(prompt_input(prompts[i], params, f"r{i}")):
            toks.extend(out.new_token_ids)
            assert tuple(toks) == out.token_ids
        return tuple(toks)

    async def cancelled() -> None:
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        agen = ae.generate(prompt_input(prompts[0], long, "c"))
        await agen.__anext__()
        await agen.aclose()                     # the consumer goes away mid-stream

    async def main() -> list[tuple[int, ...]]:
        results = await asyncio.gather(*(collect(i) for i in range(6)))
        await cancelled()
        with pytest.raises(InvalidRequest):
            async for _ in ae.generate(prompt_input([], params, "bad")):
                pass
        for _ in range(100):                    # the abort is applied between steps
            if (await ae.run(Snapshot())).num_used_blocks == 0:
                break
            await asyncio.sleep(0.01)
        return list(results)

    try:
        assert asyncio.run(main()) == expected
        assert tiny_engine.store.pool.num_used_blocks == 0 and not tiny_engine.has_unfinished()
        assert ae.num_streams == 0
    finally:
        ae.shutdown()


def test_commands_are_dispatched_by_type(tiny_engine):
    """Every command reaches the engine thread and returns its typed result; a failing one
    raises in the caller and the engine keeps serving."""
    ae = AsyncEngine(tiny_engine)
    prompt = list(range(40, 57))                          # 4 full blocks + 1 token
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    hashes = tuple(block_hashes(prompt, 4, tiny_engine.salt))

    async def main() -> None:
        outs = [o async for o in ae.generate(prompt_input(prompt, params, "cmd-0"))]
        assert outs[-1].finished
        assert await ae.run(CountHeld(hashes + (BlockHash(3),))) == 4
        held = await ae.run(ReadBlocks(hashes, torch.device("cpu")))
        device = list(tiny_engine.store.lookup(hashes).device)
        assert held.num_blocks == 4 and torch.equal(held.blocks, tiny_engine.store.kv.gather_blocks(device))
        now = await ae.read_blocks(hashes, torch.device("cpu"))      # beside a step: the same copy
        assert now.num_blocks == 4 and torch.equal(now.blocks, held.blocks)
        with pytest.raises(NoHostTier):                   # this engine has no host tier
            await ae.run(StageBlocks(hashes, held.blocks))
        snap = await ae.run(Snapshot())
        assert (snap.num_running, snap.num_waiting, snap.num_blocks) == (0, 0, 256)
        if tiny_engine.tokenizer is None:
            with pytest.raises(InvalidRequest, match="tokenizer"):
                await ae.run(Tokenize("hello"))
        else:
            assert await ae.run(Tokenize("hello")) == tiny_engine.encode("hello")
        with pytest.raises(TypeError, match="not an engine command"):
            await ae.run(object())                        # type: ignore[arg-type]
        fifty = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
        long = ae.generate(prompt_input(prompt, fifty, "cmd-1"))
        await long.__anext__()
        assert await ae.run(ListRequests()) == ("cmd-1",)
        assert await ae.run(AbortRequest("cmd-1")) is True
        assert await ae.run(AbortRequest("cmd-1")) is False
        rest = [o async for o in long]
        assert rest[-1].finished and rest[-1].finish_reason == "abort"
        assert await ae.run(ListRequests()) == ()

    try:
        asyncio.run(main())
        assert tiny_engine.store.pool.num_used_blocks == 0
    finally:
        ae.shutdown()


def test_count_held_answers_beside_a_step(tiny_engine, tmp_path):
    """A peer fetch's count of the blocks held here does not wait for the engine thread: while
    the thread is blocked (the stall hook, like a long prefill step) `count_held` answers at
    once and agrees with the `CountHeld` command, which waits for the thread."""
    prompt = list(range(60, 77))                          # 4 full blocks + 1 token
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    hashes = tuple(block_hashes(prompt, 4, tiny_engine.salt))
    stall = tmp_path / "stall"
    ae = AsyncEngine(tiny_engine, stall_file=stall)

    async def main() -> None:
        assert [o async for o in ae.generate(prompt_input(prompt, params, "held-0"))][-1].finished
        stall.touch()
        await asyncio.sleep(0.3)                         # the thread reaches the stall
        command = asyncio.ensure_future(ae.run(CountHeld(hashes)))
        assert ae.count_held(hashes + (BlockHash(3),)) == 4
        assert ae.count_held((BlockHash(3),) + hashes) == 0   # a leading run: its first block is missing
        await asyncio.sleep(0.2)
        assert not command.done()                          # the command waits for the thread
        stall.unlink()
        assert await asyncio.wait_for(command, 10) == 4

    try:
        asyncio.run(main())
    finally:
        stall.unlink(missing_ok=True)
        ae.shutdown()
