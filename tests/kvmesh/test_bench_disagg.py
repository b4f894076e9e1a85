"""`kvmesh bench disagg`, tiny and end to end: two real clusters (2 mixed workers; 1 prefill + 1
decode), each worker pinned to its own CPU; the JSON's shape and its sanity (what each mode must
show if the hop ran or did not), the crossover rules and the skip rule's figures on hand-made
sweep points, and the decode-step profile on a tiny model."""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from kvmesh.bench.disagg import KEYS, DisaggConfig, crossover, default_rule, run_disagg
from kvmesh.bench.disagg_step import profile, recommend_budget
from kvmesh.bench.report import emit

TINY = DisaggConfig(streams=1, stream_prompt_tokens=16, stream_output_tokens=6, prompt_tokens=96, long_output_tokens=3,
                    arrival_rate=1.0, window_s=2.0, sweep_prompt_tokens=(80,), sweep_rates=(1.0,), sweep_window_s=2.0,
                    min_prompt_tokens=64, kv_cache_memory_gib=0.05, modes=("mixed", "disaggregated"), step_budgets=())


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
    skip = [{**p, "hop_pays_over_skip": p["pays"]} for p in sweep]
    assert crossover(skip, (0.1, 0.3), key="hop_pays_over_skip") == crossover(sweep, (0.1, 0.3))


def test_the_default_rule_sends_each_sweep_prompt_one_way_and_compares_it_with_mixed() -> None:
    def point(tokens: int, mixed: float, hop: float, skip: float) -> dict[str, object]:
        return {"prompt_tokens": tokens, "arrival_rate": 0.25, "mixed": {"ttft_p50_s": mixed, "itl_p99_s": 0.1},
                "disaggregated": {"ttft_p50_s": hop, "itl_p99_s": 0.04},
                "disaggregated_skip": {"ttft_p50_s": skip, "itl_p99_s": 0.05}}
    rule = default_rule([point(128, 0.5, 0.8, 0.6), point(512, 2.0, 2.2, 3.0), point(1000, 4.0, 5.0, 8.0)], 600)
    assert [(p["prompt_tokens"], p["route"]) for p in rule["points"]] == [(128, "skip"), (512, "skip"), (1000, "hop")]
    assert rule["points"][0]["ttft_vs_mixed"] == pytest.approx(1.2)
    assert rule["points"][2]["ttft_vs_mixed"] == pytest.approx(1.25)
    assert (rule["skipped_prompt_tokens"], rule["skipped_ttft_vs_mixed"]) == (512, pytest.approx(1.5))
    assert default_rule([point(1000, 4.0, 5.0, 8.0)], 600)["skipped_ttft_vs_mixed"] is None


def test_the_recommended_budget_is_the_largest_whose_steps_hold_the_itl_target() -> None:
    def budget(n: int, p90: float) -> dict[str, object]:
        return {"step_prefill_tokens": n, "step_p90_s": p90}
    result = {"budgets": [budget(2, 0.02), budget(4, 0.03), budget(8, 0.05), budget(16, 0.07), budget(0, 0.9)]}
    assert recommend_budget(result, 0.055) == 8
    assert recommend_budget(result, 0.03) == 4
    assert recommend_budget(result, 0.01) is None          # 0 (no cap) never counts


def test_the_step_profile_times_each_budget_beside_the_decodes(tiny_model_dir) -> None:
    out = profile(str(tiny_model_dir("llama-gqa")), (4, 16, 0), prompt_tokens=32, streams=2, decode_steps=3, repeats=1)
    steps = {b["step_prefill_tokens"]: b for b in out["budgets"]}
    assert (steps[4]["steps_to_first_token"], steps[16]["steps_to_first_token"], steps[0]["steps_to_first_token"]) \
        == (8, 2, 1)
    assert out["decode_step_s"] > 0 and steps[0]["ttft_vs_whole"] == 1.0
    assert all(0 < b["step_p50_s"] <= b["step_p90_s"] <= b["step_max_s"] for b in out["budgets"])


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


@pytest.mark.multiproc
@pytest.mark.slow
def test_tiny_skip_mode_computes_every_prompt_on_the_decode_worker(tmp_path: Path) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("each worker is pinned to its own CPU: needs 2")
    out = run_disagg(replace(TINY, modes=("disaggregated_skip",), decode_step_prefill_tokens=8))
    skip = out["disaggregated_skip"]
    assert (skip["handoffs"], skip["handoff_s_mean"]) == (0, 0.0)
    assert skip["skipped_hop"] == skip["long_requests"] + skip["stream_requests"]
    assert set(skip["requests_per_worker"]) == {"worker-1"}
    assert out["config"]["decode_step_prefill_tokens"] == 8 and "targets" not in out


def test_stalls_count_the_gaps_a_prefill_stalled_and_the_streams_it_stalled() -> None:
    from kvmesh.bench.disagg_measure import Served, stalls

    def stream(key: str, worker: str, start: float, gaps: list[float]) -> Served:
        return Served("stream", key, start, start + 0.1 + sum(gaps), 0.1, tuple(gaps), (), worker)
    # worker-0: stream 0 decodes every 10 ms but one 4 s gap while a long prompt is computed beside it;
    # worker-1: stream 1 decodes throughout, and its next request's prompt is computed at 1.1 s
    s0 = stream("s0-0-0", "worker-0", 0.0, [0.01] * 50 + [4.0] + [0.01] * 49)
    s1 = stream("s0-1-0", "worker-1", 0.0, [0.01] * 100 + [0.03] + [0.01] * 99)
    s1b = stream("s0-1-1", "worker-1", 1.05, [0.01] * 5)
    long = Served("long", "l0-1000-0", 0.5, 4.7, 4.15, (0.01, 0.01), (), "worker-0")
    out = stalls([s0, s1, s1b, long])
    assert out["gaps"] == 100 + 200 + 5 + 2 and out["stall_gaps"] == 1
    assert out["stall_gap_frac"] == pytest.approx(1 / 307)
    assert out["streams_on_worker_per_long"] == [1] and out["streams_stalled_per_long"] == [1]
    assert out["slow_gaps"] == 2
    assert out["slow_gaps_during"] == {"long_prefill": 1, "long_decode": 0, "stream_prompt": 1, "none": 0}
    assert set(out["streams_per_worker"]) == {"worker-0", "worker-1"}
    assert out["streams_per_worker"] == {"worker-0": pytest.approx(1.0),     # open for the whole window
                                         "worker-1": pytest.approx((s1.end + s1b.end - s1b.start) / s0.end)}
