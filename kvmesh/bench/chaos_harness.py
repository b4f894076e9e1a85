"""The pieces of a chaos run, shared by `kvmesh bench chaos`
(kvmesh/bench/chaos.py) and the chaos tests: a `kvmesh serve` child whose parts can be killed
(`ServeProcess`), greedy streams through its router that record what a client saw
(`stream_once` → `Outcome`), which workers the router has in routing (`workers_up`), and
partitions cut with iptables inside the current network namespace (`Partition`).

A partition only ever touches the network namespace it runs in: `Partition` refuses to run
in the machine's own namespace (`in_private_netns`); `kvmesh bench chaos` creates one and
runs itself inside it. torch-free.
"""
from __future__ import annotations

import asyncio
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from contracts.cluster_token import TOKEN_ENV, TOKEN_METADATA
from kvmesh.serve.supervise import REDIS_PASSWORD_ENV
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
_UP = re.compile(r'^kvmesh:router_worker_up\{worker_id="([^"]+)"\} (\S+)$', re.M)


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request as its client saw it. `error`: the gRPC status name, "" when it finished;
    `hung`: it did not end within its deadline."""

    prompt: int
    tokens: tuple[int, ...]
    text: str
    migrations: int
    worker_id: str
    error: str = ""
    hung: bool = False

    @property
    def ok(self) -> bool:
        return not self.error and not self.hung


async def stream_once(stub: pb_grpc.RouterStub, prompt_id: int, prompt: str, max_tokens: int,
                      timeout_s: float, cache_salt: str = "") -> Outcome:
    """One greedy stream (ignore_eos, exactly `max_tokens` tokens) through the router; a fresh
    `cache_salt` makes its prompt uncached everywhere (the tokens are the same as without one)."""
    req = pb.GenerateRequest(text=prompt, cache_salt=cache_salt,
                             sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    text: list[str] = []
    last = None
    try:
        async for r in stub.Generate(req, timeout=timeout_s):
            tokens.extend(r.token_ids)
            text.append(r.text)
            last = r
    except grpc.aio.AioRpcError as e:
        hung = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        return Outcome(prompt_id, tuple(tokens), "".join(text), 0, "", "" if hung else e.code().name, hung)
    if last is None or not last.finished:
        return Outcome(prompt_id, tuple(tokens), "".join(text), 0, "", "NO_FINISH")
    return Outcome(prompt_id, tuple(tokens), "".join(text), last.migrations, last.worker_id)


def workers_up(http_base: str) -> dict[str, bool]:
    """worker id → in the router's routing now (its /metrics `kvmesh:router_worker_up`)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # loopback: never a proxy
    with opener.open(http_base.removesuffix("/v1") + "/metrics", timeout=10) as r:
        body = r.read().decode()
    return {m.group(1): float(m.group(2)) == 1.0 for m in _UP.finditer(body)}


def wait_until(check: object, timeout_s: float, poll_s: float = 0.25) -> float | None:
    """Seconds until `check()` is true (exceptions count as false), None after `timeout_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if check():  # type: ignore[operator]
                return time.monotonic() - t0
        except (OSError, ValueError):
            pass
        time.sleep(poll_s)
    return None


@dataclass
class ServeProcess:
    """`kvmesh serve` as a child (its own process group), on free ports; the banner's
    addresses and each part's current pid (restarts are read from its stderr)."""

    workers: int
    log_dir: Path
    flags: tuple[str, ...] = ()
    startup_timeout_s: float = 420.0   # a loaded 2-core machine loads 3 workers slowly
    proc: subprocess.Popen[bytes] | None = None
    grpc_target: str = ""
    http_base: str = ""
    redis_url: str = ""
    worker_addresses: tuple[str, ...] = ()
    token: str = field(default_factory=lambda: secrets.token_urlsafe(32))   # the cluster token, to ask workers
    _pids: dict[str, int] = field(default_factory=dict)

    @property
    def worker_metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC metadata for a direct call to one of its workers."""
        return ((TOKEN_METADATA, self.token),)

    @property
    def out(self) -> Path:
        return self.log_dir / "serve.out"

    @property
    def err(self) -> Path:
        return self.log_dir / "serve.err"

    def start(self) -> ServeProcess:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "kvmesh.cli", "serve", "--workers", str(self.workers), "--grpc-port", "0",
                "--http-port", "0", "--log-dir", str(self.log_dir / "children"), "--kv-cache-memory-gib", "0.25",
                "--startup-timeout-s", str(self.startup_timeout_s - 20),
                "--cluster-name", f"chaos-{os.getpid()}-{time.monotonic_ns() % 10**6}", *self.flags]
        password = secrets.token_urlsafe(24)      # the embedded Redis's, so that a fault can PING it
        env = os.environ | {REDIS_PASSWORD_ENV: password, TOKEN_ENV: self.token}
        with open(self.out, "wb") as fo, open(self.err, "wb") as fe:
            self.proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                                         start_new_session=True, env=env)
        deadline = time.monotonic() + self.startup_timeout_s
        while "Ctrl-C stops everything" not in self.out.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvmesh serve did not come up:\n{self.out.read_text()}\n"
                                   f"{self.err.read_text()[-3000:]}")
            time.sleep(0.2)
        text = self.out.read_text()
        self.grpc_target = _field(text, "gRPC")
        self.http_base = _field(text, "HTTP")
        bind = re.search(r"@?([\w.]+):(\d+)", _field(text, "redis").split()[0].split("//", 1)[1])
        assert bind is not None, text
        self.redis_url = f"redis://:{password}@{bind.group(1)}:{bind.group(2)}/0"
        self.worker_addresses = tuple(_field(text, "workers").split())
        self._pids = dict(p.split("=") for p in _field(text, "pids").split())  # type: ignore[arg-type]
        return self

    def pid(self, name: str) -> int:
        """The current pid of part `name` (redis, worker-<i>, router), restarts included."""
        restarted = re.findall(rf"^kvmesh serve: restarted {re.escape(name)} \(pid (\d+)\)$",
                               self.err.read_text(), re.M)
        return int(restarted[-1]) if restarted else int(self._pids[name])

    def restarts(self, name: str) -> int:
        return len(re.findall(rf"^kvmesh serve: restarted {re.escape(name)} ", self.err.read_text(), re.M))

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> int:
        pid = self.pid(name)
        os.kill(pid, sig)
        return pid

    def worker_port(self, i: int) -> int:
        return int(self.worker_addresses[i].rsplit(":", 1)[1])

    def stop(self) -> None:
        """SIGTERM (the supervisor stops every child), SIGKILL to the group after 60 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def _field(banner: str, name: str) -> str:
    m = re.search(rf"^\s+{name}\s+(.+)$", banner, re.M)
    if m is None:
        raise RuntimeError(f"kvmesh serve banner has no {name} line:\n{banner}")
    return m.group(1).strip()


def in_private_netns() -> bool:
    """This process runs inside a named network namespace (`ip netns exec NAME ...`), as
    `ip netns identify` tells; False where `ip` is missing or says none."""
    try:
        done = subprocess.run(["ip", "netns", "identify", str(os.getpid())], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and bool(done.stdout.strip())


class Partition:
    """Cut TCP traffic to and from one loopback port with iptables rules (both directions),
    and heal it. Only inside a private network namespace (raises RuntimeError otherwise)."""

    def __init__(self, port: int) -> None:
        if not in_private_netns():
            raise RuntimeError("refusing to add iptables rules outside a private network namespace")
        self.rules = [["INPUT", "-p", "tcp", "--dport", str(port), "-j", "DROP"],
                      ["INPUT", "-p", "tcp", "--sport", str(port), "-j", "DROP"]]
        self.active = False

    def cut(self) -> None:
        for rule in self.rules:
            subprocess.run(["iptables", "-A", *rule], check=True, capture_output=True, timeout=30)
        self.active = True

    def heal(self) -> None:
        if self.active:
            for rule in self.rules:
                subprocess.run(["iptables", "-D", *rule], check=True, capture_output=True, timeout=30)
        self.active = False


async def run_streams(target: str, prompts: list[str], max_tokens: int, timeout_s: float,
                      order: list[int]) -> list[Outcome]:
    """One stream per entry of `order` (a prompt index), all at once."""
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.RouterStub(ch)
        return list(await asyncio.gather(*(stream_once(stub, i, prompts[i], max_tokens, timeout_s) for i in order)))
