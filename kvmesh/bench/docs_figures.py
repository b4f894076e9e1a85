"""The headline figures of each `kvmesh bench` result, against the baseline it measured in the
same run: one extractor per bench (what `kvmesh bench docs` renders; the engine benches' in
`kvmesh/bench/docs_figures_engine.py`, the cluster benches' in `kvmesh/bench/docs_figures_cluster.py`).
A figure missing from a result renders as a dash; nothing here raises on a partial result."""

from __future__ import annotations

from typing import Any

from kvmesh.bench.docs_figures_cluster import CLUSTER_EXTRACT
from kvmesh.bench.docs_figures_disagg import DISAGG_EXTRACT
from kvmesh.bench.docs_figures_engine import ENGINE_EXTRACT
from kvmesh.bench.docs_figures_fmt import Extract, Figure, _g, _num
from kvmesh.bench.docs_figures_restart import RESTART_EXTRACT

__all__ = ["BENCHES", "EXTRACT", "bench_of", "figures_of"]

BENCHES: dict[str, str] = {
    "engine": "kvmesh vs HF transformers `generate` (same weights, prompts, dtype) at batch 1 and 16; each "
    "against the roofline of the same workload measured on the machine in the same run; a cold "
    "1,024-token prefill against the measured matmul peak; worker metrics on vs off",
    "profile": "a batch-1 decode step with the native kernels vs `KVMESH_NATIVE_KERNELS=0` (torch), each in "
    "its own process: step time, the linear layers alone and the GB/s they stream",
    "prefix": "TTFT of a 1,024-token cached prefix + 32-token suffix vs the same prompt cold",
    "memory": "KV slots wasted by a varied-length workload, paged (block 16) vs contiguous at 1,024 tokens; "
    "sequences that fit in the same budget, per KV dtype",
    "accuracy": "perplexity on a real text and teacher-forced greedy agreement per KV dtype and token-eviction "
    "policy vs the fp32 cache",
    "transfer": "host-tier offload/onload vs a raw copy of the same bytes; peer transfer (gloo, 2 processes) vs "
    "one raw `torch.distributed` send; TTFT of a peer-held prefix fetched vs recomputed; the disk tier's "
    "write-behind and read-back vs plain sequential file I/O, and a prefix read back from disk vs recomputed",
    "router": "simulated Zipf multi-tenant trace: each policy's hit rate vs an oracle pool and round robin at "
    "4/8/16 workers; routing-live's scenarios simulated; then (without `--no-live`) 3 live workers",
    "service": "closed-loop chat load through the router to 2 workers vs straight to 1 worker",
    "routing-live": "each policy on a fresh 2-worker cluster through the OpenAI HTTP API, with and without KV "
    "pressure, vs round robin in the same run",
    "chaos": "kill / partition schedule on a 3-worker `kvmesh serve` under load vs each prompt run once "
    "before any fault",
    "tenants": "alpha's short shared prompt every 0.3 s while beta floods long distinct prompts, on a 2-worker "
    "`kvmesh serve --api-keys-file`, with fair share and KV caps vs without, each vs alpha alone in the same run",
    "scale": "N synthetic workers publishing real registry records and KV event streams to a real Redis, the "
    "router's real consumer, block index and policy in one process; the legacy index in the same run",
    "disagg": "1 prefill + 1 decode worker vs 2 mixed workers, each pinned to its own core, under decoding streams "
    "while long uncached prompts arrive at a steady rate; a sweep of prompt length x arrival rate for the crossover; "
    "the same disaggregated cluster with every prompt skipping the hop, for the router's skip threshold; the decode "
    "worker's step time per prompt-token budget",
    "restart": "2 workers + router + Redis on a shared-prefix workload; kill -9 and restart, SIGTERM drain, "
    "scale-out by one; the cached-token fraction after each event vs before, with and without the disk tier + "
    "drain hand-over + warm start",
}


def _generic(r: dict[str, Any]) -> tuple[str, list[Figure]]:
    return "as recorded in the file", [Figure(k, _g(v), "", "") for k, v in r.items() if _num(v) is not None]


EXTRACT: dict[str, Extract] = {**ENGINE_EXTRACT, **CLUSTER_EXTRACT, **DISAGG_EXTRACT, **RESTART_EXTRACT}


def bench_of(meta: dict[str, Any], result: dict[str, Any]) -> str:
    """The bench that wrote `result`: `meta.bench`, else recognised by its keys."""
    if meta.get("bench") in EXTRACT:
        return str(meta["bench"])
    keys = set(result)
    for bench, need in (
        ("engine", {"batch1", "batch16"}),
        ("prefix", {"warm_ttft_s"}),
        ("memory", {"paged_waste_frac"}),
        ("profile", {"native", "torch", "speedup"}),
        ("transfer", {"peer_vs_raw"}),
        ("router", {"simulation"}),
        ("service", {"router_2_workers"}),
        ("disagg", {"mixed", "disaggregated", "crossover"}),
        ("chaos", {"outputs_equal_frac"}),
        ("tenants", {"fair", "unfair"}),
        ("restart", {"with", "without", "window_s"}),
        ("scale", {"runs", "bottleneck"}),
    ):
        if need <= keys:
            return bench
    if keys & {"no_pressure", "pressure"}:
        return "routing-live"
    if any(isinstance(v, dict) and "ppl_delta_frac" in v for v in result.values()):
        return "accuracy"
    return "unknown"


def figures_of(bench: str, result: dict[str, Any]) -> tuple[str, list[Figure]]:
    """(the baseline in words, the headline figures) of `result`, written by `bench`."""
    return EXTRACT.get(bench, _generic)(result)
