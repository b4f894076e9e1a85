"""`kvmesh bench engine|prefix|memory|accuracy|profile` — each measures kvmesh against a baseline in the same run.

Benchmarks are not tests: they print a table and write JSON (`--json PATH`). `--quick`
keeps each under a minute on a 2-core CPU.
"""
from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvmesh.bench.accuracy_text import accuracy_text, encode_text
from kvmesh.bench.engine_speed import bench_engine as run_engine_bench, random_prompts
from kvmesh.bench.profile import bench_profile
from kvmesh.bench.report import emit


def register(sub: argparse._SubParsersAction) -> None:
    for name, fn, help_ in (("engine", bench_engine, "kvmesh vs HF transformers generate, batch 1 and 16"),
                            ("prefix", bench_prefix, "TTFT with a cached 1,024-token prefix vs cold"),
                            ("memory", bench_memory, "paged vs contiguous KV waste and capacity"),
                            ("accuracy", bench_accuracy, "perplexity and greedy agreement per KV dtype vs fp32"),
                            ("profile", bench_profile, "batch-1 decode step breakdown, native kernels vs torch")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--json", type=Path, default=None, help="write the results here")
        p.add_argument("--quick", action="store_true", help="a small run (under a minute)")
        p.add_argument("--model", default="smollm2")
        p.add_argument("--seed", type=int, default=0)
        if name == "engine":
            p.add_argument("--device", default="cpu",
                           help="cpu (fp32, the default) | cuda[:N] (bf16; HF on the same GPU in bf16)")
            p.add_argument("--attention-backend", default="auto", help="auto | torch | native | triton")
            p.add_argument("--enforce-eager", action="store_true", help="CUDA: no decode CUDA graphs")
            p.add_argument("--weight-dtype", default="auto", choices=["auto", "fp32", "bf16", "q8_0", "q4_0", "q4_1"],
                           help="CPU: the engine's weight format (auto: the checkpoint's own, the shipped Q4_1)")
            p.add_argument("--threads", type=int, default=0, help="the engine's CPU threads (0: torch's default)")
            p.add_argument("--llama-cpp", type=Path, default=None,
                           help="a folder with llama.cpp's llama-batched-bench (scripts/build-llama-cpp builds one): "
                                "run it on the same GGUF and threads, side by side")
        if name == "accuracy":
            p.add_argument("--text", type=Path, default=None,
                           help="score this UTF-8 text file instead of the interpreter's LICENSE.txt")
            p.add_argument("--llama-cpp", type=Path, default=None,
                           help="a folder with llama.cpp's llama-perplexity (scripts/build-llama-cpp): the weight "
                                "axis also runs it on the GGUF of each format, same text and window")
        p.set_defaults(run=_runner(fn))


def _runner(fn: Callable[[argparse.Namespace], dict[str, Any]]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        result = fn(args)
        result["machine"] = machine_info()
        return emit(result, args.json)
    return run


def machine_info() -> dict[str, Any]:
    import os

    import torch
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


# -- engine ---------------------------------------------------------------------------------
def bench_engine(args: argparse.Namespace) -> dict[str, Any]:
    return run_engine_bench(args)


# -- prefix ---------------------------------------------------------------------------------
def bench_prefix(args: argparse.Namespace) -> dict[str, Any]:
    from worker.engine.engine import Engine, EngineConfig
    from worker.engine.sampling import SamplingParams

    engine = Engine(EngineConfig(model=args.model))
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    prefix_len = 1024
    trials = 2 if args.quick else 5
    prefix = random_prompts(rng, vocab, [prefix_len])[0]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def ttft(prompt: list[int]) -> float:
        t = time.perf_counter()
        engine.generate(prompt, one)
        return time.perf_counter() - t

    ttft(random_prompts(rng, vocab, [64])[0])  # warm-up
    cold, warm = [], []
    for _ in range(trials):
        engine.store.reset_prefix_cache()
        cold.append(ttft(prefix + random_prompts(rng, vocab, [32])[0]))   # also fills the cache
        warm.append(ttft(prefix + random_prompts(rng, vocab, [32])[0]))
    c, w = statistics.median(cold), statistics.median(warm)
    return {"cold_ttft_s": c, "warm_ttft_s": w, "speedup": c / w,
            "config": {"prefix_tokens": prefix_len, "suffix_tokens": 32, "trials": trials,
                       "block_size": engine.cfg.block_size}}


# -- memory ---------------------------------------------------------------------------------
def bench_memory(args: argparse.Namespace) -> dict[str, Any]:
    """Run a varied-length workload; measure allocated-but-unused KV slots at every step."""
    from worker.engine.engine import Engine, EngineConfig
    from worker.engine.request import prompt_input
    from worker.engine.sampling import SamplingParams

    rng = random.Random(args.seed)
    block_size = 16
    n_req = 16 if args.quick else 48
    max_len = 1024                               # what a contiguous allocator reserves per sequence
    engine = Engine(EngineConfig(model=args.model, block_size=block_size, max_model_len=max_len + 1))
    vocab = engine.model_config.vocab_size
    prompt_lens = [min(max_len - 64, int(rng.lognormvariate(5.0, 0.7))) + 8 for _ in range(n_req)]
    out_lens = [rng.randrange(8, 64 if args.quick else 128) for _ in range(n_req)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in out_lens]
    for p, sp in zip(random_prompts(rng, vocab, prompt_lens), params):
        engine.add_request(prompt_input(p, sp))
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
    budget_tokens = engine.store.num_blocks * block_size
    mean_blocks = statistics.mean(-(-n // block_size) for n in final_lens)
    paged_max = int(budget_tokens // (mean_blocks * block_size))
    contiguous_max = budget_tokens // max_len
    budget_bytes = engine.store.num_blocks * engine.layout.bytes_per_block
    return {"paged_waste_frac": paged_waste, "contiguous_waste_frac": contiguous_waste,
            "paged_max_seqs": paged_max, "contiguous_max_seqs": contiguous_max,
            "capacity_gain": paged_max / contiguous_max,
            "per_dtype": capacity_per_dtype(engine.layout, budget_bytes, mean_blocks),
            "config": {"block_size": block_size, "requests": n_req, "contiguous_max_len": max_len,
                       "mean_final_len": mean_len, "budget_tokens": budget_tokens,
                       "budget_bytes": budget_bytes, "kv_cache_dtype": engine.layout.kv_cache_dtype}}


def capacity_per_dtype(layout: Any, budget_bytes: int, mean_blocks: float) -> dict[str, dict[str, Any]]:
    """Sequences of `mean_blocks` blocks each admitted in `budget_bytes` for every KV dtype.

    Same model shape and block size as `layout` (a `KVLayout`); quantized dtypes pay their
    scale bytes, so int8 admits a little under 2x fp16 and int4 under 4x.
    """
    import dataclasses

    from kvstore.layout import KV_CACHE_DTYPES
    out: dict[str, dict[str, Any]] = {}
    for dtype in (d for d in KV_CACHE_DTYPES if d != "auto"):
        lay = dataclasses.replace(layout, kv_cache_dtype=dtype)
        blocks = lay.num_blocks_in(budget_bytes)
        out[dtype] = {"bytes_per_token": lay.bytes_per_token, "num_blocks": blocks,
                      "max_seqs": int(blocks // mean_blocks)}
    fp16 = out["fp16"]["max_seqs"]
    for row in out.values():
        row["capacity_vs_fp16"] = row["max_seqs"] / fp16 if fp16 else None
    return out


# -- accuracy -------------------------------------------------------------------------------
def accuracy_configs(window_tokens: int) -> list[tuple[str, dict[str, Any]]]:
    """(name, EngineConfig overrides) of every configuration the accuracy bench scores.

    The FIRST is the baseline every other is compared with (fp32 KV). `window_tokens` is the
    perplexity window, for configurations whose budget is a fraction of the text; token
    eviction configs keep a fraction of it (`streaming-50`: StreamingLLM at 50% of the text);
    their perplexity is scored in block-size chunks so that eviction happens (`Engine.score`).
    """
    dtypes = [(d, {"kv_cache_dtype": d}) for d in ("fp32", "fp16", "bf16", "fp8", "int8", "int4")]
    dtypes.append(("int4-uncalibrated", {"kv_cache_dtype": "int4", "kv_calibration": False}))
    eviction = [(f"{policy}-{pct}", {"kv_eviction": policy, "kv_budget": window_tokens * pct // 100,
                                     "attention_sinks": 4})
                for pct in (50, 25) for policy in ("streaming", "h2o")]
    eviction.append(("h2o-50-nodecay", dict(eviction[1][1], h2o_decay=1.0)))
    return dtypes + eviction


def perplexity(engine: Any, ids: list[int]) -> tuple[float, list[int]]:
    """exp(mean next-token NLL) of `ids` and the argmax at each position, teacher-forced in one
    prefill through the engine's KV cache (K/V are written — quantized if so — then read back)."""
    import torch
    import torch.nn.functional as F
    logits = engine.logits(ids)  # [T, vocab] fp32
    nll = F.cross_entropy(logits[:-1], torch.tensor(ids[1:], device=logits.device))
    return float(torch.exp(nll)), logits[:-1].argmax(-1).tolist()


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    return same / sum(len(r) for r in a)


def bench_accuracy(args: argparse.Namespace) -> dict[str, Any]:
    """Per KV configuration: perplexity on a real text, greedy agreement and bytes per token."""
    import gc

    import torch

    from worker.engine.engine import Engine, EngineConfig
    from worker.engine.sampling import SamplingParams

    text, source, text_path = accuracy_text(args.text)
    window = 512 if args.quick else 2048
    gen_len = 64 if args.quick else 256
    prompt_len, num_prompts, block_size = 64, 4, 16
    num_blocks = -(-window // block_size) + num_prompts * -(-(prompt_len + gen_len) // block_size) + 8
    base = dict(model=args.model, dtype="fp32", weight_dtype="fp32", block_size=block_size, num_blocks=num_blocks)
    greedy = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    results: dict[str, Any] = {}
    configs = accuracy_configs(window)
    base_ppl = 0.0
    base_outs: list[list[int]] = []     # the baseline's own greedy continuations
    base_forced: list[list[int]] = []   # the baseline's argmax along them, teacher-forced
    base_text_argmax: list[int] = []    # the baseline's argmax along the text
    for name, overrides in configs:
        engine = Engine(EngineConfig(**(base | overrides)))
        ids = encode_text(engine, text)
        if len(ids) < window + 1:
            from contracts.cli import CLIError
            raise CLIError(f"--text: {source} has {len(ids)} tokens; the window needs {window + 1}")
        step = (len(ids) - prompt_len) // num_prompts
        prompts = [ids[i * step:i * step + prompt_len] for i in range(num_prompts)]  # evenly spaced spans
        if engine.evictor is None:
            ppl, text_argmax = perplexity(engine, ids[:window])
        else:
            sc = engine.score(ids[:window], block_size)
            ppl, text_argmax = float(torch.exp(sc.nll.mean())), sc.argmax.tolist()
        if not base_text_argmax:
            base_text_argmax = text_argmax
        if engine.evictor is not None:
            # the generation runs stay under the budget, where eviction never acts: the
            # agreement that sees eviction is the teacher-forced one along the text
            results[name] = {"ppl": ppl, "ppl_delta_frac": ppl / base_ppl - 1,
                             "token_agreement": _agreement([base_text_argmax], [text_argmax]),
                             "text_agreement": _agreement([base_text_argmax], [text_argmax]),
                             "bytes_per_token": engine.layout.bytes_per_token,
                             "kv_cache_dtype": engine.layout.kv_cache_dtype,
                             "kv_budget_tokens": engine.cfg.kv_budget,
                             "kv_tokens_frac": engine.cfg.kv_budget / window,
                             "compactions": engine.evictor.num_compactions}
            del engine
            gc.collect()
            continue
        outs = [list(o.token_ids) for o in engine.generate(prompts, greedy)]
        if not base_outs:
            base_ppl, base_outs = ppl, outs
        forced = [engine.logits(p + o)[len(p) - 1:-1].argmax(-1).tolist() for p, o in zip(prompts, base_outs)]
        if not base_forced:
            base_forced = forced
        first_diff = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), len(r))
                      for r, o in zip(base_outs, outs)]
        results[name] = {"ppl": ppl, "ppl_delta_frac": ppl / base_ppl - 1,
                         "token_agreement": _agreement(base_forced, forced),
                         "text_agreement": _agreement([base_text_argmax], [text_argmax]),
                         "free_running_agreement": _agreement(base_outs, outs),
                         "mean_first_divergence": statistics.mean(first_diff),
                         "bytes_per_token": engine.layout.bytes_per_token,
                         "kv_cache_dtype": engine.layout.kv_cache_dtype,
                         "kv_budget_tokens": engine.cfg.kv_budget}
        del engine
        gc.collect()
    from kvmesh.bench.accuracy_weights import bench_weight_axis

    results["weights"] = bench_weight_axis(args, text, text_path)
    return {**results, "notes": {
        "baseline": f"{configs[0][0]!r}; every config runs the fp32 model, only the KV cache differs",
        "weights": "the weight-dtype axis: perplexity per weight format (kvmesh/bench/accuracy_weights.py)",
        "text": f"{source} ({len(text)} characters)",
        "ppl": f"exp(mean next-token NLL) over the first {window} tokens of the text, teacher-forced "
               "(one prefill through the paged KV cache; K/V are written, quantized if so, then read)",
        "ppl_delta_frac": "ppl / baseline ppl - 1",
        "token_agreement": f"greedy-token agreement, teacher-forced: the baseline generates {gen_len} greedy "
                           f"tokens after each of {num_prompts} prompts ({prompt_len}-token spans of the text, "
                           "evenly spaced); each config is fed the same prompt + continuation, and this is the "
                           "fraction of those positions where its argmax equals the baseline's (pooled). "
                           "One different choice counts once, not for every token after it",
        "free_running_agreement": f"each config generates its own {gen_len} greedy tokens; fraction of positions "
                                  "equal to the baseline's at the same index (after a first difference the "
                                  "texts usually part, so one early near-tie costs most of the score)",
        "mean_first_divergence": "mean index of the first generated token that differs (gen length if none)",
        "text_agreement": "fraction of the ppl text's positions where the config's teacher-forced argmax equals "
                          "the baseline's. For eviction configs token_agreement is this figure: their "
                          "generation runs would stay under the budget, where eviction never acts, so they "
                          "are not run",
        "eviction": f"streaming-P / h2o-P keep P% of the {window}-token text (kv_budget), 4 attention sinks; "
                    f"ppl is scored {block_size} tokens at a time, compacting to the budget whenever a sequence "
                    "reaches budget + block_size; H2O keeps half of the non-sink budget as recent tokens and the "
                    "rest by the attention they received (summed over layers and heads) per query that read them, "
                    "each query weighted h2o_decay (0.98) less per step in the past",
        "h2o-50-nodecay": "h2o-50 with h2o_decay=1: every query's attention counts the same",
        "int4-uncalibrated": ("int4 without the per-channel key scales and shift of worker.model.calibration "
                              "(int4 has them)"),
        "bytes_per_token": "KVLayout.bytes_per_token: all layers, K and V, values plus scales"},
        "config": {"model": args.model, "window_tokens": window, "generated_tokens": gen_len,
                   "prompts": num_prompts, "prompt_tokens": prompt_len, "block_size": block_size}}
