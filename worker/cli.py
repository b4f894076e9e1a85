"""CLI front of the worker: engine flags shared by every command, and `kvmesh generate`."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from contracts.cli import CLIError, flagify
from contracts.sampling import SamplingParams
from kvstore.layout import KV_CACHE_DTYPES
from worker.model.config import ModelLoadError

if TYPE_CHECKING:   # imports torch: the CLI imports it when a command builds an engine
    from worker.engine.engine import EngineConfig


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="smollm2",
                   help="'smollm2' (the default, shipped in a wheel), an HF model dir, or a .gguf file")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    g.add_argument("--dtype", default="auto", choices=["auto", "fp32", "fp16", "bf16"])
    g.add_argument("--weight-dtype", default="auto", choices=["auto", "fp32", "bf16", "q8_0", "q4_0", "q4_1"],
                   help="how the linear weights and the embedding are held and read on CPU: auto = the "
                        "checkpoint's own format (the shipped GGUF: Q4_1 layers, Q8_0 embedding), or "
                        "fp32 | bf16 | q8_0 | q4_0 | q4_1 (an HF dir is quantized at load). CUDA: the --dtype")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES))
    g.add_argument("--kv-cache-memory-gib", type=float, default=1.0, help="KV pool size (GiB)")
    g.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (overrides the GiB figures)")
    g.add_argument("--memory-gib", type=float, default=None,
                   help="the worker's memory for weights, KV pool and activations (GiB): the pool gets what the "
                        "weights, at their real size (a Q4 model's are ~1/6 of fp32), and an activation reserve "
                        "leave of it, instead of --kv-cache-memory-gib (like vLLM's --gpu-memory-utilization)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--fair-share", default="on", choices=["on", "off"],
                   help="share prefill between tenants by weight while they contend (keys file weight=)")
    g.add_argument("--fair-step-tokens", type=int, default=16,
                   help="prefill tokens per step while tenants contend (shorter steps: a light tenant waits less)")
    g.add_argument("--tenant-max-cached-frac", type=float, default=0.5,
                   help="a tenant's cached blocks in each KV tier (device pool, host, disk), as a fraction of the "
                        "tier, past which that tier evicts its own first (keys file max_cached_blocks= overrides)")
    g.add_argument("--room-wait-steps", type=int, default=32,
                   help="steps a waiting request may be put off when its blocks would evict a shared prefix "
                        "while the running requests will free as many of their own (0 = never wait)")
    g.add_argument("--kv-offload-gib", type=float, default=0.0,
                   help="host-memory KV tier behind the pool (GiB); evicted prefix blocks go there "
                        "instead of being dropped (vLLM: --kv-offloading-size). 0 = off")
    g.add_argument("--kv-disk-path", default=None,
                   help="directory of a disk KV tier below the host tier: blocks the host tier evicts are "
                        "written there behind the engine and read back for a later prefix; reopened after a "
                        "restart (needs --kv-offload-gib and --kv-disk-gib)")
    g.add_argument("--kv-disk-gib", type=float, default=0.0, help="size bound of the disk KV tier (GiB)")
    g.add_argument("--kv-disk-write-through", action=argparse.BooleanOptionalAction, default=True,
                   help="queue every block the device pool caches for the disk tier at once, so that a worker "
                        "killed with -9 finds its prefixes on disk at restart (default on); --no-kv-disk-write-"
                        "through: only blocks the host tier evicts")
    g.add_argument("--kv-eviction", default="none", choices=["none", "streaming", "h2o"],
                   help="token eviction inside each sequence's KV (StreamingLLM / H2O); needs --kv-budget")
    g.add_argument("--kv-budget", type=int, default=None, help="tokens of KV each sequence keeps under --kv-eviction")
    g.add_argument("--attention-sinks", type=int, default=4, help="first tokens always kept under --kv-eviction")
    g.add_argument("--h2o-decay", type=float, default=0.98,
                   help="--kv-eviction h2o: each older query's attention counts this much less per step "
                        "(1 = the paper's plain accumulation)")
    g.add_argument("--attention-backend", default="auto",
                   help="auto | torch | native | triton: the attention kernels (auto: triton on CUDA, "
                        "native on CPU when built, else torch)")
    g.add_argument("--threads", type=int, default=0,
                   help="CPU threads for the engine's ops (torch.set_num_threads); 0 = torch's default, every "
                        "core the process may use. `kvmesh serve --workers N` gives each local worker "
                        "its share of the cores unless this is set")
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False,
                   help="CUDA: run decode eagerly instead of replaying captured CUDA graphs")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    from worker.engine.engine import EngineConfig  # torch: only when a command builds an engine
    try:
        return EngineConfig(model=args.model, dtype=args.dtype, weight_dtype=args.weight_dtype,
                            device=args.device, block_size=args.block_size,
                            kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory_gib=args.kv_cache_memory_gib,
                            num_blocks=args.num_blocks, memory_gib=args.memory_gib,
                            enable_prefix_caching=args.enable_prefix_caching,
                            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                            max_model_len=args.max_model_len, fair_share=args.fair_share == "on",
                            fair_step_tokens=args.fair_step_tokens,
                            tenant_max_cached_frac=args.tenant_max_cached_frac, kv_offload_gib=args.kv_offload_gib,
                            kv_disk_path=args.kv_disk_path, kv_disk_gib=args.kv_disk_gib,
                            kv_disk_write_through=args.kv_disk_write_through,
                            kv_eviction=args.kv_eviction, kv_budget=args.kv_budget,
                            attention_sinks=args.attention_sinks, h2o_decay=args.h2o_decay,
                            attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
                            threads=args.threads, room_wait_steps=args.room_wait_steps)
    except ValueError as e:
        raise CLIError(flagify(str(e))) from None


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default here)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, min_p=args.min_p, seed=args.seed,
                              repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                              frequency_penalty=args.frequency_penalty, stop=tuple(args.stop),
                              ignore_eos=args.ignore_eos)
    except ValueError as e:
        raise CLIError(flagify(str(e))) from None


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as one user message in the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_sampling_arguments(p)
    add_engine_arguments(p)


def run_generate(args: argparse.Namespace) -> int:
    from worker.engine.engine import Engine, InvalidRequest  # torch: only when the command runs
    if args.prompt_file is not None:
        try:
            prompt = args.prompt_file.read_text()
        except OSError as e:
            raise CLIError(f"--prompt-file: cannot read {args.prompt_file}: {e.strerror}") from None
    else:
        prompt = args.prompt
    if not prompt:
        raise CLIError("--prompt: the prompt is empty")
    params = sampling_params_from_args(args)
    cfg = engine_config_from_args(args)
    try:
        engine = Engine(cfg)
    except ModelLoadError as e:
        raise CLIError(f"--model: {e}") from None
    except ValueError as e:  # a setting this model or device cannot run, e.g. --attention-backend triton on CPU
        raise CLIError(flagify(str(e))) from None
    try:
        ids = engine.apply_chat_template([{"role": "user", "content": prompt}]) if args.chat else engine.encode(prompt)
        if args.json:
            out = engine.generate(ids, params)[0]
            print(json.dumps({"token_ids": list(out.token_ids), "text": out.text, "finish_reason": out.finish_reason,
                              "num_cached_tokens": out.num_cached_tokens, "prompt_tokens": out.prompt_tokens,
                              "completion_tokens": out.completion_tokens}))
            return 0
        for out in engine.stream(ids, params):
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    except InvalidRequest as e:
        raise CLIError(f"--prompt: {e}") from None
