"""The synthetic worker fleet of `kvmesh bench scale`: N workers in one child process, each
publishing what a real worker publishes (worker/server/metadata_hook.py) through the real
classes — its `WorkerRecord` via `WorkerRegistry.register` and heartbeats, its KV events via an
`EventPublisher` (kvstore/metadata/publisher.py: `BlockStored`/`BlockRemoved` pool events →
`from_pool_events` → one MULTI/EXEC of XADDs per publish), its inventory when the router asks
(`poll`: GETDEL of its resync key) — with no model and no gRPC server behind them.

Each worker's KV pool is modelled as an LRU of `pool_blocks` block hashes, full from the start
(its first publish is the inventory, as a starting worker's is): the system prompts it serves
plus unique blocks. Traffic arrives at `requests_per_s` per worker; a request is a prompt of the
Zipf trace of kvmesh/bench/sim.py (the router's decisions draw from the same trace) sent to one
of its prompt's replicas — `max(1, round(share × N))` workers from a ring position of the prompt,
the placement a load-balanced prefix-affine router converges to. The worker touches the
prompt's cached system blocks, stores the missing ones and the request's unique blocks (its
suffix and output: random 128-bit hashes, as unique blocks are), chained, after evicting as
many least-recent blocks (`BlockRemoved`). All requests of one worker within a tick (50 ms, the
PublishThread's poll interval) go out in one publish.

Protocol with the parent (one line each way): the child prints `ready <json>` once every worker
is registered with its inventory published; then reads commands on stdin: `pause` (stop
traffic, answer `paused <json>` with the blocks held), `resume`, `quit` (answer `bye <json>`).
"""
from __future__ import annotations

import json
import random
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from queue import Empty, SimpleQueue

from kvmesh.bench.sim import SimConfig, make_trace
from kvstore.events import Tier, WorkerId
from kvstore.keys import BlockHash
from kvstore.metadata.publisher import EventPublisher
from kvstore.metadata.registry import MetadataError, RedisConfig, WorkerRecord, WorkerRegistry, connect
from kvstore.pool import BlockId, BlockRemoved, BlockStored, KVEvent

TICK_S = 0.05


@dataclass(frozen=True, slots=True)
class FleetConfig:
    redis_url: str
    cluster_name: str
    workers: int
    pool_blocks: int
    requests_per_s: float            # per worker
    output_blocks: int               # unique blocks a request's output adds
    heartbeat_ttl_s: float
    heartbeat_interval_s: float
    poll_interval_s: float           # how often each worker takes a resync request
    num_prompts: int
    zipf_s: float
    system_blocks: int
    suffix_blocks: tuple[int, int]
    block_size: int
    trace_requests: int
    seed: int

    def __post_init__(self) -> None:
        if self.workers <= 0 or self.pool_blocks <= self.system_blocks + self.suffix_blocks[1] + self.output_blocks:
            raise ValueError(f"workers={self.workers!r} must be > 0 and pool_blocks={self.pool_blocks!r} "
                             "must exceed one request's blocks")
        if not self.requests_per_s >= 0.0:
            raise ValueError(f"requests_per_s={self.requests_per_s!r} must be >= 0")

    @property
    def redis(self) -> RedisConfig:
        return RedisConfig(url=self.redis_url, cluster_name=self.cluster_name, socket_timeout_s=10.0,
                           heartbeat_ttl_s=self.heartbeat_ttl_s, heartbeat_interval_s=self.heartbeat_interval_s)

    def sim(self) -> SimConfig:
        """The trace both sides draw prompts from."""
        return SimConfig(num_prompts=self.num_prompts, zipf_s=self.zipf_s, system_blocks=self.system_blocks,
                         suffix_blocks=self.suffix_blocks, num_requests=self.trace_requests,
                         block_size=self.block_size, seed=self.seed)


def worker_id(i: int) -> WorkerId:
    return WorkerId(f"scale-{i:05d}")


def worker_address(i: int) -> str:
    """Never dialled: the bench's router marks registered workers ready without a probe."""
    return f"127.0.0.1:{20000 + i}"


class SyntheticWorker:
    """One worker's pool (an LRU of hashes), its record and its real `EventPublisher`."""

    def __init__(self, cfg: FleetConfig, i: int, registry: WorkerRegistry, client: object,
                 system: list[BlockHash], rng: random.Random) -> None:
        self.id = worker_id(i)
        self.epoch = registry.new_epoch(self.id)
        self.record = WorkerRecord(self.id, worker_address(i), "scale-model", cfg.block_size, cfg.pool_blocks,
                                   "5ca1e", self.epoch)
        self.capacity = cfg.pool_blocks
        self.lru: OrderedDict[BlockHash, None] = OrderedDict.fromkeys(system[:cfg.pool_blocks])
        while len(self.lru) < cfg.pool_blocks:
            self.lru[BlockHash(rng.getrandbits(128))] = None
        self.publisher = EventPublisher(cfg.redis, self.id, self.epoch, self.inventory,
                                        client=client)  # type: ignore[arg-type]
        self.events: list[KVEvent] = []
        self.stored = self.removed = 0

    def inventory(self) -> dict[Tier, list[BlockHash]]:
        return {Tier.DEVICE: list(self.lru)}

    def serve(self, system: tuple[BlockHash, ...], unique: int, rng: random.Random) -> None:
        """One request: touch its cached system blocks, evict, store the rest (chained)."""
        lru, new = self.lru, []
        parent: BlockHash | None = None
        for h in system:
            if h in lru:
                lru.move_to_end(h)
            else:
                new.append((h, parent))
            parent = h
        for _ in range(unique):
            h = BlockHash(rng.getrandbits(128))
            new.append((h, parent))
            parent = h
        while len(lru) + len(new) > self.capacity:
            old, _ = lru.popitem(last=False)
            self.events.append(BlockRemoved(old, BlockId(0)))
            self.removed += 1
        for h, p in new:
            lru[h] = None
            self.events.append(BlockStored(h, p, BlockId(0)))
        self.stored += len(new)

    def flush(self) -> None:
        if self.events:
            self.publisher.publish(self.events)
            self.events = []


class Fleet:
    """Every worker of this process, the prompts' replica sets and the arrival clock."""

    def __init__(self, cfg: FleetConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed + 7)
        routes = make_trace(cfg.sim())
        self.prompts = [r.block_hashes[:cfg.system_blocks] for r in routes]
        self.unique = [len(r.block_hashes) - cfg.system_blocks + cfg.output_blocks for r in routes]
        share: dict[BlockHash, int] = {}
        for p in self.prompts:
            share[p[-1]] = share.get(p[-1], 0) + 1
        n = cfg.workers
        self.replicas = {key: [(key + j) % n for j in range(max(1, min(n, round(count / len(routes) * n))))]
                         for key, count in share.items()}
        held: list[list[BlockHash]] = [[] for _ in range(n)]
        for p in {p[-1]: p for p in self.prompts}.values():
            for i in self.replicas[p[-1]]:
                held[i].extend(p)
        self.registry = WorkerRegistry(cfg.redis)
        self.client = connect(cfg.redis)
        self.workers = [SyntheticWorker(cfg, i, self.registry, self.client, held[i], self.rng) for i in range(n)]
        self.paused = False
        self.requests = self.requests_shed = 0
        self.active_s = 0.0                  # seconds not paused
        self.heartbeat_failures = 0
        self._carry = 0.0
        self._beat_at = self._poll_at = 0    # round-robin cursors over the workers

    def start(self) -> None:
        """Register every worker and publish its inventory (its first flush)."""
        for w in self.workers:
            self.registry.register(w.record)
            w.publisher.poll()

    def tick(self, dt: float) -> None:
        """Heartbeats and resync polls first (a worker that misses its TTL leaves routing), then
        this tick's requests. A backlog past two ticks' worth is shed and counted: the fleet
        reports the request rate it achieved."""
        cfg, rng = self.cfg, self.rng
        self._upkeep(dt)
        if not self.paused:
            self.active_s += dt
            self._carry += cfg.requests_per_s * cfg.workers * dt
            cap = max(1.0, 2 * cfg.requests_per_s * cfg.workers * TICK_S)
            if self._carry > cap:
                self.requests_shed += int(self._carry - cap)
                self._carry = cap
            self.requests += int(self._carry)
            for _ in range(int(self._carry)):
                k = rng.randrange(len(self.prompts))
                system = self.prompts[k]
                replicas = self.replicas[system[-1]]
                self.workers[replicas[rng.randrange(len(replicas))]].serve(system, self.unique[k], rng)
            self._carry -= int(self._carry)
            for w in self.workers:
                w.flush()

    def _upkeep(self, dt: float) -> None:
        """Heartbeats and resync polls for the workers due this tick (round robin: each once
        per interval)."""
        cfg, n = self.cfg, len(self.workers)
        beats = max(1, min(n, int(n * dt / cfg.heartbeat_interval_s + 0.999)))
        for j in range(beats):
            w = self.workers[(self._beat_at + j) % n]
            try:     # as the worker's Heartbeater: a failure is counted and retried, never raised
                if not self.registry.heartbeat(w.id, 0.0):
                    self.registry.register(w.record)
            except MetadataError:
                self.heartbeat_failures += 1
        self._beat_at = (self._beat_at + beats) % n
        polls = max(1, min(n, int(n * dt / cfg.poll_interval_s + 0.999)))
        for j in range(polls):
            self.workers[(self._poll_at + j) % n].publisher.poll()
        self._poll_at = (self._poll_at + polls) % n

    def summary(self) -> dict[str, int]:
        stats = [w.publisher.stats() for w in self.workers]
        return {"held": sum(len(w.lru) for w in self.workers),
                "requests": self.requests, "requests_shed": self.requests_shed,
                "heartbeat_failures": self.heartbeat_failures,
                "requests_per_s": round(self.requests / self.active_s, 1) if self.active_s else 0,  # type: ignore[dict-item]
                "stored": sum(w.stored for w in self.workers),
                "removed": sum(w.removed for w in self.workers),
                "entries": sum(s.next_seq - 1 for s in stats),
                "inventories": sum(s.inventories for s in stats),
                "dropped": sum(s.dropped for s in stats),
                "failures": sum(s.failures for s in stats),
                "pending": sum(s.pending for s in stats)}


def _say(word: str, payload: dict[str, int]) -> None:
    print(f"{word} {json.dumps(payload)}", flush=True)


def run(cfg: FleetConfig) -> None:
    fleet = Fleet(cfg)
    fleet.start()
    _say("ready", fleet.summary())
    commands: SimpleQueue[str] = SimpleQueue()

    def read_commands() -> None:
        for line in sys.stdin:
            commands.put(line.strip())

    threading.Thread(target=read_commands, daemon=True).start()
    last = time.monotonic()
    while True:
        try:
            command = commands.get_nowait()
        except Empty:
            command = ""
        if command == "pause":
            fleet.paused = True
            for w in fleet.workers:
                w.flush()
            _say("paused", fleet.summary())
        elif command == "resume":
            fleet.paused = False
        elif command == "quit":
            _say("bye", fleet.summary())
            return
        now = time.monotonic()
        fleet.tick(now - last)
        last = now
        time.sleep(max(0.0, TICK_S - (time.monotonic() - now)))


def fleet_argv(cfg: FleetConfig) -> list[str]:
    return [sys.executable, "-m", "kvmesh.bench.scale_workers", json.dumps(asdict(cfg))]


if __name__ == "__main__":
    fields = json.loads(sys.argv[1])
    fields["suffix_blocks"] = tuple(fields["suffix_blocks"])
    run(FleetConfig(**fields))
