"""`kvmesh bench chaos --disagg`: the disaggregated scenario — a `kvmesh serve --prefill-workers 1
--decode-workers 2` (restart policy always, `--disagg-min-prompt-tokens` below every prompt)
under steady load, its prefill worker killed mid-hand-off and a decode worker killed mid-stream.

Load: `concurrency` closed-loop clients, each sending greedy streams (ignore_eos, `max_tokens`
tokens) of one of a fixed set of prompts long enough to take the prefill hop, each request with a
fresh `cache_salt` so that no worker holds its prompt and every request takes the hop (the salt
changes the block hashes only: the tokens are those of the same prompt without it). The baseline,
measured in the same run before any fault: each prompt once through the same cluster.

The schedule (seconds after the load starts): kill -9 the prefill worker (`kill9_prefill_mid_handoff`:
every request is on the hop, so hops are in flight; each costs at most --disagg-transfer-timeout-s
and its decode worker computes the prompt), then kill -9 a decode worker (`kill9_decode_mid_stream`:
its streams migrate to the other). Recovery: until the killed worker is back in routing. The
JSON has `kvmesh bench chaos`'s keys (`requests`, `completed`, `failed`, `hung`, `migrated`,
`outputs_equal_frac`, `recovery_s`, ...) and the router's hop counts over the load (`hops`:
handed off, failed by cause, skipped).
"""
from __future__ import annotations

import asyncio
import re
import shutil
import signal
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from kvmesh.bench.chaos_harness import Outcome, ServeProcess, run_streams, stream_once, wait_until, workers_up
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc

FAULTS = ("kill9_prefill_mid_handoff", "kill9_decode_mid_stream")
_FILLER = (" It was a long and quiet evening, and the keeper climbed the stairs to trim the wick, counting every "
           "step as his father had taught him, while the sea below turned from grey to black and the first ships "
           "of the night appeared on the horizon.")
PROMPTS = tuple(p + _FILLER for p in (
    "The history of the lighthouse begins", "A recipe for bread needs", "The three laws of motion say",
    "In a small village by the sea,", "The best way to learn a language is", "A paged KV cache works by"))
MIN_PROMPT_TOKENS = 16            # the router's --disagg-min-prompt-tokens: every prompt takes the hop
_HOPS = re.compile(r'^kvmesh:router_disagg_(handoffs|failures|skipped)_total(?:\{([^}]*)\})? (\S+)$', re.M)


class Run(NamedTuple):
    """What one run saw: the baseline per prompt, every request under load, each fault's
    recovery seconds, the router's hop counts over the load, and whether `kvmesh serve` lived."""

    baseline: dict[int, Outcome]
    outcomes: list[Outcome]
    recovery: dict[str, float | None]
    hops: dict[str, int]
    survived: bool


def run_disagg_chaos(quick: bool, concurrency: int, max_tokens: int, gap_s: float, request_timeout_s: float,
                     only: tuple[str, ...] = ()) -> dict[str, Any]:
    """The scenario of the module docstring, as JSON; `only` runs just those faults (by name)."""
    run = measure(concurrency, max_tokens, gap_s, request_timeout_s, only)
    done = [o for o in run.outcomes if o.ok]
    return {
        "scenario": "disaggregated",
        "requests": len(run.outcomes), "completed": len(done), "failed": sum(bool(o.error) for o in run.outcomes),
        "hung": sum(o.hung for o in run.outcomes), "migrated": sum(o.migrations > 0 for o in done),
        "outputs_equal_frac": (sum(o.tokens == run.baseline[o.prompt].tokens for o in done) / len(done)
                               if done else 0.0),
        "recovery_s": run.recovery, "hops": run.hops, "cluster_survived": run.survived,
        "errors": sorted({o.error for o in run.outcomes if o.error}),
        "config": {"quick": quick, "prefill_workers": 1, "decode_workers": 2, "concurrency": concurrency,
                   "max_tokens": max_tokens, "gap_s": gap_s, "min_prompt_tokens": MIN_PROMPT_TOKENS,
                   "schedule": list(run.recovery)},
    }


def measure(concurrency: int, max_tokens: int, gap_s: float, request_timeout_s: float,
            only: tuple[str, ...] = (), log_dir: Path | None = None) -> Run:
    """Start the cluster, take the baseline, run the load through the schedule, stop. The
    cluster's logs go to `log_dir` (kept), else to a temp dir (removed)."""
    keep = log_dir is not None
    log_dir = log_dir if log_dir is not None else Path(tempfile.mkdtemp(prefix="kvmesh-chaos-disagg-"))
    serve = ServeProcess(0, log_dir, ("--prefill-workers", "1", "--decode-workers", "2", "--restart-policy",
                                      "always", "--disagg-min-prompt-tokens", str(MIN_PROMPT_TOKENS)))
    schedule = [(name, fault) for name, fault in (("kill9_prefill_mid_handoff", 0), ("kill9_decode_mid_stream", 1))
                if not only or name in only]
    try:
        serve.start()
        baseline = asyncio.run(run_streams(serve.grpc_target, list(PROMPTS), max_tokens, request_timeout_s,
                                           list(range(len(PROMPTS)))))
        assert all(o.ok for o in baseline), [o for o in baseline if not o.ok]
        before = hop_counts(serve.http_base)
        outcomes, recovery = asyncio.run(_under_load(serve, schedule, concurrency, max_tokens, gap_s,
                                                     request_timeout_s))
        hops = {k: v - before.get(k, 0) for k, v in hop_counts(serve.http_base).items()}
        survived = serve.proc is not None and serve.proc.poll() is None
    finally:
        serve.stop()
        if not keep:
            shutil.rmtree(log_dir, ignore_errors=True)
    return Run({o.prompt: o for o in baseline}, outcomes, recovery, hops, survived)


async def _under_load(serve: ServeProcess, schedule: list[tuple[str, int]], concurrency: int, max_tokens: int,
                      gap_s: float, timeout_s: float) -> tuple[list[Outcome], dict[str, float | None]]:
    outcomes: list[Outcome] = []
    stop = asyncio.Event()

    async def client(c: int) -> None:
        async with grpc.aio.insecure_channel(serve.grpc_target) as ch:
            stub = pb_grpc.RouterStub(ch)
            i = c
            while not stop.is_set():
                p = i % len(PROMPTS)
                outcomes.append(await stream_once(stub, p, PROMPTS[p], max_tokens, timeout_s, uuid.uuid4().hex))
                i += concurrency

    clients = [asyncio.create_task(client(c)) for c in range(concurrency)]
    recovery: dict[str, float | None] = {}
    try:
        for name, index in schedule:
            await asyncio.sleep(gap_s)
            recovery[name] = await asyncio.to_thread(kill_and_wait_back, serve, f"worker-{index}")
        await asyncio.sleep(gap_s / 2)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*clients), timeout_s + 30)
    return outcomes, recovery


def kill_and_wait_back(serve: ServeProcess, name: str) -> float | None:
    """kill -9 `name` once it has requests running (a prefill worker: hops in flight; a decode
    worker: streams); seconds until its restart is back in the router's routing (None: not
    within 180 s)."""
    index = int(name.rsplit("-", 1)[1])
    wait_until(lambda: _busy(serve, index), 60, poll_s=0.05)
    before = serve.restarts(name)
    serve.kill(name, signal.SIGKILL)
    t0 = time.monotonic()
    if wait_until(lambda: serve.restarts(name) > before, 120) is None:
        return None
    back = wait_until(lambda: workers_up(serve.http_base).get(name, False), 180)
    return None if back is None else round(time.monotonic() - t0, 2)


def _busy(serve: ServeProcess, index: int) -> bool:
    """Worker `index` has a request running (False while it does not answer)."""
    try:
        with grpc.insecure_channel(serve.worker_addresses[index]) as ch:
            load = pb_grpc.WorkerStub(ch).GetLoad(pb.LoadRequest(), timeout=10, metadata=serve.worker_metadata)
    except grpc.RpcError:
        return False
    return load.num_running >= 1


def hop_counts(http_base: str) -> dict[str, int]:
    """The router's hop counters now: `handoffs`, `skipped`, and `failed:<cause>` per cause."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # loopback: never a proxy
    with opener.open(http_base.removesuffix("/v1") + "/metrics", timeout=30) as r:
        body = r.read().decode()
    out: dict[str, int] = {"handoffs": 0, "skipped": 0}
    for m in _HOPS.finditer(body):
        kind, labels, value = m.group(1), m.group(2) or "", int(float(m.group(3)))
        cause = re.search(r'cause="([^"]*)"', labels)
        key = f"failed:{cause.group(1)}" if kind == "failures" and cause else kind
        out[key] = out.get(key, 0) + value
    return out
