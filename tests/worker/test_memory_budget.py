"""`--memory-gib`: the KV pool gets what the weights, at their real size, and the activation
reserve leave of the worker's memory, so lighter weights give more KV blocks (worker.model.runner
`kv_pool_blocks`); the startup line says how many."""
from __future__ import annotations

import logging

import pytest

from worker.cli import engine_config_from_args
from worker.engine.engine import Engine, EngineConfig
from worker.kernels import native
from worker.model.runner import activation_reserve_bytes

pytestmark = pytest.mark.skipif(not native.qlinear_isa(), reason="the native kernels are not built here")

MEMORY_GIB = 0.01


def _engine(model_dir, weight_dtype: str, **kw) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), device="cpu", weight_dtype=weight_dtype, max_num_seqs=4,
                               max_num_batched_tokens=64, **kw))


def test_lighter_weights_leave_their_bytes_to_the_kv_pool(tiny_model_dir, caplog) -> None:
    model_dir = tiny_model_dir("llama-gqa")
    with caplog.at_level(logging.INFO, logger="worker.model.runner"):
        fp32, q4 = (_engine(model_dir, w, memory_gib=MEMORY_GIB) for w in ("fp32", "q4_1"))
    for engine in (fp32, q4):
        r = engine.runner
        reserve = activation_reserve_bytes(r.model_config, 64, 4)
        assert reserve > 0
        assert engine.store.num_blocks == r.layout.num_blocks_in(int(MEMORY_GIB * 2**30) - r.weight_bytes - reserve)
    assert q4.runner.weight_bytes < fp32.runner.weight_bytes / 4
    gained = q4.store.num_blocks - fp32.store.num_blocks
    saved = fp32.runner.layout.num_blocks_in(fp32.runner.weight_bytes - q4.runner.weight_bytes)
    assert gained in (saved, saved + 1) and gained > 0
    lines = [r.getMessage() for r in caplog.records if "KV pool" in r.getMessage()]
    assert any(f"KV pool {q4.store.num_blocks} blocks (--memory-gib" in m and f"hold {saved} more" in m
               for m in lines), lines


def test_without_memory_gib_the_pool_is_the_kv_figure_and_the_gain_is_named(tiny_model_dir, caplog) -> None:
    model_dir = tiny_model_dir("llama-gqa")
    with caplog.at_level(logging.INFO, logger="worker.model.runner"):
        a, b = (_engine(model_dir, w, kv_cache_memory_gib=0.001) for w in ("fp32", "q4_1"))
    assert a.store.num_blocks == b.store.num_blocks == a.runner.layout.num_blocks_in(2**30 // 1000)
    assert any("would hold (--memory-gib)" in r.getMessage() for r in caplog.records)
    assert _engine(model_dir, "q4_1", memory_gib=MEMORY_GIB, num_blocks=7).store.num_blocks == 7


def test_a_budget_the_weights_fill_is_refused_naming_the_flag(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match=r"memory_gib=0\.0001 leaves no room for a KV block: the weights take"):
        _engine(tiny_model_dir("llama-gqa"), "fp32", memory_gib=0.0001)
    with pytest.raises(ValueError, match="memory_gib=0 must be > 0"):
        EngineConfig(memory_gib=0)


def test_the_flag_reaches_the_engine_config() -> None:
    import argparse

    from worker.cli import add_engine_arguments
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    assert engine_config_from_args(p.parse_args(["--memory-gib", "2.5"])).memory_gib == 2.5
    assert engine_config_from_args(p.parse_args([])).memory_gib is None
