"""`kvmesh bench engine|prefix|memory` — each measures kvmesh against a baseline in the same run.

Benchmarks are not tests: they print a table and write JSON (`--json PATH`). `--quick`
keeps each under a minute on a 2-core CPU.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    for name, fn, help_ in (("engine", bench_engine, "kvmesh vs HF transformers generate, batch 1 and 16"),
                            ("prefix", bench_prefix, "TTFT with a cached 1,024-token prefix vs cold"),
                            ("memory", bench_memory, "paged vs contiguous KV waste and capacity")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--json", type=Path, default=None, help="write the results here")
        p.add_argument("--quick", action="store_true", help="a small run (under a minute)")
        p.add_argument("--model", default="smollm2")
        p.add_argument("--seed", type=int, default=0)
        p.set_defaults(run=_runner(fn))


def _runner(fn: Callable[[argparse.Namespace], dict[str, Any]]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        result = fn(args)
        result["machine"] = machine_info()
        text = json.dumps(result, indent=2)
        print(text)
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(text + "\n")
        return 0
    return run


def machine_info() -> dict[str, Any]:
    import os

    import torch
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def _random_prompts(rng: random.Random, vocab: int, lengths: list[int]) -> list[list[int]]:
    # Token ids from the middle of the vocabulary (no special tokens), deterministic per seed.
    return [[rng.randrange(100, vocab - 100) for _ in range(n)] for n in lengths]


# -- engine ---------------------------------------------------------------------------------
def measure_roofline(weight_bytes: int, num_params: int) -> dict[str, float]:
    """Decode roofline of this machine: min(memory bandwidth / weight bytes, matmul flops / 2N)."""
    import torch
    src = torch.empty(64 * 2**20, dtype=torch.float32)       # 256 MiB, beyond any cache
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    bw = 5 * 2 * src.numel() * 4 / (time.perf_counter() - t)   # read + write bytes / s
    a = torch.randn(1024, 1024)
    b = torch.randn(1024, 1024)
    a @ b
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    flops = 10 * 2 * 1024**3 / (time.perf_counter() - t)
    return {"mem_bandwidth_gb_s": bw / 1e9, "matmul_gflop_s": flops / 1e9,
            "batch1_tok_s": min(bw / weight_bytes, flops / (2 * num_params)),
            "batch16_tok_s": min(16 * bw / weight_bytes, flops / (2 * num_params))}


def bench_engine(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from worker.engine import Engine, EngineConfig
    from worker.sampling import SamplingParams

    engine = Engine(EngineConfig(model=args.model, dtype="fp32"))
    hf = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=torch.float32).eval()
    vocab = engine.model_config.vocab_size
    rng = random.Random(args.seed)
    n1 = 32 if args.quick else 128
    batch_n = 16
    prompt_lens = [rng.randrange(16, 128 if args.quick else 256) for _ in range(batch_n)]
    out_lens = [rng.randrange(8, 32 if args.quick else 128) for _ in range(batch_n)]
    prompts = _random_prompts(rng, vocab, [64] + prompt_lens)
    p1, pb = prompts[0], prompts[1:]

    def kv_run(ps: list[list[int]], lens: list[int]) -> tuple[float, int]:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lens]
        engine.pool.reset_prefix_cache()
        t = time.perf_counter()
        outs = engine.generate(ps, params)
        return time.perf_counter() - t, sum(o.completion_tokens for o in outs)

    def hf_run(ps: list[list[int]], lens: list[int]) -> tuple[float, int]:
        # HF generate pads the batch (left) and runs every row to the longest requested output;
        # only the tokens each request asked for count as useful.
        width = max(len(p) for p in ps)
        pad = engine.model_config.eos_token_ids[0]
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        t = time.perf_counter()
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                        do_sample=False, pad_token_id=pad)
        return time.perf_counter() - t, sum(lens)

    kv_run([p1], [4])       # warm-up both
    hf_run([p1], [4])
    results: dict[str, Any] = {}
    for name, ps, lens in (("batch1", [p1], [n1]), ("batch16", pb, out_lens)):
        kt, kn = kv_run(ps, lens)
        ht, hn = hf_run(ps, lens)
        results[name] = {"kvmesh_tok_s": kn / kt, "hf_tok_s": hn / ht, "speedup": (kn / kt) / (hn / ht),
                         "kvmesh_s": kt, "hf_s": ht, "tokens": kn}
    mc = engine.model_config
    num_params = sum(w.numel() for w in hf.parameters())
    weight_bytes = num_params * 4
    roof = measure_roofline(weight_bytes, num_params)
    results["roofline_tok_s"] = roof["batch1_tok_s"]
    results["roofline"] = roof
    results["config"] = {"model": mc.name, "dtype": "fp32", "batch1_new_tokens": n1,
                         "batch16_prompt_lens": prompt_lens, "batch16_output_lens": out_lens}
    return results


# -- prefix ---------------------------------------------------------------------------------
def bench_prefix(args: argparse.Namespace) -> dict[str, Any]:
    from worker.engine import Engine, EngineConfig
    from worker.sampling import SamplingParams

    engine = Engine(EngineConfig(model=args.model))
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    prefix_len = 1024
    trials = 2 if args.quick else 5
    prefix = _random_prompts(rng, vocab, [prefix_len])[0]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def ttft(prompt: list[int]) -> float:
        t = time.perf_counter()
        engine.generate(prompt, one)
        return time.perf_counter() - t

    ttft(_random_prompts(rng, vocab, [64])[0])  # warm-up
    cold, warm = [], []
    for _ in range(trials):
        engine.pool.reset_prefix_cache()
        cold.append(ttft(prefix + _random_prompts(rng, vocab, [32])[0]))   # also fills the cache
        warm.append(ttft(prefix + _random_prompts(rng, vocab, [32])[0]))
    c, w = statistics.median(cold), statistics.median(warm)
    return {"cold_ttft_s": c, "warm_ttft_s": w, "speedup": c / w,
            "config": {"prefix_tokens": prefix_len, "suffix_tokens": 32, "trials": trials,
                       "block_size": engine.cfg.block_size}}


# -- memory ---------------------------------------------------------------------------------
def bench_memory(args: argparse.Namespace) -> dict[str, Any]:
    """Run a varied-length workload; measure allocated-but-unused KV slots at every step."""
    from worker.engine import Engine, EngineConfig
    from worker.sampling import SamplingParams

    rng = random.Random(args.seed)
    block_size = 16
    n_req = 16 if args.quick else 48
    max_len = 1024                               # what a contiguous allocator reserves per sequence
    engine = Engine(EngineConfig(model=args.model, block_size=block_size, max_model_len=max_len + 1))
    vocab = engine.model_config.vocab_size
    prompt_lens = [min(max_len - 64, int(rng.lognormvariate(5.0, 0.7))) + 8 for _ in range(n_req)]
    out_lens = [rng.randrange(8, 64 if args.quick else 128) for _ in range(n_req)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in out_lens]
    for p, sp in zip(_random_prompts(rng, vocab, prompt_lens), params):
        engine.add_request(p, sp)
    # Summed over every step: slots holding K/V, slots the pool allocated, and slots a
    # contiguous allocator would have reserved (max_len per running sequence).
    used = allocated = reserved = 0
    while engine.has_unfinished():
        engine.step()
        for req in engine.scheduler.running:
            used += req.num_computed_tokens
            allocated += len(req.block_ids) * block_size
            reserved += max_len
    paged_waste = 1 - used / allocated
    contiguous_waste = 1 - used / reserved
    final_lens = [p + o for p, o in zip(prompt_lens, out_lens)]
    mean_len = statistics.mean(final_lens)
    budget_tokens = engine.pool.num_blocks * block_size
    mean_blocks = statistics.mean(-(-n // block_size) for n in final_lens)
    paged_max = int(budget_tokens // (mean_blocks * block_size))
    contiguous_max = budget_tokens // max_len
    return {"paged_waste_frac": paged_waste, "contiguous_waste_frac": contiguous_waste,
            "paged_max_seqs": paged_max, "contiguous_max_seqs": contiguous_max,
            "capacity_gain": paged_max / contiguous_max,
            "config": {"block_size": block_size, "requests": n_req, "contiguous_max_len": max_len,
                       "mean_final_len": mean_len, "budget_tokens": budget_tokens}}
