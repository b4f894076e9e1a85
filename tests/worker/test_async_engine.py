"""AsyncEngine: concurrent streams equal the sync engine; cancellation frees blocks."""
from __future__ import annotations

import asyncio

import pytest

from worker.async_engine import AsyncEngine
from worker.commands import Snapshot
from worker.engine import Engine, EngineConfig
from worker.request import InvalidRequest
from worker.sampling import SamplingParams


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
        async for out in ae.generate(prompts[i], params, f"r{i}"):
            toks.extend(out.new_token_ids)
            assert tuple(toks) == out.token_ids
        return tuple(toks)

    async def cancelled() -> None:
        agen = ae.generate(prompts[0], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True), "c")
        await agen.__anext__()
        await agen.aclose()                     # the consumer goes away mid-stream

    async def main() -> list[tuple[int, ...]]:
        results = await asyncio.gather(*(collect(i) for i in range(6)))
        await cancelled()
        with pytest.raises(InvalidRequest):
            async for _ in ae.generate([], params, "bad"):
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
