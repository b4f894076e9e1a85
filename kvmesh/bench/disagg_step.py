"""The decode worker's prompt tokens per step (`kvmesh worker --decode-step-prefill-tokens`),
profiled as Sarathi-Serve sizes its chunks: one engine on one CPU thread with `streams`
sequences decoding, a prompt of `prompt_tokens` tokens arrives (a prompt that skipped the
prefill hop), and for each budget N the steps that carry N of its tokens beside the decodes are
timed — what the decoding streams see as their inter-token gap while it is computed — along
with the prompt's time to its first token. Budget 0 is no cap: the whole prompt in one step,
as a mixed worker computes it beside its decodes.

`kvmesh bench disagg` runs it in a child process pinned to one CPU (`profile_in_child`) and
reports it as `decode_step_budget`, with the budget `recommend_budget` picks against the ITL
target measured in the same run; `python -m kvmesh.bench.disagg_step` prints the profile alone.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from kvmesh.bench.disagg_measure import prompt, quantile

BUDGETS = (2, 4, 6, 8, 12, 16, 32, 0)


def profile(model: str, budgets: tuple[int, ...], prompt_tokens: int, streams: int, decode_steps: int,
            repeats: int) -> dict[str, Any]:
    """Per budget: the p50, p90 and max step seconds while the prompt is computed beside
    `streams` decodes, its steps and seconds to the first token (median of `repeats`
    prompts); with the plain decode step's median seconds. One engine, one thread (the
    caller's thread count is restored after)."""
    import torch
    threads = torch.get_num_threads()
    try:
        return _profile(model, budgets, prompt_tokens, streams, decode_steps, repeats)
    finally:
        torch.set_num_threads(threads)


def _profile(model: str, budgets: tuple[int, ...], prompt_tokens: int, streams: int, decode_steps: int,
             repeats: int) -> dict[str, Any]:
    from worker.engine.engine import Engine, EngineConfig
    from worker.engine.request import prompt_input
    from worker.engine.sampling import SamplingParams

    engine = Engine(EngineConfig(model=model, kv_cache_memory_gib=0.5, threads=1, enable_prefix_caching=False))
    decode = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size

    def ids(key: str, n: int) -> list[int]:
        return [t % vocab for t in prompt(key, n)]
    for i in range(streams):
        engine.add_request(prompt_input(ids(f"stream-{i}", 24), decode, f"stream-{i}"))
    for _ in range(30):                      # their prefills, and warm-up decode steps
        engine.step()

    def timed_step() -> float:
        t0 = time.perf_counter()
        engine.step()
        return time.perf_counter() - t0

    decode_s = statistics.median(timed_step() for _ in range(decode_steps))
    out: dict[str, Any] = {"decode_step_s": decode_s, "streams": streams, "prompt_tokens": prompt_tokens,
                           "budgets": []}
    for n in budgets:
        engine.scheduler.cfg = dataclasses.replace(engine.scheduler.cfg, step_prefill_tokens=n)
        steps: list[float] = []
        ttfts: list[float] = []
        counts: list[int] = []
        for r in range(repeats):
            rid = f"p{n}-{r}"
            engine.add_request(prompt_input(ids(rid, prompt_tokens), one, rid))
            t0 = time.perf_counter()
            mine: list[float] = []
            while rid in engine.requests:
                mine.append(timed_step())
            ttfts.append(time.perf_counter() - t0)
            counts.append(len(mine))
            steps += mine
        steps.sort()
        out["budgets"].append({"step_prefill_tokens": n, "step_p50_s": statistics.median(steps),
                               "step_p90_s": quantile(steps, 0.9), "step_max_s": steps[-1],
                               "step_p50_decode_steps": statistics.median(steps) / decode_s,
                               "steps_to_first_token": statistics.median(counts),
                               "ttft_s": statistics.median(ttfts)})
        for _ in range(3):
            engine.step()
    whole = next((b["ttft_s"] for b in out["budgets"] if b["step_prefill_tokens"] == 0), None)
    for b in out["budgets"]:
        b["ttft_vs_whole"] = b["ttft_s"] / whole if whole else None
    return out


def recommend_budget(result: dict[str, Any], slo_s: float) -> int | None:
    """Sarathi-Serve's chunk rule: the largest capped budget whose steps beside the decodes last
    at most `slo_s` at their p90 (None when even the smallest does not)."""
    held = [b["step_prefill_tokens"] for b in result["budgets"]
            if b["step_prefill_tokens"] > 0 and b["step_p90_s"] <= slo_s]
    return max(held) if held else None


def profile_in_child(model: str, cpu: int, budgets: tuple[int, ...], prompt_tokens: int,
                     streams: int) -> dict[str, Any]:
    """`profile` in a child process pinned to `cpu` (the bench runs nothing else meanwhile)."""
    argv = [sys.executable, "-m", "kvmesh.bench.disagg_step", "--model", model, "--cpu", str(cpu),
            "--budgets", ",".join(str(b) for b in budgets), "--prompt-tokens", str(prompt_tokens),
            "--streams", str(streams)]
    done = subprocess.run(argv, check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    result: dict[str, Any] = json.loads(done.stdout)
    result["cpu"] = cpu
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmesh.bench.disagg_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--cpu", type=int, default=None, help="pin this process to this CPU first")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--budgets", default=",".join(str(b) for b in BUDGETS))
    p.add_argument("--decode-steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    budgets = tuple(int(b) for b in args.budgets.split(","))
    print(json.dumps(profile(args.model, budgets, args.prompt_tokens, args.streams, args.decode_steps, args.repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
