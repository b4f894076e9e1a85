"""Prometheus metrics of one worker, under vLLM's names with the `kvmesh:` prefix.

Owner: `WorkerServer` builds one `WorkerMetrics` per process with its own `CollectorRegistry`
(no module globals, so tests build as many as they like) and feeds it from two places:
- `observe_finished(out)`: every finished `RequestOutput` (counters of tokens, prefix-cache
  queries/hits in tokens as vLLM counts them, success by finish reason, and the latency
  histograms from its `RequestTimings`);
- `observe_aborted()`: a request whose caller cancelled it mid-stream (no final output):
  success with finish reason `abort`;
- `token_gaps()`: one `TokenGaps` per request stream, fed every output: one inter-token
  latency observation per generated token after the first, as vLLM observes them per step;
- `observe_peer_fetch(s)`: the duration of each peer fetch (the peer plane's `fetch_observer`);
- `observe_handoff(...)` / `observe_handoff_failed(cause)` / `observe_prefill_only()`: the
  disaggregated hand-off as the decode worker saw it (bytes, seconds, why one failed), and the
  prefill-only requests a prefill worker finished; the worker's role is a label of
  `kvmesh:worker_role_info` and `kvmesh:role_queue_length`;
- `update_stats(stats, peer)`: the latest engine `Snapshot` (`EngineStats`) and peer-plane
  counters, read by a collector at scrape time (gauges, and counters the engine keeps cumulative).
worker/server/metrics_http.py's `MetricsHTTP` serves the registry on `/metrics`, with the probes.
Torch-free: the server imports it before the engine is loaded.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from worker.engine.commands import Snapshot

if TYPE_CHECKING:
    from kvstore.disk_stats import DiskTierStats
    from worker.engine.async_engine import AsyncEngine
    from worker.engine.config import EngineStats
    from worker.engine.engine import Engine
    from worker.engine.request import RequestOutput
    from worker.engine.sampling import SamplingParams
    from worker.peer.config import PeerCounters
    from worker.peer.plane import PeerPlane

LABELS = ("model_name", "worker_id")
# vLLM's buckets for request-level latencies (seconds)
_REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_HANDOFF_BYTE_BUCKETS = tuple(float(2 ** k) for k in range(16, 34, 2))   # 64 KiB .. 8 GiB
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)


class PeerTotals(NamedTuple):
    """The peer plane's cumulative counters, as the metrics need them."""

    fetched: int          # fetch decisions whose blocks arrived
    recomputed: int       # decisions to recompute instead of fetching
    checksum_failed: int  # blocks that failed their checksum
    peer_lost: int        # fetches that failed (peer unreachable / timed out)
    bytes_fetched: int

    @classmethod
    def from_counters(cls, c: PeerCounters) -> PeerTotals:
        return cls(max(c.fetch_decisions - c.fetch_failures, 0), c.recompute_decisions, c.blocks_bad,
                   c.fetch_failures, c.bytes_fetched)


class WorkerMetrics:
    """Every worker metric that the engine can feed, in one registry.
    `observe_finished` is called from the serving loop; `update_stats` from the same loop;
    scrapes run on the HTTP thread, so the shared snapshot is swapped under a lock."""

    def __init__(self, model_name: str, worker_id: str, kv_cache_dtype: str,
                 registry: CollectorRegistry | None = None, *, block_size: int = 16,
                 eviction_policy: str = "none", role: str = "mixed") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.labels = (model_name, worker_id)
        self.kv_cache_dtype = kv_cache_dtype
        self.block_size = block_size
        self.eviction_policy = eviction_policy   # the engine's kv_eviction (token eviction)
        self.role = role                         # kvmesh worker --role
        self._lock = threading.Lock()
        self._stats: EngineStats | None = None
        self._peer: PeerTotals | None = None
        r = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"kvmesh:{name}", doc, LABELS + extra, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"kvmesh:{name}", doc, LABELS, buckets=buckets, registry=r)

        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests")
        self.success = counter("request_success", "Finished requests by finish reason", ("finished_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token", _REQUEST_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between consecutive output tokens, one observation per token gap",
                             _TOKEN_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish", _REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first admission", _REQUEST_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "First admission to first token",
                                 _REQUEST_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "First token to last token", _REQUEST_BUCKETS)
        self.peer_fetch = histogram("peer_fetch_seconds", "Duration of one peer fetch (plan to blocks staged)",
                                    _REQUEST_BUCKETS)
        self.handoff_seconds = histogram("handoff_seconds", "Disaggregated hand-off on the decode worker: from "
                                         "the request's arrival (the prefill worker still computing) to the "
                                         "last of the prompt's blocks received", _REQUEST_BUCKETS)
        self.handoff_bytes = Histogram("kvmesh:handoff_bytes", "KV bytes one hand-off moved to this decode worker",
                                       LABELS, buckets=_HANDOFF_BYTE_BUCKETS, registry=r)
        self.handoff_failures = counter("handoff_failures", "Hand-offs that brought no usable block, by cause "
                                        "(the request then computes its prompt here)", ("cause",))
        self.prefill_only = counter("prefill_only_requests", "Prefill-only requests finished (prefill role)")
        self.handed_over = counter("kv_blocks_handed_over", "KV blocks peers pulled from this worker while it "
                                   "drained (its hottest, by recent prefix hits)")
        self.warmed = counter("kv_blocks_warmed", "KV blocks this worker pulled from its peers' hottest after it "
                              "turned ready (warm start)")
        self._itl_child = self.itl.labels(*self.labels)
        r.register(_StatsCollector(self))

    @classmethod
    def for_engine(cls, engine: Engine, worker_id: str, registry: CollectorRegistry | None = None,
                   role: str = "mixed") -> WorkerMetrics:
        """The metrics of `engine` (its model, KV dtype, block size and eviction policy)."""
        return cls(engine.model_config.name, worker_id, engine.layout.kv_cache_dtype, registry,
                   block_size=engine.cfg.block_size, eviction_policy=engine.cfg.kv_eviction, role=role)

    def token_gaps(self) -> TokenGaps:
        """The inter-token observer of one request stream (feed it every output)."""
        return TokenGaps(self._itl_child)

    def observe_peer_fetch(self, seconds: float) -> None:
        self.peer_fetch.labels(*self.labels).observe(seconds)

    def observe_handoff(self, num_bytes: int, seconds: float) -> None:
        self.handoff_bytes.labels(*self.labels).observe(num_bytes)
        self.handoff_seconds.labels(*self.labels).observe(seconds)

    def observe_handoff_failed(self, cause: str) -> None:
        self.handoff_failures.labels(*self.labels, cause).inc()

    def observe_handed_over(self, num_blocks: int) -> None:
        self.handed_over.labels(*self.labels).inc(num_blocks)

    def observe_warmed(self, num_blocks: int) -> None:
        self.warmed.labels(*self.labels).inc(num_blocks)

    def observe_prefill_only(self) -> None:
        self.prefill_only.labels(*self.labels).inc()

    def observe_finished(self, out: RequestOutput, completion_tokens: int | None = None) -> None:
        """Count one finished request (call once, with its final output; `completion_tokens`:
        over all its sequences, default the output's own)."""
        assert out.finished, "observe_finished takes the final output of a request"
        lv = self.labels
        self.prefix_queries.labels(*lv).inc(out.prompt_tokens)
        self.prefix_hits.labels(*lv).inc(max(out.num_cached_tokens, 0))
        self.prompt_tokens.labels(*lv).inc(out.prompt_tokens)
        self.generation_tokens.labels(*lv).inc(out.completion_tokens if completion_tokens is None
                                               else completion_tokens)
        self.success.labels(*lv, out.finish_reason or "unknown").inc()
        t = out.timings
        for hist, value in ((self.ttft, t.ttft_s), (self.e2e, t.e2e_s), (self.queue, t.queue_s),
                            (self.prefill, t.prefill_s), (self.decode, t.decode_s)):
            if value is not None:
                hist.labels(*lv).observe(value)

    def observe_aborted(self) -> None:
        """Count one request whose client went away before it finished (the call cancelled):
        `request_success_total{finished_reason="abort"}`, as an engine abort counts."""
        self.success.labels(*self.labels, "abort").inc()

    def update_stats(self, stats: EngineStats, peer: PeerTotals | None = None) -> None:
        """The latest engine snapshot (and peer counters), read at the next scrape."""
        with self._lock:
            self._stats, self._peer = stats, peer

    def snapshot(self) -> tuple[EngineStats | None, PeerTotals | None]:
        with self._lock:
            return self._stats, self._peer


class TokenGaps:
    """Inter-token latency of one request, per sequence (`out.index`, n / best_of): each
    output's new tokens after the sequence's first are each one gap of (this output's token
    time - the previous one's) / their number (one token per decode step, so one observation
    per step, as vLLM observes it)."""

    __slots__ = ("_hist", "_last")

    def __init__(self, hist: Any) -> None:
        self._hist = hist
        self._last: dict[int, float] = {}

    def output(self, out: RequestOutput) -> None:
        n, now = len(out.new_token_ids), out.timings.last_token_time
        if n == 0 or now is None:
            return
        last = self._last.get(out.index)
        if last is None:             # the first token: TTFT's, not a gap; later ones in it are
            n -= 1
            last = out.timings.first_token_time
        if n > 0 and last is not None:
            gap = (now - last) / n
            for _ in range(n):
                self._hist.observe(gap)
        self._last[out.index] = now


class _StatsCollector(Collector):
    """Gauges and engine-kept counters from the latest `update_stats` (nothing before the first)."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._m
        lv = list(m.labels)
        info = GaugeMetricFamily("kvmesh:kv_cache_dtype_info", "The KV cache dtype (value 1)",
                                 labels=[*LABELS, "kv_cache_dtype"])
        info.add_metric([*lv, m.kv_cache_dtype], 1.0)
        yield info
        role = GaugeMetricFamily("kvmesh:worker_role_info", "The worker's role: prefill | decode | mixed (value 1)",
                                 labels=[*LABELS, "role"])
        role.add_metric([*lv, m.role], 1.0)
        yield role
        stats, peer = m.snapshot()
        if stats is None:
            return
        queue = GaugeMetricFamily("kvmesh:role_queue_length", "Requests waiting for admission, by the worker's "
                                  "role (prefill workers: the prefill queue; decode workers: the decode queue)",
                                  labels=[*LABELS, "role"])
        queue.add_metric([*lv, m.role], stats.num_waiting)
        yield queue

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"kvmesh:{name}", doc, labels=list(LABELS))
            g.add_metric(lv, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"kvmesh:{name}", doc, labels=list(LABELS))
            c.add_metric(lv, value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch", stats.num_running)
        yield gauge("num_requests_waiting", "Requests waiting for admission", stats.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of device KV blocks in use (0-1)",
                    stats.num_used_blocks / stats.num_blocks if stats.num_blocks else 0.0)
        yield gauge("host_tier_usage_perc", "Fraction of host-tier KV blocks in use (0-1)",
                    stats.num_host_blocks / stats.host_num_blocks if stats.host_num_blocks else 0.0)
        yield gauge("kv_reused_blocks", "Device blocks caching a prefix a later request reused (in use or free)",
                    stats.num_reused_blocks)
        yield gauge("kv_protected_blocks", "Free device blocks caching a reused prefix (evicted after the other "
                    "free blocks until unused for the protection window)", stats.num_protected_blocks)
        yield gauge("kv_protect_window_blocks", "Blocks the pool allocates before a protected block unused "
                    "since is stale: learned from evicted blocks cached again (0: protection never fades)",
                    stats.protect_window_blocks)
        yield counter("num_preemptions", "Requests preempted (blocks freed, recomputed later)",
                      stats.num_preemptions)
        yield counter("prefix_waits", "Admissions put off one step because another running request was "
                      "computing the prompt's next block (it is then reused, not computed twice)",
                      stats.num_prefix_waits)
        yield counter("room_waits", "Admission steps put off because the request's blocks would evict a shared "
                      "prefix while running requests were about to free as many of their own",
                      stats.num_room_waits)
        yield counter("kv_blocks_onloaded", "Blocks admissions copied from the host tier",
                      stats.num_onloaded_blocks)
        yield counter("kv_blocks_offloaded", "Blocks copied from the device pool into the host tier",
                      stats.num_offloaded_blocks)
        evicted = CounterMetricFamily("kvmesh:kv_evicted_tokens", "Tokens of KV dropped, by eviction policy "
                                      "(lru: cached device blocks reused; streaming/h2o: token eviction)",
                                      labels=[*LABELS, "policy"])
        evicted.add_metric([*lv, "lru"], stats.num_lru_evicted_blocks * m.block_size)
        if m.eviction_policy != "none":
            evicted.add_metric([*lv, m.eviction_policy], stats.num_evicted_tokens)
        yield evicted
        if stats.disk is not None:
            yield from _disk_metrics(stats.disk, lv)
        if peer is None:
            return
        outcomes = CounterMetricFamily("kvmesh:peer_fetch", "Peer-fetch decisions by outcome",
                                       labels=[*LABELS, "outcome"])
        for outcome, value in (("fetched", peer.fetched), ("recomputed", peer.recomputed),
                               ("checksum_failed", peer.checksum_failed), ("peer_lost", peer.peer_lost)):
            outcomes.add_metric([*lv, outcome], value)
        yield outcomes
        yield counter("peer_fetch_bytes", "Bytes fetched from peers", peer.bytes_fetched)


def _disk_metrics(disk: DiskTierStats, lv: list[str]) -> Iterator[Metric]:
    """The disk tier's figures (kvstore.disk_stats.DiskTierStats) as metrics."""
    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(f"kvmesh:{name}", doc, labels=list(LABELS))
        g.add_metric(lv, value)
        return g

    yield gauge("disk_tier_usage_perc", "Fraction of the disk KV tier's size bound in use (0-1)",
                disk.used_bytes / disk.capacity_bytes if disk.capacity_bytes else 0.0)
    yield gauge("disk_tier_used_bytes", "Bytes of KV block records in the disk tier", disk.used_bytes)
    yield gauge("disk_tier_enabled", "1 while the disk KV tier serves, 0 once an I/O error turned it off",
                1.0 if disk.enabled else 0.0)
    for name, doc, value in (("kv_disk_blocks_written", "Blocks written behind into the disk tier", disk.written),
                             ("kv_disk_blocks_read", "Blocks read back from the disk tier", disk.read)):
        c = CounterMetricFamily(f"kvmesh:{name}", doc, labels=list(LABELS))
        c.add_metric(lv, value)
        yield c
    dropped = CounterMetricFamily("kvmesh:kv_disk_blocks_dropped", "Disk-tier blocks dropped, by cause (checksum: "
                                  "a record failed its checks and was deleted, never served; queue_full: a write "
                                  "behind found the queue full)", labels=[*LABELS, "cause"])
    dropped.add_metric([*lv, "checksum"], disk.dropped_checksum)
    dropped.add_metric([*lv, "queue_full"], disk.dropped_queue_full)
    yield dropped
    for name, doc, h in (("kv_disk_write_seconds", "Seconds to write one block record", disk.write_seconds),
                         ("kv_disk_read_seconds", "Seconds to read one read-ahead run back", disk.read_seconds)):
        fam = HistogramMetricFamily(f"kvmesh:{name}", doc, labels=list(LABELS))
        bounds = [*(str(b) for b in h.bounds), "+Inf"]
        fam.add_metric(lv, list(zip(bounds, h.buckets)), h.sum_s)
        yield fam


async def refresh_forever(metrics: WorkerMetrics, ae: AsyncEngine, peer: PeerPlane | None,
                          interval_s: float = 0.5) -> None:
    """Feed `metrics.update_stats` from an engine `Snapshot` every `interval_s` until cancelled."""
    while True:
        stats = await ae.run(Snapshot())
        metrics.update_stats(stats, PeerTotals.from_counters(peer.figures().counters) if peer else None)
        await asyncio.sleep(interval_s)


def generate_metered(engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
                     metrics: WorkerMetrics | None, refresh_s: float = 0.5) -> tuple[float, int]:
    """Run `prompts` to completion as one batch, feeding `metrics` (None: no metrics) as the
    server does: every output to its request's `TokenGaps`, every final one to
    `observe_finished`, an engine snapshot every `refresh_s`. Returns (seconds, tokens made)."""
    from worker.engine.request import prompt_input  # torch: only when an engine runs
    t0 = last = time.perf_counter()
    ids = [engine.add_request(prompt_input(p, sp)) for p, sp in zip(prompts, params)]
    gaps = {rid: metrics.token_gaps() for rid in ids} if metrics is not None else {}
    done = tokens = 0
    while done < len(ids):
        for out in engine.step():
            if metrics is not None:
                gaps[out.request_id].output(out)
                if out.finished:
                    metrics.observe_finished(out)
            if out.finished:
                done += 1
                tokens += out.completion_tokens
        if metrics is not None and time.perf_counter() - last >= refresh_s:
            metrics.update_stats(engine.stats())
            last = time.perf_counter()
    return time.perf_counter() - t0, tokens


def metrics_cost(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], runs: int) -> dict[str, Any]:
    """Decode throughput of one workload with metrics off and on, interleaved, best of `runs`
    each."""
    metrics = WorkerMetrics.for_engine(engine, "bench")
    best = {"off": 0.0, "on": 0.0}
    for _ in range(runs):
        for mode in ("off", "on"):
            engine.store.reset_prefix_cache()
            seconds, tokens = generate_metered(engine, prompts, params, metrics if mode == "on" else None)
            best[mode] = max(best[mode], tokens / seconds)
    ratio = best["on"] / best["off"]
    return {"off_tok_s": best["off"], "on_tok_s": best["on"], "on_vs_off": ratio, "within_3pct": ratio >= 0.97,
            "runs": runs}
