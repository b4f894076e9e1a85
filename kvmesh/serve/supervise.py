"""One process supervisor for every launcher: `kvmesh serve` (kvmesh.serve.local) and `kvmesh serve
--ray` (kvmesh.serve.ray_launch) differ only in their `WorkerPlacement`.

`Cluster.start()` runs the lifecycle in order: a log dir; the placement's `prepare` (which
says where Redis binds); a `redis-server` child on a free port (unless `redis_url` is given);
the placement's workers (each serving when `start_workers` returns, as HOST:PORT the router
dials); then a `kvmesh router` child in front of them. `stop()` tears down in reverse: the
router, the placement's workers, Redis (SIGTERM, then SIGKILL after `stop_timeout_s`), the
temp log dir. The cluster owns Redis, the router and the order; a placement owns its workers.

`Supervisor.run()` is the foreground loop: start, banner, watch, stop on SIGINT/SIGTERM.
Watching turns each part that exits into one `PartExited` event, handled in one place
(`Supervisor.on_exit`) by the restart policy (kvmesh.serve.restarts): the part is restarted after a
backoff on the same port (a worker, the embedded Redis, the router) while the rest keep
serving; one that keeps dying is given up on; `--restart-policy never` ends the run (status 1).

Imports no torch and no ray: the workers load their engines in their own processes.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import NamedTuple, Protocol

from contracts.cli import CLIError
from contracts.tls import tls_argv
from kvmesh.serve.config import ServeConfig
from kvmesh.serve.processes import Child, LaunchError, dial_host, port_free, spawn, start_redis, terminate
from kvmesh.serve.restarts import RestartConfig, RestartTracker, Verdict
from kvstore.metadata.registry import parse_redis_url

REDIS_PASSWORD_ENV = "KVMESH_REDIS_PASSWORD"   # the embedded Redis's password (default: random per start)
_PASSWORD = re.compile(r"[A-Za-z0-9._~-]{16,}")
_ROUTER_LINE = re.compile(r"^kvmesh router serving grpc on (\S+):(\d+) http on (\S+):(\d+)$", re.M)


class PartExited(NamedTuple):
    """One part of a cluster (a child process, a worker actor) is gone; `detail` says how
    (exit code, log tail). The event the supervisor handles."""

    name: str
    detail: str
    returncode: int | None = None    # None: unknown (a Ray actor), counted as a failure

    def __str__(self) -> str:
        return f"{self.name} {self.detail}"

    @classmethod
    def of(cls, child: Child) -> PartExited | None:
        """The event for `child` if it has exited, else None."""
        rc = child.proc.poll()
        return None if rc is None else cls(child.name, f"(pid {child.proc.pid}) exited with code {rc}\n{child.tail()}",
                                           rc)


class RouterReplica(NamedTuple):
    """A router started by `Cluster.start_router_replica`: its process and where it serves."""

    child: Child
    grpc_target: str
    http_base_url: str


class WorkerPlacement(Protocol):
    """Where a cluster's workers run (local processes, Ray actors). Called by `Cluster` in
    this order: `prepare`, `start_workers`, then `poll` while running; `stop` any time
    (idempotent, also after a failed start). Raises LaunchError on a failed start."""

    def prepare(self, cfg: ServeConfig, deadline: float) -> str:
        """Get the workers' places ready; returns the address an embedded Redis binds."""
        ...

    def start_workers(self, cfg: ServeConfig, redis_url: str, log_dir: Path, deadline: float) -> tuple[str, ...]:
        """Start every worker and wait until each serves; the HOST:PORT each is dialled at."""
        ...

    def poll(self, ignore: frozenset[str]) -> PartExited | None:
        """The first worker found gone whose name is not in `ignore`, else None."""
        ...

    def restart(self, name: str, cfg: ServeConfig, redis_url: str, log_dir: Path) -> None:
        """Start worker `name` again where it was dialled (returns once started, not serving);
        LaunchError if it cannot be."""
        ...

    def pids(self) -> dict[str, int]:
        """name → pid of worker processes this launcher started (none for remote workers)."""
        ...

    def stop(self, timeout_s: float) -> None:
        ...


class Cluster:
    """Redis + the placement's workers + a router child. Use as a context manager, or call
    `start()` then `stop()` (idempotent; also after a failed start). The address attributes
    are valid after `start()` returns."""

    def __init__(self, cfg: ServeConfig, placement: WorkerPlacement) -> None:
        self.cfg = cfg
        self.placement = placement
        self.grpc_target = ""
        self.http_base_url = ""
        self.worker_addresses: tuple[str, ...] = ()
        self.redis_url = ""
        self._redis: Child | None = None
        self._redis_password: str | None = None    # the embedded Redis's, kept across its restarts
        self._router: Child | None = None
        self._replicas: list[Child] = []    # `start_router_replica`'s routers
        self._log_dir: Path | None = None
        self._temp_dir: Path | None = None
        self._started = False
        self._gone: set[str] = set()    # parts reported exited and not (yet) restarted

    @property
    def pids(self) -> dict[str, int]:
        """name → pid of every local child started (redis, worker-<i>, router)."""
        redis = {"redis": self._redis.proc.pid} if self._redis is not None else {}
        router = {"router": self._router.proc.pid} if self._router is not None else {}
        return redis | self.placement.pids() | router

    @property
    def log_dir(self) -> Path | None:
        return self._log_dir

    def start(self) -> Cluster:
        """Start everything; raises LaunchError (after stopping what did start)."""
        assert not self._started, "start() called twice"
        self._started = True
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def poll(self) -> PartExited | None:
        """None while every part runs; else the first one found gone, reported once (until
        `restart` brings it back)."""
        event = None
        for child in (self._redis, self._router):
            if child is not None and child.name not in self._gone:
                event = event or PartExited.of(child)
        event = event or self.placement.poll(frozenset(self._gone))
        if event is not None:
            self._gone.add(event.name)
        return event

    def restart(self, name: str) -> int | None:
        """Start part `name` again on the address it had (Redis on its port, the router on its
        ports, a worker where the router dials it); its pid (None for a remote worker).
        Returns once started (Redis: answering PING); LaunchError if it cannot be."""
        assert self._log_dir is not None and name in self._gone, name
        child: Child | None = None
        if name == "redis":
            url = parse_redis_url(self.redis_url)
            _, self._redis = start_redis(self._log_dir, url.host, self.cfg.stop_timeout_s, port=url.port,
                                         password=self._redis_password)
            child = self._redis
        elif name == "router":
            grpc_port = int(self.grpc_target.rsplit(":", 1)[1])
            http_port = int(self.http_base_url.rsplit(":", 1)[1].split("/", 1)[0])
            self._router = child = spawn(self._log_dir, "router", self._router_argv(grpc_port, http_port),
                                         append=True, env=self.cfg.child_env(self.redis_url))
        else:
            self.placement.restart(name, self.cfg, self.redis_url, self._log_dir)
        self._gone.discard(name)
        return child.proc.pid if child is not None else self.placement.pids().get(name)

    def stop(self) -> None:
        """Router, then workers, then Redis: SIGTERM, wait `stop_timeout_s`, SIGKILL. Idempotent."""
        timeout = self.cfg.stop_timeout_s
        if self._router is not None:
            terminate([self._router], timeout)
        terminate(self._replicas, timeout)
        self.placement.stop(timeout)
        if self._redis is not None:
            terminate([self._redis], timeout)
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _start(self) -> None:
        cfg = self.cfg
        for flag, port in (("--grpc-port", cfg.grpc_port), ("--http-port", cfg.http_port)):
            if port and not port_free(cfg.host, port):
                raise LaunchError(f"{flag}: {cfg.host}:{port} is already in use "
                                  "(pick another port, or 0 for a free one)")
        deadline = time.monotonic() + cfg.startup_timeout_s
        if cfg.log_dir is None:
            self._temp_dir = self._log_dir = Path(tempfile.mkdtemp(prefix=f"kvmesh-{cfg.cluster_name}-"))
        else:
            self._log_dir = cfg.log_dir
            self._log_dir.mkdir(parents=True, exist_ok=True)
        redis_bind = self.placement.prepare(cfg, deadline)
        if cfg.redis_url is not None:
            self.redis_url = cfg.redis_url
        else:
            self._redis_password = _redis_password()
            self.redis_url, self._redis = start_redis(self._log_dir, redis_bind, cfg.stop_timeout_s,
                                                      password=self._redis_password)
        self.worker_addresses = self.placement.start_workers(cfg, self.redis_url, self._log_dir, deadline)
        self._router = spawn(self._log_dir, "router", self._router_argv(cfg.grpc_port, cfg.http_port),
                             env=cfg.child_env(self.redis_url))
        m = self._router.wait_line(_ROUTER_LINE, deadline, cfg.startup_timeout_s)
        host = dial_host(cfg.host)
        self.grpc_target = f"{host}:{m.group(2)}"
        self.http_base_url = f"{'https' if cfg.tls.serves_tls else 'http'}://{host}:{m.group(4)}/v1"

    def start_router_replica(self, name: str, extra_argv: tuple[str, ...] = ()) -> RouterReplica:
        """One more router on free ports with the first one's flags (and `extra_argv`), on the same
        Redis and workers, as a replica behind a Service is; serving once this returns. Not
        supervised (not in `poll`); stopped by `stop()`. Raises LaunchError."""
        assert self._log_dir is not None, "start() first"
        child = spawn(self._log_dir, name, [*self._router_argv(0, 0), *extra_argv],
                      env=self.cfg.child_env(self.redis_url))
        self._replicas.append(child)
        m = child.wait_line(_ROUTER_LINE, time.monotonic() + self.cfg.startup_timeout_s, self.cfg.startup_timeout_s)
        host = dial_host(self.cfg.host)
        scheme = "https" if self.cfg.tls.serves_tls else "http"
        return RouterReplica(child, f"{host}:{m.group(2)}", f"{scheme}://{host}:{m.group(4)}/v1")

    def _router_argv(self, grpc_port: int, http_port: int) -> list[str]:
        cfg = self.cfg
        return [cfg.python, "-m", "kvmesh.cli", "router", "--host", cfg.host, "--grpc-port", str(grpc_port),
                "--http-port", str(http_port), *[a for addr in self.worker_addresses for a in ("--worker", addr)],
                "--cluster-name", cfg.cluster_name, "--model", cfg.model, "--log-format", cfg.log_format,
                *tls_argv(cfg.tls), "--drain-timeout-s", str(cfg.stop_timeout_s / 2),
                *cfg.router_argv]    # the Redis URL (password) and the cluster token: cfg.child_env


def _redis_password() -> str:
    """$KVMESH_REDIS_PASSWORD (to reach the embedded Redis with redis-cli), else a fresh one."""
    chosen = os.environ.get(REDIS_PASSWORD_ENV)
    if chosen is None:
        return secrets.token_urlsafe(24)
    if not _PASSWORD.fullmatch(chosen):
        raise LaunchError(f"{REDIS_PASSWORD_ENV}: at least 16 characters of A-Z a-z 0-9 . _ ~ -")
    return chosen


class _Stop(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop(signum)


@dataclass(eq=False)
class Supervisor:
    """Runs `cluster` in the foreground as `kvmesh <name>`: start, `banner()`, watch every
    `poll_s`, restart parts that exit (per `cluster.cfg.restart_policy`, see kvmesh.serve.restarts),
    and always tear it down (ignoring further signals meanwhile)."""

    cluster: Cluster
    name: str
    banner: Callable[[], None]
    poll_s: float
    tracker: RestartTracker = field(init=False)
    _due: dict[str, float] = field(init=False, default_factory=dict)   # name -> monotonic restart time

    def __post_init__(self) -> None:
        self.tracker = RestartTracker(RestartConfig(policy=self.cluster.cfg.restart_policy))

    def run(self) -> int:
        """0 after SIGINT/SIGTERM; 1 when a part exits under policy never (see `on_exit`);
        CLIError when the start fails."""
        previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            try:
                self.cluster.start()
            except LaunchError as e:
                raise CLIError(str(e)) from None
            self.banner()
            while True:
                event = self.cluster.poll()
                status = None if event is None else self.on_exit(event)
                if status is not None:
                    return status
                self._restart_due()
                time.sleep(self.poll_s)
        except _Stop as s:
            self._say(f"{s} received, stopping")
            return 0
        finally:
            for sig in previous:   # a second Ctrl-C must not cut the teardown short
                signal.signal(sig, signal.SIG_IGN)
            self.cluster.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def on_exit(self, event: PartExited) -> int | None:
        """What a part's exit does to the run: the exit status to end with (policy never: 1),
        or None to go on watching (the part is scheduled for a restart, or left down)."""
        self._say(str(event))
        decision = self.tracker.on_exit(event.name, event.returncode, time.monotonic())
        cfg = self.tracker.cfg
        if decision.verdict is Verdict.END_RUN:
            return 1
        if decision.verdict is Verdict.LEAVE:
            self._say(f"{event.name} exited cleanly; not restarted (--restart-policy {cfg.policy.value}); "
                      "the rest keep serving")
        elif decision.verdict is Verdict.GIVE_UP:
            self._say(f"GIVING UP on {event.name}: it died {decision.deaths} times within {cfg.window_s:.0f} s; "
                      "it stays down, the rest keep serving")
        else:
            self._say(f"restarting {event.name} in {decision.delay_s:.1f} s (exit status "
                      f"{event.returncode if event.returncode is not None else 'unknown'}; death "
                      f"{decision.deaths} of {cfg.max_deaths} allowed within {cfg.window_s:.0f} s)")
            self._due[event.name] = time.monotonic() + decision.delay_s
        return None

    def _restart_due(self) -> None:
        now = time.monotonic()
        for name in [n for n, t in self._due.items() if t <= now]:
            del self._due[name]
            try:
                pid = self.cluster.restart(name)
            except LaunchError as e:   # counted as one more death: retried with a longer backoff
                self.on_exit(PartExited(name, f"could not be restarted: {e}"))
                continue
            self._say(f"restarted {name}" + (f" (pid {pid})" if pid is not None else ""))

    def _say(self, line: str) -> None:
        print(f"kvmesh {self.name}: {line}", file=sys.stderr, flush=True)
