"""`kvmesh bench transfer` — the KV store's data movement, each against a baseline in the same run.

1. Device↔host: `HostTier.offload` / `onload` of N scattered blocks against one raw tensor
   copy of the same bytes (`offload_vs_memcpy`, target >= 0.8), through the same native
   block copy the engine's host tier uses.
2. Peer: a `BlockTransfer` of N blocks over a gloo pair against one raw send of the same
   bytes on that pair (`peer_vs_raw`, target >= 0.7; `kvstore.transfer.cost.peer_vs_raw`,
   two processes), and the CPU time of each (both processes, every thread: `cpu_vs_raw`),
   which a shared box disturbs less than wall time.
3. TTFT of a prompt whose prefix (2,048 tokens; 1,024 with --quick) a peer holds: two
   `kvmesh worker --peer-transfer` processes; B serves it hinted to A (fetched, or
   recomputed if B's cost model says so), a same-length prompt nobody holds (recomputed), and
   the first prompt again (local hit). Target: fetched below recomputed whenever the cost
   model chooses fetch. The greedy first tokens are compared too.
4. Disk tier (`kvstore.disk`): N blocks written behind through the tier's queue and thread
   and read back by a read-ahead, against one plain sequential write / read of the same
   bytes to a file in the same directory (`disk.write_vs_raw`, `disk.read_vs_raw`, target
   >= 0.8; no fsync on either side: the page cache takes both), and the TTFT of a prompt
   whose 1,024-token prefix is read back from disk against the same-length prompt recomputed
   (`disk.ttft_speedup`, target >= 10), in one engine, greedy first tokens compared.
The numbers are wall-clock on whatever machine runs it: a shared box makes them noisy.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_WORKER_LINE = re.compile(r"^kvmesh worker (\S+) serving on (\S+):(\d+)$", re.M)
_GB = 1e9


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("transfer", help="device<->host offload and peer transfer vs raw copies; "
                                        "TTFT of a peer-held prefix: fetched vs recomputed vs local")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--quick", action="store_true", help="a smaller run (1,024-token prefix)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefix-tokens", type=int, default=None,
                   help="the peer-held prefix (default 2048; 1024 with --quick)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvmesh.bench.engine import emit, machine_info
    if args.prefix_tokens is not None and args.prefix_tokens < 16:
        from contracts.cli import CLIError
        raise CLIError(f"--prefix-tokens: {args.prefix_tokens} must be >= 16")
    result = bench_transfer(args)
    result["machine"] = machine_info()
    return emit(result, args.json)


def bench_transfer(args: argparse.Namespace) -> dict[str, Any]:
    from kvstore.layout import KVLayout, resolve_kv_cache_dtype
    from kvstore.tensors import KVTensors
    from kvstore.transfer.blocks import BlockSpec
    from worker.model.config import ModelConfig
    from worker.model.loader import resolve_model_dir

    model_dir = resolve_model_dir(args.model, progress=False)
    mc = ModelConfig.from_hf_dict(json.loads((model_dir / "config.json").read_text()))
    layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, 16, resolve_kv_cache_dtype("auto", "fp32"))
    offload = bench_offload(layout, 64 if args.quick else 256, 3 if args.quick else 5, args.seed)
    from kvstore.transfer.cost import peer_vs_raw
    from worker.kernels import native
    r = peer_vs_raw(BlockSpec.of(KVTensors(layout, 1).kv), 64 if args.quick else 128, 3 if args.quick else 5,
                    kernel_loader=native.checksum_kernel)   # as the workers' transfers hash
    peer = {"num_blocks": r.num_blocks, "num_bytes": r.num_bytes, "peer_gb_s": r.peer_bytes_s / _GB,
            "peer_alloc_gb_s": r.peer_alloc_bytes_s / _GB, "raw_gb_s": r.raw_bytes_s / _GB,
            "peer_vs_raw": r.ratio, "target": 0.7, "link_gb_s": r.link.bandwidth_bytes_s / _GB,
            "link_latency_us": r.link.latency_s * 1e6,
            "native_checksums": native.checksum_kernel() is not None,
            "peer_cpu_ms": r.peer_cpu_s * 1e3, "raw_cpu_ms": r.raw_cpu_s * 1e3,
            "cpu_vs_raw": r.raw_cpu_s / r.peer_cpu_s if r.peer_cpu_s > 0 else 0.0,
            "phases_ms": {k.removesuffix("_s"): v * 1e3 for k, v in r.phases._asdict().items()}}
    prefix = args.prefix_tokens or (1024 if args.quick else 2048)
    ttft = bench_ttft(args.model, prefix, args.seed, mc.vocab_size)
    from kvmesh.bench.transfer_disk import bench_disk
    disk = bench_disk(args.model, layout, 64 if args.quick else 256, 9 if args.quick else 15, args.seed,
                      1024, mc.vocab_size)
    return {"bench": "transfer", "model": mc.name, "quick": args.quick,
            "offload_vs_memcpy": offload["offload_vs_memcpy"], "peer_vs_raw": peer["peer_vs_raw"],
            "fetched_ttft_s": ttft["fetched_s"], "recomputed_ttft_s": ttft["recomputed_s"],
            "offload": offload, "peer": peer, "ttft": ttft, "disk": disk}


# -- device <-> host -------------------------------------------------------------------------
def bench_offload(layout: Any, num_blocks: int, repeats: int, seed: int) -> dict[str, Any]:
    """Offload `num_blocks` scattered device blocks into an empty host tier and onload them
    back, against `dst.copy_(src)` of the same bytes (medians; one copy of each per round)."""
    import torch

    from kvstore.keys import BlockHash
    from kvstore.tensors import KVTensors
    from kvstore.tiers import HostTier

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    pool = KVTensors(layout, 2 * num_blocks, device)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(seed)).to(pool.kv.dtype))
    ids = random.Random(seed).sample(range(2 * num_blocks), num_blocks)     # scattered, as evictions are
    hashes = [BlockHash(i + 1) for i in range(num_blocks)]
    from worker.kernels import native
    tier = HostTier(layout, num_blocks, pin_memory=cuda, copy_blocks=native.block_copier())  # as the engine builds it
    nbytes = num_blocks * layout.bytes_per_block
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=cuda)

    def timed(fn: Callable[[], None]) -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def offload() -> None:
        tier.offload(pool, ids, hashes)
        tier.fence()

    rounds = []
    for _ in range(repeats + 1):                                              # round 0 warms up
        tier.clear()
        rounds.append((timed(offload), timed(lambda: tier.onload(pool, hashes, ids)),
                       timed(lambda: dst.copy_(src))))
    assert torch.equal(tier.read(hashes), pool.gather_blocks(ids).cpu())    # the round trip is exact
    off, on, raw = (statistics.median(r[k] for r in rounds[1:]) for k in range(3))
    return {"num_blocks": num_blocks, "num_bytes": nbytes, "device": device,
            "offload_gb_s": nbytes / off / _GB, "onload_gb_s": nbytes / on / _GB, "memcpy_gb_s": nbytes / raw / _GB,
            "offload_vs_memcpy": raw / off, "onload_vs_memcpy": raw / on, "target": 0.8}


# -- TTFT of a peer-held prefix ----------------------------------------------------------------
def bench_ttft(model: str, prefix_tokens: int, seed: int, vocab: int) -> dict[str, Any]:
    import grpc

    from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc

    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(vocab // 4, vocab // 2) for _ in range(n)]  # noqa: E731
    held, fresh = tokens(prefix_tokens), tokens(prefix_tokens)
    suffix = tokens(16)
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-transfer-") as tmp:
        procs = [_spawn_worker(Path(tmp), model, i) for i in (0, 1)]
        try:
            a, b = (_wait_serving(p, Path(tmp) / f"w{i}") for i, p in enumerate(procs))
            channels = [grpc.insecure_channel(addr) for addr in (a, b)]
            stub_a, stub_b = (pb_grpc.WorkerStub(c) for c in channels)

            def first_token(stub: Any, prompt: list[int], hint: bool = False) -> tuple[float, pb.GenerateResponse]:
                req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                         sampling=pb.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
                if hint:
                    req.peer_hints.append(pb.PeerHint(worker_id="w0", address=a, num_blocks=len(prompt) // 16))
                t0 = time.perf_counter()
                msgs = list(stub.Generate(req, timeout=3600))
                return time.perf_counter() - t0, msgs[-1]

            first_token(stub_b, tokens(32))                                   # warm-up
            owner_s, owner = first_token(stub_a, held + suffix)               # A computes the prefix
            recomputed_s, _ = first_token(stub_b, fresh + suffix)             # nobody holds this one
            fetched_s, fetched = first_token(stub_b, held + suffix, hint=True)
            figures = stub_b.GetLoad(pb.LoadRequest()).peer
            local_s, local = first_token(stub_b, held + suffix)
            for c in channels:
                c.close()
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
    chose = figures.last_decision
    return {"prefix_tokens": prefix_tokens, "prompt_tokens": prefix_tokens + 16,
            "recomputed_s": recomputed_s, "fetched_s": fetched_s, "local_hit_s": local_s, "owner_cold_s": owner_s,
            "cost_model": {"decision": chose, "fetch_estimate_s": figures.last_fetch_estimate_s,
                           "recompute_estimate_s": figures.last_recompute_estimate_s,
                           "prefill_tokens_per_s": figures.prefill_tokens_per_s,
                           "link_gb_s": figures.links[0].bandwidth_bytes_s / _GB if figures.links else 0.0,
                           "pairs_formed": figures.pairs_formed,
                           "link_latency_us": figures.links[0].latency_s * 1e6 if figures.links else 0.0},
            "blocks_fetched": figures.blocks_fetched, "bytes_fetched": figures.bytes_fetched,
            "fetched_cached_tokens": fetched.cached_tokens, "fetched_peer_cached_tokens": fetched.peer_cached_tokens,
            "local_cached_tokens": local.cached_tokens,
            "first_token_equal": list(owner.token_ids) == list(fetched.token_ids) == list(local.token_ids),
            "fetch_beats_recompute": fetched_s < recomputed_s if chose == "fetch" else None}


def _spawn_worker(tmp: Path, model: str, i: int) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "kvmesh.cli", "worker", "--port", "0", "--worker-id", f"w{i}",
            "--model", model, "--peer-transfer"]
    with open(tmp / f"w{i}.out", "wb") as out, open(tmp / f"w{i}.log", "wb") as err:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                env=os.environ | {"PYTHONUNBUFFERED": "1"})


def _wait_serving(proc: subprocess.Popen[bytes], stem: Path, timeout_s: float = 600.0) -> str:
    deadline = time.monotonic() + timeout_s
    out = stem.with_suffix(".out")
    while (m := _WORKER_LINE.search(out.read_text(errors="replace"))) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = stem.with_suffix(".log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"worker {stem.name} did not start (rc {proc.poll()}):\n{tail}")
        time.sleep(0.1)
    return f"{m.group(2)}:{m.group(3)}"
