"""`kvmesh bench tenants`: a noisy neighbour through the real service, with and without fair share.

Two tenants of one `kvmesh serve --workers N --api-keys-file KEYS` (keys `alpha` and `beta`),
driven through the OpenAI HTTP API: alpha sends one short shared prompt (`alpha_prompt_tokens`
token ids, `max_tokens` 2, greedy) every `alpha_interval_s`; beta floods `flood_prompts`
distinct prompts of `flood_tokens` token ids (`flood_output_tokens` each, ignore_eos) at most
`concurrency` at a time. Each mode runs on a fresh cluster:

- `unfair`: `--fair-share off --tenant-max-cached-frac 1` (no fair share, no KV cap),
- `fair`: `--fair-share on --tenant-max-cached-frac F` (the defaults, worker/engine/fairness.py
  and kvstore/quota.py),

and in each, two phases: alpha alone for `alone_s` (after one warm-up request), then alpha for
as long as beta's flood lasts. Per mode: alpha's TTFT p50/p90 in each phase (client side,
streamed, to the first chunk with a choice), `alpha_ttft_p90_ratio` (flood ÷ alone), alpha's
cached-token fraction in each phase (`usage.prompt_tokens_details.cached_tokens`) and its ratio,
the output tok/s of both tenants over the flood's wall time (`output_tok_s`; alpha's steady
2 tokens every `alpha_interval_s` are most of it), and beta's own tokens (prompt + output) per
second over that time (`flood_tok_s`: the work the flood got done). Top level:
`fair.throughput_ratio` = fair output tok/s ÷ unfair output tok/s and
`fair.flood_tok_s_ratio` = the same for `flood_tok_s`. Targets (docs): fair alpha TTFT p90 <= 3x
alone, throughput ratio >= 0.9, alpha cached fraction ratio >= 0.9.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from contracts.cli import CLIError
from kvmesh.bench.report import emit
from kvmesh.serve.local import LocalCluster, ServeConfig

_TOKEN_RANGE = (1000, 40000)   # plain vocabulary ids of the default model
_KEYS = {"alpha": "bench-alpha-key", "beta": "bench-beta-key"}
MODES = ("unfair", "fair")
_UNAVAILABLE_RETRIES = 60
_RETRIES = [0]     # 503 retries in the current mode's run (one run at a time)


@dataclass(frozen=True, slots=True)
class TenantsConfig:
    flood_prompts: int = 96
    flood_tokens: int = 2000
    flood_output_tokens: int = 16
    concurrency: int = 12
    alpha_prompt_tokens: int = 200
    alpha_interval_s: float = 0.3
    alone_s: float = 10.0
    num_blocks: int = 800          # KV pool blocks per worker
    tenant_max_cached_frac: float = 0.5
    fair_step_tokens: int | None = None   # fair mode's --fair-step-tokens (None: the worker's default)
    workers: int = 2
    model: str = "smollm2"
    seed: int = 0
    modes: tuple[str, ...] = MODES

    def __post_init__(self) -> None:
        for name in ("flood_prompts", "flood_tokens", "flood_output_tokens", "concurrency", "alpha_prompt_tokens",
                     "num_blocks", "workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise CLIError(f"--{name.replace('_', '-')}: {value!r} must be a positive integer")
        if not self.alpha_interval_s > 0 or not self.alone_s > 0:
            raise CLIError("--alpha-interval-s and --alone-s must be > 0")
        if self.fair_step_tokens is not None and self.fair_step_tokens < 1:
            raise CLIError(f"--fair-step-tokens: {self.fair_step_tokens!r} must be a positive integer")
        if not self.modes or any(m not in MODES for m in self.modes):
            raise CLIError(f"--modes: {','.join(self.modes)!r}; accepted: {', '.join(MODES)}")


QUICK = TenantsConfig(flood_prompts=24, flood_tokens=1000, concurrency=6, alone_s=5.0, num_blocks=400)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tenants", help="a noisy neighbour (beta's flood) and alpha's TTFT, with and without fair share")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--quick", action="store_true", help="a run of a few minutes (smaller flood)")
    d = TenantsConfig()
    for name in ("flood-prompts", "flood-tokens", "flood-output-tokens", "concurrency", "alpha-prompt-tokens",
                 "num-blocks", "workers"):
        key = name.replace("-", "_")
        p.add_argument(f"--{name}", type=int, default=None,
                       help=f"default {getattr(d, key)}; --quick: {getattr(QUICK, key)}")
    for name in ("alpha-interval-s", "alone-s", "tenant-max-cached-frac"):
        key = name.replace("-", "_")
        p.add_argument(f"--{name}", type=float, default=None,
                       help=f"default {getattr(d, key)}; --quick: {getattr(QUICK, key)}")
    p.add_argument("--fair-step-tokens", type=int, default=None,
                   help="the fair mode's kvmesh worker --fair-step-tokens (default: the worker's)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: unfair, fair")
    p.set_defaults(run=run)


def config_from_args(args: argparse.Namespace) -> TenantsConfig:
    base = QUICK if args.quick else TenantsConfig()
    names = ("flood_prompts", "flood_tokens", "flood_output_tokens", "concurrency", "alpha_prompt_tokens",
             "num_blocks", "workers", "alpha_interval_s", "alone_s", "tenant_max_cached_frac", "fair_step_tokens")
    given = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    return replace(base, model=args.model, seed=args.seed, modes=modes, **given)


def run(args: argparse.Namespace) -> int:
    return emit(run_tenants(config_from_args(args)), args.json)


def run_tenants(cfg: TenantsConfig) -> dict[str, Any]:
    """Every mode on a fresh cluster; the JSON described in the module docstring."""
    print(f"kvmesh bench tenants: {json.dumps(asdict(cfg))}", file=sys.stderr)
    rng = random.Random(cfg.seed)
    alpha_prompt = [rng.randrange(*_TOKEN_RANGE) for _ in range(cfg.alpha_prompt_tokens)]
    flood = [[rng.randrange(*_TOKEN_RANGE) for _ in range(cfg.flood_tokens)] for _ in range(cfg.flood_prompts)]
    out: dict[str, Any] = {"config": asdict(cfg)}
    with tempfile.TemporaryDirectory(prefix="kvmesh-tenants-") as tmp:
        keys = Path(tmp) / "keys"
        keys.write_text("".join(f"{key} {tenant}\n" for tenant, key in _KEYS.items()))
        for mode in cfg.modes:
            fair = mode == "fair"
            engine_argv = ("--num-blocks", str(cfg.num_blocks), "--fair-share", "on" if fair else "off",
                           "--tenant-max-cached-frac", str(cfg.tenant_max_cached_frac if fair else 1.0))
            if fair and cfg.fair_step_tokens is not None:
                engine_argv += ("--fair-step-tokens", str(cfg.fair_step_tokens))
            serve = ServeConfig(workers=cfg.workers, model=cfg.model, grpc_port=0, http_port=0,
                                engine_argv=engine_argv, router_argv=("--api-keys-file", str(keys)),
                                startup_timeout_s=900.0, cluster_name=f"tenants-{mode}-{rng.randrange(10**9)}")
            load_before = os.getloadavg()
            with LocalCluster(serve) as cluster:
                out[mode] = asyncio.run(_drive(cfg, cluster.http_base_url, alpha_prompt, flood))
            # 1, 5 and 15 min load averages before the cluster started, then after it stopped
            out[mode]["load_avg"] = [round(x, 2) for x in (*load_before, *os.getloadavg())]
            print(f"kvmesh bench tenants: {mode}: {json.dumps(out[mode])}", file=sys.stderr)
    if "fair" in out and "unfair" in out and out["unfair"]["output_tok_s"]:
        out["fair"]["throughput_ratio"] = out["fair"]["output_tok_s"] / out["unfair"]["output_tok_s"]
        out["fair"]["flood_tok_s_ratio"] = out["fair"]["flood_tok_s"] / out["unfair"]["flood_tok_s"]
    return out


@dataclass(frozen=True, slots=True)
class _Done:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


async def _drive(cfg: TenantsConfig, base_url: str, alpha_prompt: list[int], flood: list[list[int]]) -> dict[str, Any]:
    from openai import AsyncOpenAI  # imported here: only the live benches need it

    alpha = AsyncOpenAI(base_url=base_url, api_key=_KEYS["alpha"], max_retries=3, timeout=900)
    beta = AsyncOpenAI(base_url=base_url, api_key=_KEYS["beta"], max_retries=3, timeout=900)
    _RETRIES[0] = 0
    try:
        await _complete(alpha, cfg.model, alpha_prompt, 2, False)          # warm-up: caches the prefix
        alone = await _alpha_loop(cfg, alpha, alpha_prompt, asyncio.sleep(cfg.alone_s))
        sem = asyncio.Semaphore(cfg.concurrency)

        async def one(prompt: list[int]) -> _Done:
            async with sem:
                return await _complete(beta, cfg.model, prompt, cfg.flood_output_tokens, True)

        start = time.perf_counter()
        flood_task = asyncio.gather(*(one(p) for p in flood))
        during = await _alpha_loop(cfg, alpha, alpha_prompt, flood_task)
        wall = time.perf_counter() - start
        beta_done: list[_Done] = flood_task.result()
    finally:
        await alpha.close()
        await beta.close()
    a, d = _phase(alone), _phase(during)
    return {
        "alone": a, "flood": d,
        "alpha_ttft_p90_ratio": d["ttft_p90_s"] / a["ttft_p90_s"] if a["ttft_p90_s"] else None,
        "alpha_cached_frac_ratio": d["cached_frac"] / a["cached_frac"] if a["cached_frac"] else None,
        "output_tok_s": (sum(x.completion_tokens for x in beta_done + during)) / wall,
        "flood_tok_s": sum(x.prompt_tokens + x.completion_tokens for x in beta_done) / wall,
        "beta_ttft_p50_s": _quantile(sorted(x.ttft_s for x in beta_done), 0.5),
        "flood_wall_s": wall, "unavailable_retries": _RETRIES[0],
    }


async def _alpha_loop(cfg: TenantsConfig, client: Any, prompt: list[int], until: Any) -> list[_Done]:
    """One alpha request every `alpha_interval_s` (open loop) until `until` completes."""
    stop = asyncio.ensure_future(until)
    sent: list[asyncio.Task[_Done]] = []
    while not stop.done():
        sent.append(asyncio.ensure_future(_complete(client, cfg.model, prompt, 2, False)))
        await asyncio.wait([stop], timeout=cfg.alpha_interval_s)
    stop.result()
    return list(await asyncio.gather(*sent))


async def _complete(client: Any, model: str, prompt: list[int], max_tokens: int, ignore_eos: bool) -> _Done:
    from openai import InternalServerError

    t0 = time.perf_counter()
    first: float | None = None
    usage = None
    for attempt in range(_UNAVAILABLE_RETRIES + 1):
        try:
            stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                     temperature=0.0, stream=True,
                                                     stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": ignore_eos})
            break
        except InternalServerError as e:
            # 503: the router sees no ready worker for a moment (its health probes time out on a
            # saturated machine); the wait counts in this request's TTFT
            if e.status_code != 503 or attempt == _UNAVAILABLE_RETRIES:
                raise
            _RETRIES[0] += 1
            await asyncio.sleep(1.0)
    async for chunk in stream:
        if chunk.choices and first is None:
            first = time.perf_counter()
        usage = chunk.usage or usage
    if usage is None or first is None:
        raise RuntimeError("a completion ended without a choice or usage")
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return _Done(first - t0, usage.prompt_tokens, cached or 0, usage.completion_tokens)


def _phase(done: list[_Done]) -> dict[str, Any]:
    ttfts = sorted(x.ttft_s for x in done)
    prompt = sum(x.prompt_tokens for x in done)
    return {"requests": len(done), "ttft_p50_s": _quantile(ttfts, 0.5), "ttft_p90_s": _quantile(ttfts, 0.9),
            "cached_frac": sum(x.cached_tokens for x in done) / prompt if prompt else 0.0}


def _quantile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank quantile of an ascending list (0.0 when empty)."""
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))]
