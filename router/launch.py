"""`kvmesh serve`: the embedded default — a Redis, N workers and a router as local processes.

`LocalCluster` starts, in order: a `redis-server` child on a free loopback port (unless a
`redis_url` is given), N `kvmesh worker` children in parallel (each learns its port from the
worker's stdout line; with N > 1 they form one peer-transfer group, ranks 0..N-1, meeting on
a free loopback port), then a `kvmesh router` child in front of them. `stop()` tears down the
router, the workers and Redis (SIGTERM, then SIGKILL after `stop_timeout_s`).

No process is left behind: every child runs in its own process group (a terminal Ctrl-C
reaches only the launcher, which stops them in order) and carries PR_SET_PDEATHSIG=SIGTERM,
so it is told to exit when the thread that started it dies — even if the launcher is
SIGKILLed. Start a cluster from a thread that outlives it (normally the main thread).

This module imports no torch: the workers load their engines in their own processes.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Protocol

_PR_SET_PDEATHSIG = 1
_WORKER_LINE = re.compile(r"^kvmesh worker (\S+) serving on (\S+):(\d+)$", re.M)
_ROUTER_LINE = re.compile(r"^kvmesh router serving grpc on (\S+):(\d+) http on (\S+):(\d+)$", re.M)
_INSTALL_REDIS = ("redis-server not found on PATH: install it (apt-get install redis-server, "
                  "brew install redis) or pass --redis-url redis://HOST:PORT/0 to use a running Redis")


class LaunchError(Exception):
    """The cluster could not start; one line for the user, then (optionally) a child's log tail."""


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """What `kvmesh serve` / `LocalCluster` start. Ports 0 bind free ports. `engine_argv` are
    worker engine flags passed verbatim to every worker (e.g. ("--kv-cache-memory-gib", "0.25"));
    `model` goes to the workers and the router (its tokenizer). `redis_url=None` starts an
    embedded redis-server. `log_dir=None` keeps child logs in a temp dir removed by stop()."""

    workers: int = 2
    model: str = "smollm2"
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000
    redis_url: str | None = None
    cluster_name: str = "kvmesh"
    engine_argv: tuple[str, ...] = ()
    routing_policy: str = "kv_aware"
    load_factor: float = 1.25
    log_dir: Path | None = None
    startup_timeout_s: float = 180.0
    stop_timeout_s: float = 10.0
    python: str = sys.executable

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine_argv", tuple(self.engine_argv))
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers={self.workers!r} must be >= 1")
        if not self.model:
            raise ValueError("model is empty")
        if not self.host:
            raise ValueError("host is empty")
        for name in ("grpc_port", "http_port"):
            port = getattr(self, name)
            if not isinstance(port, int) or not 0 <= port <= 65535:
                raise ValueError(f"{name}={port!r} must be in [0, 65535] (0 = a free port)")
        if self.grpc_port and self.grpc_port == self.http_port:
            raise ValueError(f"http_port={self.http_port} is also the grpc_port")
        if self.redis_url is not None and not re.match(r"^rediss?://", self.redis_url):
            raise ValueError(f"redis_url={self.redis_url!r} must start with redis:// or rediss://")
        if not self.cluster_name or any(c.isspace() for c in self.cluster_name):
            raise ValueError(f"cluster_name={self.cluster_name!r} must be non-empty without spaces")
        owned = ("--model", "--worker-id", "--port", "--host", "--rank", "--world-size", "--dist-init-addr")
        if any(a.split("=", 1)[0] in owned for a in self.engine_argv):
            raise ValueError(f"engine_argv={self.engine_argv!r} may not set {'/'.join(owned)}")
        for name in ("startup_timeout_s", "stop_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")


@dataclass(eq=False)
class _Child:
    name: str
    proc: subprocess.Popen[bytes]
    stdout: Path
    stderr: Path

    def tail(self, lines: int = 15) -> str:
        """The last lines of its stderr (of its stdout when stderr is empty: redis logs there)."""
        text = ""
        for path in (self.stderr, self.stdout):
            text = path.read_text(errors="replace").strip() if path.exists() else ""
            if text:
                break
        return "\n".join(f"  | {line}" for line in text.splitlines()[-lines:])


@dataclass(eq=False)
class LocalCluster:
    """Redis + N workers + a router as child processes. Use as a context manager, or call
    `start()` then `stop()` (idempotent; also after a failed start). The address properties
    are valid after `start()` returns."""

    cfg: ServeConfig = field(default_factory=ServeConfig)
    grpc_target: str = field(init=False, default="")
    http_base_url: str = field(init=False, default="")
    worker_addresses: tuple[str, ...] = field(init=False, default=())
    redis_url: str = field(init=False, default="")
    _children: list[_Child] = field(init=False, default_factory=list)
    _log_dir: Path | None = field(init=False, default=None)
    _temp_dir: Path | None = field(init=False, default=None)

    # -- public -----------------------------------------------------------------------------
    @property
    def pids(self) -> dict[str, int]:
        """name → pid of every child started (redis, worker-<i>, router)."""
        return {c.name: c.proc.pid for c in self._children}

    @property
    def log_dir(self) -> Path | None:
        return self._log_dir

    def start(self) -> LocalCluster:
        """Start everything; raises LaunchError (after stopping what did start)."""
        assert not self._children, "start() called twice"
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def poll(self) -> str | None:
        """None while every child runs; else a line saying which one exited (and its log tail)."""
        for c in self._children:
            rc = c.proc.poll()
            if rc is not None:
                return f"{c.name} (pid {c.proc.pid}) exited with code {rc}\n{c.tail()}"
        return None

    def stop(self) -> None:
        """Router, then workers, then Redis: SIGTERM, wait `stop_timeout_s`, SIGKILL. Idempotent."""
        order = (lambda c: c.name == "router", lambda c: c.name.startswith("worker-"),
                 lambda c: c.name == "redis")
        for pick in order:
            _terminate([c for c in self._children if pick(c)], self.cfg.stop_timeout_s)
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- start --------------------------------------------------------------------------------
    def _start(self) -> None:
        cfg = self.cfg
        for flag, port in (("--grpc-port", cfg.grpc_port), ("--http-port", cfg.http_port)):
            if port and not _port_free(cfg.host, port):
                raise LaunchError(f"{flag}: {cfg.host}:{port} is already in use (pick another port, or 0 for a free one)")
        if cfg.log_dir is None:
            self._temp_dir = self._log_dir = Path(tempfile.mkdtemp(prefix=f"kvmesh-{cfg.cluster_name}-"))
        else:
            self._log_dir = cfg.log_dir
            self._log_dir.mkdir(parents=True, exist_ok=True)
        self.redis_url = cfg.redis_url or self._start_redis()
        deadline = time.monotonic() + cfg.startup_timeout_s
        common = ["--redis-url", self.redis_url, "--cluster-name", cfg.cluster_name, "--model", cfg.model]
        group = f"127.0.0.1:{_free_port('127.0.0.1')}"   # the transfer group's rendezvous (rank 0 binds it)
        workers = [self._spawn(f"worker-{i}", [cfg.python, "-m", "router.cli", "worker", "--host", "127.0.0.1",
                                               "--port", "0", "--worker-id", f"worker-{i}", *common,
                                               *_rank_argv(i, cfg.workers, group), *cfg.engine_argv])
                   for i in range(cfg.workers)]
        addresses = []
        for w in workers:
            m = self._wait_line(w, _WORKER_LINE, deadline)
            addresses.append(f"{m.group(2)}:{m.group(3)}")
        self.worker_addresses = tuple(addresses)
        router = self._spawn("router", [cfg.python, "-m", "router.cli", "router", "--host", cfg.host,
                                        "--grpc-port", str(cfg.grpc_port), "--http-port", str(cfg.http_port),
                                        "--routing-policy", cfg.routing_policy, "--load-factor", str(cfg.load_factor),
                                        *[a for addr in addresses for a in ("--worker", addr)], *common])
        m = self._wait_line(router, _ROUTER_LINE, deadline)
        host = _dial_host(cfg.host)
        self.grpc_target = f"{host}:{m.group(2)}"
        self.http_base_url = f"http://{host}:{m.group(4)}/v1"

    def _start_redis(self) -> str:
        assert self._log_dir is not None
        url, child = start_redis(self._log_dir, "127.0.0.1", self.cfg.stop_timeout_s)
        self._children.append(child)
        return url

    def _spawn(self, name: str, argv: Sequence[str]) -> _Child:
        assert self._log_dir is not None
        child = _spawn(self._log_dir, name, argv)
        self._children.append(child)
        return child

    def _wait_line(self, child: _Child, pattern: re.Pattern[str], deadline: float) -> re.Match[str]:
        """Poll the child's stdout file for its serving line."""
        while True:
            m = pattern.search(child.stdout.read_text(errors="replace"))
            if m:
                return m
            rc = child.proc.poll()
            if rc is not None:
                raise LaunchError(f"{child.name} exited with code {rc} before serving "
                                  f"(log: {child.stderr})\n{child.tail()}")
            if time.monotonic() > deadline:
                raise LaunchError(f"{child.name} did not start within {self.cfg.startup_timeout_s:.0f} s "
                                  f"(log: {child.stderr})\n{child.tail()}")
            time.sleep(0.1)


def _rank_argv(rank: int, world_size: int, dist_init_addr: str) -> list[str]:
    """Flags of one local worker's place in the peer-transfer group (none for a lone worker)."""
    if world_size == 1:
        return []
    return ["--rank", str(rank), "--world-size", str(world_size), "--dist-init-addr", dist_init_addr]


# -- processes and ports ----------------------------------------------------------------------
def start_redis(log_dir: Path, bind: str = "127.0.0.1", stop_timeout_s: float = 10.0) -> tuple[str, _Child]:
    """A `redis-server` child on a free port of `bind` (no persistence), its logs in `log_dir`;
    returns (redis_url, child) once it answers PING. Raises LaunchError. The caller stops it."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise LaunchError(_INSTALL_REDIS)
    import redis  # the client, for the readiness check
    data_dir = log_dir / "redis"
    data_dir.mkdir(exist_ok=True)
    for _attempt in range(3):   # a free port may be taken between the probe and the bind
        port = _free_port(bind)
        child = _spawn(log_dir, "redis", [exe, "--port", str(port), "--bind", bind, "--save", "",
                                          "--appendonly", "no", "--daemonize", "no", "--dir", str(data_dir)])
        url = f"redis://{bind}:{port}/0"
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and child.proc.poll() is None:
            try:
                with redis.Redis.from_url(url, socket_timeout=1.0) as client:
                    if client.ping():
                        return url, child
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                time.sleep(0.05)
        _terminate([child], stop_timeout_s)
    raise LaunchError(f"redis-server did not answer PING on {bind} (3 tries)\n{child.tail()}")


def _spawn(log_dir: Path, name: str, argv: Sequence[str]) -> _Child:
    """Start `argv` in its own process group, stdout/stderr to `log_dir`/<name>.out/.log."""
    stdout, stderr = log_dir / f"{name}.out", log_dir / f"{name}.log"
    parent, libc = os.getpid(), ctypes.CDLL(None, use_errno=True)
    with open(stdout, "wb") as out, open(stderr, "wb") as err:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                process_group=0, preexec_fn=lambda: _die_with_parent(parent, libc),
                                env=os.environ | {"PYTHONUNBUFFERED": "1"})
    return _Child(name, proc, stdout, stderr)


def _die_with_parent(parent: int, libc: ctypes.CDLL) -> None:
    """In the child, before exec: SIGTERM when the parent (thread) dies; if it already has, go."""
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _terminate(children: Sequence[_Child], timeout: float) -> None:
    """SIGTERM all, wait up to `timeout` together, SIGKILL the rest, reap."""
    live = [c for c in children if c.proc.poll() is None]
    for c in live:
        c.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for c in live:
        try:
            c.proc.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()


def _port_free(host: str, port: int) -> bool:
    """Whether `port` can be bound on `host` (SO_REUSEADDR as servers set it, so TIME_WAIT is no
    obstacle; a server holding it with SO_REUSEPORT — as grpc does — still blocks us)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _dial_host(host: str) -> str:
    """The address a local client dials for a server bound on `host`."""
    return {"0.0.0.0": "127.0.0.1", "::": "[::1]", "[::]": "[::1]"}.get(host, host)


# -- `kvmesh serve` ---------------------------------------------------------------------------
def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    from worker.cli import add_engine_arguments   # torch-free
    g = p.add_argument_group("serve")
    g.add_argument("--workers", type=int, default=2, help="number of worker processes")
    g.add_argument("--host", default="127.0.0.1", help="address the router binds (workers stay on 127.0.0.1)")
    g.add_argument("--grpc-port", type=int, default=50051, help="router gRPC port (0 = a free port)")
    g.add_argument("--http-port", type=int, default=8000, help="router OpenAI HTTP port (0 = a free port)")
    g.add_argument("--redis-url", default=None, help="metadata Redis (default: start a redis-server child)")
    g.add_argument("--cluster-name", default="kvmesh")
    g.add_argument("--routing-policy", default="kv_aware",
                   choices=("kv_aware", "prefix_hash", "round_robin", "least_loaded"))
    g.add_argument("--load-factor", type=float, default=1.25, help="bounded-load factor c (>= 1)")
    g.add_argument("--log-dir", type=Path, default=None, help="keep child logs here (default: a temp dir)")
    g.add_argument("--startup-timeout-s", type=float, default=180.0)
    add_engine_arguments(p)
    from router.ray_launch import add_ray_arguments   # imports no ray
    add_ray_arguments(p)


def engine_argv_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The engine flags the user changed (all but --model), spelled back as worker argv."""
    from worker.cli import add_engine_arguments
    reference = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(reference)
    argv: list[str] = []
    for action in reference._actions:
        value = getattr(args, action.dest)
        if action.dest == "model" or value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return tuple(argv)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    from worker.cli import CLIError, flagify
    try:
        return ServeConfig(workers=args.workers, model=args.model, host=args.host, grpc_port=args.grpc_port,
                           http_port=args.http_port, redis_url=args.redis_url, cluster_name=args.cluster_name,
                           engine_argv=engine_argv_from_args(args), log_dir=args.log_dir,
                           routing_policy=args.routing_policy, load_factor=args.load_factor,
                           startup_timeout_s=args.startup_timeout_s)
    except ValueError as e:
        raise CLIError(flagify(str(e))) from None


class _Stop(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop(signum)


def run_serve(cfg: ServeConfig) -> int:
    """Start the cluster, print where to connect, run until SIGINT/SIGTERM (exit 0) or until a
    child dies (exit 1); always stop every child."""
    cluster = LocalCluster(cfg)
    redis_note = "" if cfg.redis_url else " (embedded redis-server)"
    print(f"kvmesh serve: starting redis, {cfg.workers} worker(s) on {cfg.model} and a router "
          "(loading takes a while)...", flush=True)
    return supervise(cluster, "serve", lambda: _print_addresses(cluster, redis_note), poll_s=0.5)


class Supervised(Protocol):
    def start(self) -> object: ...
    def poll(self) -> str | None: ...
    def stop(self) -> None: ...


def supervise(cluster: Supervised, name: str, banner: Callable[[], None], poll_s: float) -> int:
    """Start `cluster`, print `banner()`, run until SIGINT/SIGTERM (exit 0) or until one of its
    parts dies (exit 1, naming it); always tear it down, ignoring further signals meanwhile."""
    from worker.cli import CLIError
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            cluster.start()
        except LaunchError as e:
            raise CLIError(str(e)) from None
        banner()
        while (died := cluster.poll()) is None:
            time.sleep(poll_s)
        print(f"kvmesh {name}: {died}", file=sys.stderr, flush=True)
        return 1
    except _Stop as s:
        print(f"kvmesh {name}: {s} received, stopping", file=sys.stderr, flush=True)
        return 0
    finally:
        for sig in previous:   # a second Ctrl-C must not cut the teardown short
            signal.signal(sig, signal.SIG_IGN)
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _print_addresses(cluster: LocalCluster, redis_note: str) -> None:
    cfg = cluster.cfg
    body = ('{"model": "%s", "messages": [{"role": "user", "content": "What is a KV cache?"}], '
            '"max_tokens": 64}' % cfg.model)
    pids = " ".join(f"{name}={pid}" for name, pid in cluster.pids.items())
    print("\n".join([
        f"kvmesh serve: ready — {cfg.workers} worker(s), cluster {cfg.cluster_name}",
        f"  gRPC     {cluster.grpc_target}",
        f"  HTTP     {cluster.http_base_url}",
        f"  redis    {cluster.redis_url}{redis_note}",
        f"  workers  {' '.join(cluster.worker_addresses)}",
        f"  logs     {cluster.log_dir}",
        f"  pids     {pids}",
        "  try:",
        f"    kvmesh client generate --target {cluster.grpc_target} --chat \"What is a KV cache?\"",
        f"    curl -s {cluster.http_base_url}/chat/completions -H 'Content-Type: application/json' "
        f"-d {shlex.quote(body)}",
        "  Ctrl-C stops everything.",
    ]), flush=True)


def run_serve_args(args: argparse.Namespace) -> int:
    """The `kvmesh serve` entry point (`--ray`/`--stop`: router.ray_launch)."""
    if args.ray or args.stop:
        from router.ray_launch import run_ray_serve_args
        return run_ray_serve_args(args)
    return run_serve(config_from_args(args))
