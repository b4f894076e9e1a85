"""`kvmesh bench disagg`: prefill/decode disaggregation against mixed serving on the same cores.

Two clusters, one after the other, each worker pinned to its own CPUs (`kvmesh serve
--cpu-affinity-per-worker`): `mixed` (2 mixed workers) and `disaggregated` (1 prefill + 1 decode
worker; the router's `--disagg-min-prompt-tokens` is `min_prompt_tokens`, so the long prompts
take the prefill hop and the streams' short prompts skip it). The workload, through the router's
gRPC API (greedy, ignore_eos): `streams` closed-loop streams decoding all the time (each a fresh
`stream_prompt_tokens`-token prompt and `stream_output_tokens` tokens), while uncached prompts of
`prompt_tokens` tokens (`long_output_tokens` tokens each) arrive at a steady `arrival_rate` per
second for `window_s` seconds. Both modes see the same prompts (same seed).

STALLS. A mixed worker computes an arriving prompt in one step (its default budget,
`--max-num-batched-tokens` 2,048, holds it whole, as vLLM's and SGLang's default chunk sizes
would), so each arrival stalls each stream decoding on that worker for one gap the length of
the prefill. ITL p99 over every gap sees those stalls only while they are over 1% of the gaps:
per mixed worker, about (its arrivals per second) x (ITL p50) / (the share of its time not
prefilling) of them. 1,000-token prompts at the 0.25/s one prefill core sustains make that
~0.5%, so the p99 fell on ordinary steps or on a stall by where the router had placed the
streams (1.77x one run, 0.42x another). The defaults are sized so stalls are ~2% of mixed
serving's gaps with the disaggregated prefill worker ~80% busy: 4 streams of 128 tokens (2 per
mixed worker), 200-token prompts at 1.8/s. Each mode reports `stall_gap_frac` (gaps over 5x its ITL p50),
`streams_per_worker`, the streams each arriving prompt stalled and what ran beside each slow
gap (kvmesh.bench.disagg_measure.stalls), so a reader sees why its p99 is what it is.

Per mode (kvmesh.bench.disagg_measure.Window): TTFT p50/p99 of the arriving long prompts, ITL
p50/p99 over every request's token gaps, output tok/s and req/s over the window's wall time, and
`handoff_s_mean`, the decode workers' hand-off seconds per handed-off request (their
`kvmesh:handoff_seconds`; 0 when nothing was handed off), with the router's hop counters.

The sweep runs a shorter window per (prompt length, arrival rate) on the same clusters;
`crossover` says, per rate, the shortest prompt at which disaggregation pays (ITL p99 below
mixed's with output tok/s at least `min_tok_ratio` of mixed's), and the shortest that pays at
every rate.

The skip rule. A third cluster, `disaggregated_skip` (1 prefill + 1 decode worker, the router's
threshold above every prompt), serves the same windows with every prompt skipping the hop: each
is computed on the decode worker, `--decode-step-prefill-tokens` tokens a step beside the
decodes. Per sweep point `skip` compares the hop with the skip (`hop_pays_over_skip`: the
hop's TTFT p50 below the skip's; their ITL p99 and output tok/s ratios beside it), and
`skip_crossover` is the shortest prompt from which on the hop pays over skipping at every rate:
what the router's `--disagg-min-prompt-tokens` default follows. `default_rule` says where the
router's default sends each sweep prompt and how its TTFT compares with mixed serving's.
`decode_step_budget` (kvmesh.bench.disagg_step, in a child pinned to one CPU before the
clusters start) times a decode worker's steps per budget; its `recommended` budget is the
largest whose step p90 stays within half of mixed serving's ITL p99 of the main window
(the ITL target, Sarathi-Serve's rule for a chunk): what the worker's default follows.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from contracts.cli import CLIError
from kvmesh.bench.disagg_measure import Load, Window, run_window, warm_up
from kvmesh.bench.disagg_step import profile_in_child, recommend_budget
from kvmesh.bench.report import emit
from kvmesh.serve.local import LocalCluster, ServeConfig
from router.config import RouterConfig
from worker.server.cli import DECODE_STEP_PREFILL_TOKENS

MODES = ("mixed", "disaggregated", "disaggregated_skip")
HOP_MODES = ("mixed", "disaggregated")   # the comparison (targets, crossover)
KEYS = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "output_tok_s", "req_s", "handoff_s_mean")
TARGET_ITL_P99_RATIO = 0.5     # disaggregated ITL p99 <= 0.5x mixed
TARGET_TOK_RATIO = 0.8         # with output tok/s >= 0.8x mixed


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    streams: int = 4                     # 2 per mixed worker: whichever gets a prompt has streams to stall
    stream_prompt_tokens: int = 24
    stream_output_tokens: int = 128
    prompt_tokens: int = 200             # with arrival_rate: stalls ~2% of mixed serving's gaps (module docstring)
    long_output_tokens: int = 8
    arrival_rate: float = 1.8
    window_s: float = 60.0
    sweep_prompt_tokens: tuple[int, ...] = (256, 1000, 2000)
    sweep_rates: tuple[float, ...] = (0.1, 0.3)
    sweep_window_s: float = 30.0
    min_prompt_tokens: int = 64          # the disaggregated router's --disagg-min-prompt-tokens
    decode_step_prefill_tokens: int = DECODE_STEP_PREFILL_TOKENS   # the decode worker's budget
    step_budgets: tuple[int, ...] = (2, 4, 6, 8, 12, 16, 32, 0)    # profiled (decode_step_budget); () = none
    step_profile_prompt_tokens: int = 256
    kv_cache_memory_gib: float = 0.5
    min_tok_ratio: float = TARGET_TOK_RATIO
    model: str = "smollm2"
    seed: int = 0
    modes: tuple[str, ...] = MODES

    def __post_init__(self) -> None:
        for name in ("streams", "stream_prompt_tokens", "stream_output_tokens", "prompt_tokens",
                     "long_output_tokens", "min_prompt_tokens", "step_profile_prompt_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        for name in ("arrival_rate", "window_s", "sweep_window_s", "kv_cache_memory_gib", "min_tok_ratio"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if any(t < 1 for t in self.sweep_prompt_tokens) or any(not r > 0 for r in self.sweep_rates):
            raise ValueError(f"sweep_prompt_tokens={self.sweep_prompt_tokens!r} / sweep_rates={self.sweep_rates!r} "
                             "must be positive")
        if self.stream_prompt_tokens >= self.min_prompt_tokens:
            raise ValueError(f"stream_prompt_tokens={self.stream_prompt_tokens} must be below min_prompt_tokens="
                             f"{self.min_prompt_tokens} (the streams skip the prefill hop)")
        short = [t for t in (self.prompt_tokens, *self.sweep_prompt_tokens) if t < self.min_prompt_tokens]
        if short:
            raise ValueError(f"prompt_tokens={short[0]} is below min_prompt_tokens={self.min_prompt_tokens}: "
                             "it would skip the prefill hop")
        if self.decode_step_prefill_tokens < 0 or any(b < 0 for b in self.step_budgets):
            raise ValueError(f"decode_step_prefill_tokens={self.decode_step_prefill_tokens!r} / step_budgets="
                             f"{self.step_budgets!r} must be >= 0 (0: no cap)")
        if not self.modes or any(m not in MODES for m in self.modes):
            raise ValueError(f"modes={','.join(self.modes)!r}; accepted: {', '.join(MODES)}")


QUICK = DisaggConfig(window_s=30.0, sweep_prompt_tokens=(64, 128, 256, 512, 1000), sweep_rates=(0.25,),
                     sweep_window_s=12.0)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("disagg", help="prefill/decode disaggregation vs mixed workers on the same pinned cores: "
                                      "TTFT, ITL, tok/s, hand-off seconds, and the crossover")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--quick", action="store_true", help="a run of a few minutes (shorter windows, a smaller sweep)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="tokens of each arriving prompt")
    p.add_argument("--arrival-rate", type=float, default=None, help="arriving prompts per second")
    p.add_argument("--streams", type=int, default=None, help="streams decoding all the time")
    p.add_argument("--window-s", type=float, default=None, help="seconds of arrivals per measurement")
    p.add_argument("--sweep-prompt-tokens", default=None, help="comma-separated prompt lengths of the sweep")
    p.add_argument("--sweep-rates", default=None, help="comma-separated arrival rates of the sweep ('' = no sweep)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated modes to run")
    p.add_argument("--decode-step-prefill-tokens", type=int, default=None,
                   help=f"the decode workers' prompt tokens per step (default: the worker's, "
                        f"{DECODE_STEP_PREFILL_TOKENS})")
    p.add_argument("--step-budgets", default=None,
                   help="comma-separated decode-step budgets to profile ('' = no profile; 0 = no cap)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run)


def config_from_args(args: argparse.Namespace) -> DisaggConfig:
    base = QUICK if args.quick else DisaggConfig()
    given: dict[str, Any] = {f: getattr(args, f) for f in ("prompt_tokens", "arrival_rate", "streams", "window_s",
                                                           "decode_step_prefill_tokens")
                             if getattr(args, f) is not None}
    try:
        if args.sweep_prompt_tokens is not None:
            given["sweep_prompt_tokens"] = tuple(int(x) for x in args.sweep_prompt_tokens.split(",") if x.strip())
        if args.step_budgets is not None:
            given["step_budgets"] = tuple(int(x) for x in args.step_budgets.split(",") if x.strip())
        if args.sweep_rates is not None:
            given["sweep_rates"] = tuple(float(x) for x in args.sweep_rates.split(",") if x.strip())
        modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
        return replace(base, model=args.model, seed=args.seed, modes=modes, **given)
    except ValueError as e:
        raise CLIError(_flag_of(str(e))) from None


def _flag_of(message: str) -> str:
    field = message.split("=", 1)[0].split()[-1] if "=" in message else ""
    return f"--{field.replace('_', '-')}: {message}" if field else message


def run(args: argparse.Namespace) -> int:
    return emit(run_disagg(config_from_args(args)), args.json)


def run_disagg(cfg: DisaggConfig) -> dict[str, Any]:
    """The decode-step profile, then every mode on a fresh cluster: its main window, then the
    sweep; the JSON of the module docstring (`mixed`, `disaggregated`, `disaggregated_skip`,
    `sweep`, `crossover`, `skip_crossover`, `default_rule`, `decode_step_budget`, `targets`,
    `config`)."""
    print(f"kvmesh bench disagg: {json.dumps(asdict(cfg))}", file=sys.stderr)
    budget = (profile_in_child(cfg.model, max(os.sched_getaffinity(0)), cfg.step_budgets,
                               cfg.step_profile_prompt_tokens, cfg.streams) if cfg.step_budgets else None)
    loads = [("main", Load(cfg.prompt_tokens, cfg.arrival_rate, cfg.window_s))]
    loads += [(f"sweep-{t}-{r:g}", Load(t, r, cfg.sweep_window_s))
              for t in cfg.sweep_prompt_tokens for r in cfg.sweep_rates]
    windows: dict[str, dict[str, Window]] = {}
    for mode in cfg.modes:
        cluster = LocalCluster(serve_config(cfg, mode))
        with cluster:
            windows[mode] = asyncio.run(_measure(cfg, cluster, loads))
    out: dict[str, Any] = {mode: windows[mode]["main"].summary() for mode in cfg.modes}
    sweep = [_sweep_point(cfg, load, {m: windows[m][name] for m in cfg.modes})
             for name, load in loads[1:]]
    out["sweep"] = sweep
    out["crossover"] = crossover(sweep, cfg.sweep_rates)
    out["skip_crossover"] = crossover(sweep, cfg.sweep_rates, key="hop_pays_over_skip")
    out["default_rule"] = default_rule(sweep, RouterConfig().disagg_min_prompt_tokens)
    if set(HOP_MODES) <= set(cfg.modes):
        out["targets"] = targets(out["mixed"], out["disaggregated"])
        out["outputs_equal_frac"] = windows["mixed"]["main"].equal_frac(windows["disaggregated"]["main"])
    if budget is not None:
        slo = (TARGET_ITL_P99_RATIO * out["mixed"]["itl_p99_s"]
               if "mixed" in out and out["mixed"]["itl_p99_s"] else None)
        budget.update(slo_s=slo, recommended=recommend_budget(budget, slo) if slo else None,
                      in_use=cfg.decode_step_prefill_tokens)
        out["decode_step_budget"] = budget
    out["config"] = asdict(cfg)
    return out


def serve_config(cfg: DisaggConfig, mode: str) -> ServeConfig:
    """The cluster of one mode: two workers pinned to their own CPUs, mixed or prefill + decode
    (`disaggregated_skip`: with the router's threshold above every prompt)."""
    roles = dict(workers=2) if mode == "mixed" else dict(workers=0, prefill_workers=1, decode_workers=1)
    threshold = (max(cfg.prompt_tokens, *cfg.sweep_prompt_tokens) + 1 if mode == "disaggregated_skip"
                 else cfg.min_prompt_tokens)
    return ServeConfig(**roles, cpu_affinity_per_worker=True, model=cfg.model, grpc_port=0, http_port=0,  # type: ignore[arg-type]
                       engine_argv=("--kv-cache-memory-gib", str(cfg.kv_cache_memory_gib)), startup_timeout_s=900.0,
                       router_argv=("--disagg-min-prompt-tokens", str(threshold)),
                       decode_step_prefill_tokens=cfg.decode_step_prefill_tokens,
                       cluster_name=f"disagg-{mode.replace('_', '-')}-{random.randrange(10**9)}")


async def _measure(cfg: DisaggConfig, cluster: LocalCluster, loads: list[tuple[str, Load]]) -> dict[str, Window]:
    metrics = tuple(f"http://127.0.0.1:{p}/metrics" for p in cluster.local_placement.metrics_ports)
    await warm_up(cluster.grpc_target, cfg)
    out = {}
    for i, (name, load) in enumerate(loads):
        out[name] = await run_window(cluster.grpc_target, cluster.http_base_url, metrics, cfg, load,
                                     seed=cfg.seed * 1000 + i)
    return out


def _sweep_point(cfg: DisaggConfig, load: Load, by_mode: dict[str, Window]) -> dict[str, Any]:
    point: dict[str, Any] = {"prompt_tokens": load.prompt_tokens, "arrival_rate": load.rate}
    for mode, w in by_mode.items():
        s = w.summary()
        point[mode] = {k: s[k] for k in ("ttft_p50_s", "itl_p99_s", "output_tok_s", "handoff_s_mean", "stall_gap_frac")}
    if {"disaggregated", "disaggregated_skip"} <= set(by_mode):
        hop, skip = point["disaggregated"], point["disaggregated_skip"]
        ttft = _ratio(hop["ttft_p50_s"], skip["ttft_p50_s"])
        point["skip"] = {"hop_vs_skip_ttft_p50_ratio": ttft,
                         "hop_vs_skip_itl_p99_ratio": _ratio(hop["itl_p99_s"], skip["itl_p99_s"]),
                         "hop_vs_skip_output_tok_s_ratio": _ratio(hop["output_tok_s"], skip["output_tok_s"]),
                         "skip_vs_mixed_ttft_p50_ratio": _ratio(skip["ttft_p50_s"], point.get("mixed", {}).get(
                             "ttft_p50_s")),
                         "skip_vs_mixed_itl_p99_ratio": _ratio(skip["itl_p99_s"], point.get("mixed", {}).get(
                             "itl_p99_s"))}
        point["hop_pays_over_skip"] = ttft is not None and ttft < 1.0
    if set(HOP_MODES) <= set(by_mode):
        mixed, dis = point["mixed"], point["disaggregated"]
        point["itl_p99_ratio"] = _ratio(dis["itl_p99_s"], mixed["itl_p99_s"])
        point["output_tok_s_ratio"] = _ratio(dis["output_tok_s"], mixed["output_tok_s"])
        point["pays"] = (point["itl_p99_ratio"] is not None and point["itl_p99_ratio"] < 1.0
                         and point["output_tok_s_ratio"] is not None
                         and point["output_tok_s_ratio"] >= cfg.min_tok_ratio)
    return point


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def crossover(sweep: list[dict[str, Any]], rates: tuple[float, ...], key: str = "pays") -> dict[str, Any]:
    """Per arrival rate, the shortest sweep prompt from which on disaggregation pays (`key`:
    the hop over mixed serving, or `hop_pays_over_skip`) at every longer prompt too (None: it
    pays at none); `min_prompt_tokens`: the largest of those, the shortest prompt at which it
    pays at every rate (None when at some rate it never does)."""
    by_rate: dict[str, int | None] = {}
    for rate in rates:
        points = sorted((p for p in sweep if p["arrival_rate"] == rate and key in p),
                        key=lambda p: p["prompt_tokens"])
        from_here: int | None = None
        for p in reversed(points):
            if not p[key]:
                break
            from_here = p["prompt_tokens"]
        by_rate[f"{rate:g}"] = from_here
    found = [v for v in by_rate.values()]
    return {"by_rate": by_rate,
            "min_prompt_tokens": max(v for v in found if v is not None) if found and None not in found else None}


def default_rule(sweep: list[dict[str, Any]], threshold: int) -> dict[str, Any]:
    """Where the router's default `threshold` (--disagg-min-prompt-tokens) sends each sweep
    prompt (an uncached prompt shorter than it skips the hop) and that route's TTFT p50 and ITL
    p99 against mixed serving's; `skipped_ttft_vs_mixed`: the TTFT ratio of the longest sweep
    prompt that skips (None: none does)."""
    points = []
    for p in sweep:
        route = "skip" if p["prompt_tokens"] < threshold else "hop"
        mode = p.get("disaggregated_skip" if route == "skip" else "disaggregated")
        mixed = p.get("mixed")
        points.append({"prompt_tokens": p["prompt_tokens"], "arrival_rate": p["arrival_rate"], "route": route,
                       "ttft_vs_mixed": _ratio(mode["ttft_p50_s"], mixed["ttft_p50_s"]) if mode and mixed else None,
                       "itl_p99_vs_mixed": _ratio(mode["itl_p99_s"], mixed["itl_p99_s"]) if mode and mixed else None})
    skipped = [q for q in points if q["route"] == "skip" and q["ttft_vs_mixed"] is not None]
    longest = max(skipped, key=lambda q: (q["prompt_tokens"], q["arrival_rate"])) if skipped else None
    return {"min_prompt_tokens": threshold, "points": points,
            "skipped_ttft_vs_mixed": longest["ttft_vs_mixed"] if longest else None,
            "skipped_prompt_tokens": longest["prompt_tokens"] if longest else None}


def targets(mixed: dict[str, Any], dis: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets on the main window: ITL p99 ratio <= 0.5 with output tok/s ratio >= 0.8."""
    itl = _ratio(dis["itl_p99_s"], mixed["itl_p99_s"])
    tok = _ratio(dis["output_tok_s"], mixed["output_tok_s"])
    return {"itl_p99_ratio": itl, "output_tok_s_ratio": tok,
            "itl_p99_ratio_target": TARGET_ITL_P99_RATIO, "output_tok_s_ratio_target": TARGET_TOK_RATIO,
            "met": itl is not None and tok is not None and itl <= TARGET_ITL_P99_RATIO and tok >= TARGET_TOK_RATIO}
