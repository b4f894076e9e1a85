"""`kvmesh bench disagg`, tiny and end to end: two real clusters (2 mixed workers; 1 prefill + 1
decode), each worker pinned to its own CPU; the JSON's shape and its sanity (what each mode must
show if the hop ran or did not), and the crossover rule on hand-made sweep points."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvmesh.bench.disagg import KEYS, DisaggConfig, crossover, run_disagg
from kvmesh.bench.report import emit

TINY = DisaggConfig(streams=1, stream_prompt_tokens=16, stream_output_tokens=6, prompt_tokens=96, long_output_tokens=3,
                    arrival_rate=1.0, window_s=2.0, sweep_prompt_tokens=(80,), sweep_rates=(1.0,), sweep_window_s=2.0,
                    min_prompt_tokens=64, kv_cache_memory_gib=0.05)


def test_config_rejects_what_would_not_measure_the_hop() -> None:
    for bad, match in [(dict(stream_prompt_tokens=64), "stream_prompt_tokens=64 must be below"),
                       (dict(sweep_prompt_tokens=(32,)), "prompt_tokens=32 is below min_prompt_tokens"),
                       (dict(arrival_rate=0.0), "arrival_rate"), (dict(modes=("both",)), "modes")]:
        with pytest.raises(ValueError, match=match):
            DisaggConfig(**bad)  # type: ignore[arg-type]


def test_crossover_is_the_shortest_prompt_from_which_on_it_pays() -> None:
    def point(tokens: int, rate: float, pays: bool) -> dict[str, object]:
        return {"prompt_tokens": tokens, "arrival_rate": rate, "pays": pays}
    sweep = [point(128, 0.1, False), point(512, 0.1, True), point(2000, 0.1, True),
             point(128, 0.3, True), point(512, 0.3, False), point(2000, 0.3, True),
             point(128, 1.0, False), point(512, 1.0, False), point(2000, 1.0, False)]
    assert crossover(sweep, (0.1, 0.3)) == {"by_rate": {"0.1": 512, "0.3": 2000}, "min_prompt_tokens": 2000}
    assert crossover(sweep, (0.1, 1.0))["min_prompt_tokens"] is None      # at rate 1 it never pays


@pytest.mark.multiproc
def test_tiny_disagg_bench_runs_both_modes_end_to_end(tmp_path: Path) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("each worker is pinned to its own CPU: needs 2")
    path = tmp_path / "disagg.json"
    emit(run_disagg(TINY), path)
    out = json.loads(path.read_text())
    assert {"mixed", "disaggregated", "sweep", "crossover", "targets", "config", "meta"} <= set(out)
    mixed, dis = out["mixed"], out["disaggregated"]
    for mode in (mixed, dis):
        assert set(KEYS) <= set(mode)
        assert 0 < mode["ttft_p50_s"] <= mode["ttft_p99_s"] and 0 <= mode["itl_p50_s"] <= mode["itl_p99_s"]
        assert mode["output_tok_s"] > 0 and mode["req_s"] > 0
        assert mode["long_requests"] == 2 and mode["stream_requests"] >= 1
        assert mode["output_tokens"] == 3 * mode["long_requests"] + 6 * mode["stream_requests"]
    # Mixed: no hop. Disaggregated: every long prompt handed off, every stream skipped the hop,
    # every request decoded on the decode worker (worker-1), with the tokens mixed serving gave.
    assert (mixed["handoffs"], mixed["handoff_s_mean"], mixed["skipped_hop"]) == (0, 0.0, 0)
    assert dis["handoffs"] == dis["long_requests"] and dis["handoff_s_mean"] > 0 and dis["handoff_failures"] == 0
    assert dis["skipped_hop"] == dis["stream_requests"]
    assert set(dis["requests_per_worker"]) == {"worker-1"}
    assert out["outputs_equal_frac"] == 1.0
    (point,) = out["sweep"]
    assert (point["prompt_tokens"], point["arrival_rate"]) == (80, 1.0) and isinstance(point["pays"], bool)
    assert point["disaggregated"]["handoff_s_mean"] > 0
    assert set(out["crossover"]) == {"by_rate", "min_prompt_tokens"}
    assert out["targets"]["itl_p99_ratio"] == pytest.approx(dis["itl_p99_s"] / mixed["itl_p99_s"])
