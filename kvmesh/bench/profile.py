"""`kvmesh bench profile`: where a batch-1 decode step's time goes, with the native kernels and
without them (`KVMESH_NATIVE_KERNELS=0`: torch's `F.linear` and the reference attention — the
engine as it ran before the native linear kernel), measured in the same run.

For each side, in its own process (the switch is read when the kernels load):
- `step_ms`: the median of `steps` batch-1 decode steps (`Engine.step()`, a 64-token prompt,
  greedy, after the prefill), wall time;
- `linear_ms` / `linear_gb_s`: one decode step's linear layers run alone as the model runs them
  (fused norms, the gated MLP, residual adds, the LM head; `bench_engine.measure_linear_gb_s`),
  and the weight bytes they stream per second;
- `rest_ms` = step_ms - linear_ms: attention, RoPE, sampling, metadata and the Python between;
- `ops`: torch.profiler over the same steps, self CPU ms per step of the ten costliest ops (a
  kernel called through pybind rather than the dispatcher does not show there; `untracked_ms`
  is the step's wall time the listed-and-unlisted ops do not cover).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

_SIDES = (("native", "1"), ("torch", "0"))


def profile_one(model: str, steps: int, seed: int) -> dict[str, Any]:
    """The figures of this process's kernels (see the module docstring)."""
    import random

    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvmesh.bench.engine_speed import measure_linear_gb_s, model_cost, random_prompts
    from worker.engine.engine import Engine, EngineConfig, prompt_input
    from worker.engine.sampling import SamplingParams
    from worker.kernels import native

    engine = Engine(EngineConfig(model=model))
    prompt = random_prompts(random.Random(seed), engine.model_config.vocab_size, [64])[0]
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)

    def decode_steps(n: int, prof: Any = None) -> list[float]:
        """Times of `n` decode steps (the prefill before and the drain after are not counted)."""
        engine.store.reset_prefix_cache()
        engine.add_request(prompt_input(prompt, params))
        while not any(o.completion_tokens for o in engine.step()):   # the prefill's first token
            pass
        if prof is not None:
            prof.start()
        times = []
        for _ in range(n):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        if prof is not None:
            prof.stop()
        while engine.has_unfinished():
            engine.step()
        return times

    decode_steps(4)   # warm-up
    step_s = statistics.median(decode_steps(steps))
    prof = profile(activities=[ProfilerActivity.CPU])
    profiled = decode_steps(steps, prof)
    ops = sorted(((e.key, e.self_cpu_time_total / 1e3 / steps) for e in prof.key_averages()),   # µs → ms/step
                 key=lambda kv: -kv[1])
    covered = sum(ms for _, ms in ops)
    linear_gb_s = measure_linear_gb_s(engine.runner.model, 1)
    linear_s = model_cost(engine.runner.model).weight_bytes / (linear_gb_s * 1e9)
    return {"step_ms": step_s * 1e3, "tok_s": 1 / step_s, "linear_ms": linear_s * 1e3, "linear_gb_s": linear_gb_s,
            "rest_ms": (step_s - linear_s) * 1e3, "linear_frac": linear_s / step_s,
            "ops": {k: round(ms, 3) for k, ms in ops[:10]},
            "untracked_ms": max(statistics.mean(profiled) * 1e3 - covered, 0.0),
            "native_kernels": native.load() is not None, "threads": torch.get_num_threads()}


def bench_profile(args: argparse.Namespace) -> dict[str, Any]:
    steps = 16 if args.quick else 48
    results: dict[str, Any] = {}
    for side, switch in _SIDES:
        env = {**os.environ, "KVMESH_NATIVE_KERNELS": switch}
        run = subprocess.run([sys.executable, "-m", "kvmesh.bench.profile", "--model", args.model,
                              "--steps", str(steps), "--seed", str(args.seed)],
                             env=env, capture_output=True, text=True, check=False)
        if run.returncode:
            raise RuntimeError(f"bench profile ({side}) failed:\n{run.stderr[-3000:]}")
        results[side] = json.loads(run.stdout.strip().splitlines()[-1])
    n, t = results["native"], results["torch"]
    results["speedup"] = {"step": t["step_ms"] / n["step_ms"], "linear": t["linear_ms"] / n["linear_ms"],
                          "rest": t["rest_ms"] / n["rest_ms"] if n["rest_ms"] > 0 else None}
    results["config"] = {"model": args.model, "steps": steps, "prompt_tokens": 64, "dtype": "fp32", "device": "cpu"}
    return results


def main() -> None:
    p = argparse.ArgumentParser(description="one side of `kvmesh bench profile` (prints one JSON line)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(json.dumps(profile_one(args.model, args.steps, args.seed)))


if __name__ == "__main__":
    main()
