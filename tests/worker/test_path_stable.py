"""A prompt's logits do not depend on how the engine computes it (docs/ARCHITECTURE.md, weight
formats): whole, in chunks, a token a step, or beside another sequence's prefill, the logits are
the same bits on quantized weights, whose kernels quantize their input to int8 (a code step
where fp32 paths differed in their last bit would change greedy tokens)."""
from __future__ import annotations

import pytest
import torch

from kvstore.free_queue import BlockId
from worker.engine.engine import Engine, EngineConfig
from worker.kernels import native
from worker.kernels.reference import AttnMetadata

pytestmark = pytest.mark.skipif(not native.qlinear_isa() or native.load() is None,
                                reason="the native kernels are not built here")

Step = list[tuple[int, list[int], int]]   # (sequence, its new tokens, position of the first)


def _logits(engine: Engine, steps: list[Step]) -> dict[int, torch.Tensor]:
    """Run the steps through the model; every new token's logits, per sequence, in order."""
    runner = engine.runner
    blocks: dict[int, list[BlockId]] = {}
    rows: dict[int, list[torch.Tensor]] = {}
    try:
        for step in steps:
            for seq, _, _ in step:
                if seq not in blocks:
                    blocks[seq] = runner.store.allocate(runner.layout.blocks_for(64))
            meta = AttnMetadata.build([len(t) for _, t, _ in step], [p + len(t) for _, t, p in step],
                                      [[int(b) for b in blocks[s]] for s, _, _ in step], runner.cfg.block_size)
            ids = [i for _, t, _ in step for i in t]
            pos = [p + j for _, t, p in step for j in range(len(t))]
            out = runner.model.forward(torch.tensor(ids), torch.tensor(pos), runner.kv_caches, meta)
            at = 0
            for seq, t, _ in step:
                rows.setdefault(seq, []).append(out[at:at + len(t)])
                at += len(t)
    finally:
        for b in blocks.values():
            runner.store.free_sequence(b)
    return {s: torch.cat(r) for s, r in rows.items()}


@pytest.mark.parametrize("weight_dtype", ["q8_0", "q4_1"])
def test_a_prompt_gets_the_same_logits_however_it_is_computed(tiny_model_dir, weight_dtype: str) -> None:
    engine = Engine(EngineConfig(model=str(tiny_model_dir("llama-gqa")), weight_dtype=weight_dtype, block_size=4,
                                 num_blocks=64))
    assert engine.runner.weight_format.startswith(weight_dtype)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (37,), generator=gen).tolist()
    other = torch.randint(0, 256, (21,), generator=gen).tolist()
    whole = _logits(engine, [[(0, prompt, 0)]])[0]

    def chunks(n: int) -> list[Step]:
        return [[(0, prompt[s:s + n], s)] for s in range(0, len(prompt), n)]

    beside = [[(1, other, 0), (0, prompt, 0)]]
    # a token a step, each step beside 3 tokens of the other prompt's prefill (a mixed step)
    mixed = [[(0, prompt[s:s + 1], s)] + ([(1, other[3 * s:3 * s + 3], 3 * s)] if 3 * s < len(other) else [])
             for s in range(len(prompt))]
    for name, steps in [("chunks of 5", chunks(5)), ("chunks of 16", chunks(16)), ("token by token", chunks(1)),
                        ("beside another prefill", beside), ("mixed steps", mixed)]:
        got = _logits(engine, steps)[0]
        assert torch.equal(got, whole), f"{name}: max |diff| {float((got - whole).abs().max()):.2e}"
