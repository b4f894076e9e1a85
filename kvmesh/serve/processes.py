"""Child processes and ports of the launchers (`kvmesh serve`, `kvmesh serve --ray`).

A `Child` is one process this launcher started, its stdout/stderr in two files of a log dir.
Every child runs in its own process group (a terminal Ctrl-C reaches only the launcher, which
stops them in order) and carries PR_SET_PDEATHSIG=SIGTERM, so it is told to exit when the
thread that started it dies — even if the launcher is SIGKILLed. Start children from a thread
that outlives them (normally the main thread). The caller owns each child: `terminate` it.

A child is started without a `preexec_fn`, so CPython starts it with vfork, which runs no
fork handlers: with a plain fork, gRPC's handlers restart its poller thread in the child,
Popen's close_fds then closes the poller's epoll fd, and the child aborts (SIGABRT) before it
reaches exec whenever this process has gRPC traffic in flight (grpc/grpc#43055). A short
Python shim sets PR_SET_PDEATHSIG in the child instead and execs the real command (the signal
survives exec), keeping the pid.

Imports no torch; the Redis client only for `start_redis`'s readiness check.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import redis

_PR_SET_PDEATHSIG = 1
# argv: PARENT_PID PATH ARGV0 ARGS...; exit 1 at once if the parent has already gone, else exec
# PATH with the argv as given (so ps shows the command line the launcher built).
_DIE_WITH_PARENT = (f"import ctypes, os, sys\n"
                    f"ctypes.CDLL(None).prctl({_PR_SET_PDEATHSIG}, {int(signal.SIGTERM)}, 0, 0, 0)\n"
                    f"if os.getppid() != int(sys.argv[1]):\n"
                    f"    os._exit(1)\n"
                    f"os.execv(sys.argv[2], sys.argv[3:])\n")
_INSTALL_REDIS = ("redis-server not found on PATH: install it (apt-get install redis-server, "
                  "brew install redis) or pass --redis-url redis://HOST:PORT/0 to use a running Redis")


class LaunchError(Exception):
    """The cluster could not start; one line for the user, then (optionally) a child's log tail."""


@dataclass(eq=False)
class Child:
    """One child process; `stdout`/`stderr` are its log files (<log_dir>/<name>.out/.log)."""

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

    def wait_line(self, pattern: re.Pattern[str], deadline: float, timeout_s: float) -> re.Match[str]:
        """Poll its stdout file until `pattern` matches (its serving line); LaunchError if it
        exits first or `deadline` (time.monotonic) passes (`timeout_s` is for the message)."""
        while True:
            m = pattern.search(self.stdout.read_text(errors="replace"))
            if m:
                return m
            rc = self.proc.poll()
            if rc is not None:
                raise LaunchError(f"{self.name} exited with code {rc} before serving "
                                  f"(log: {self.stderr})\n{self.tail()}")
            if time.monotonic() > deadline:
                raise LaunchError(f"{self.name} did not start within {timeout_s:.0f} s "
                                  f"(log: {self.stderr})\n{self.tail()}")
            time.sleep(0.1)


def spawn(log_dir: Path, name: str, argv: Sequence[str], append: bool = False,
          env: Mapping[str, str] | None = None) -> Child:
    """Start `argv` in its own process group, stdout/stderr to `log_dir`/<name>.out/.log
    (appended to with `append`, as a restart does, so the earlier run's log stays); `env` is
    added to this process's environment (secrets go there, never into argv: argv shows in ps).
    FileNotFoundError if the program is not found (on PATH unless it names a path)."""
    program = shutil.which(argv[0])
    if program is None:
        raise FileNotFoundError(f"{argv[0]}: no such program")
    stdout, stderr = log_dir / f"{name}.out", log_dir / f"{name}.log"
    mode = "ab" if append else "wb"
    shim = [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), program, *argv]
    with open(stdout, mode) as out, open(stderr, mode) as err:
        proc = subprocess.Popen(shim, stdin=subprocess.DEVNULL, stdout=out, stderr=err, process_group=0,
                                env=os.environ | dict(env or {}) | {"PYTHONUNBUFFERED": "1"})
    return Child(name, proc, stdout, stderr)


def terminate(children: Sequence[Child], timeout: float) -> None:
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


def start_redis(log_dir: Path, bind: str = "127.0.0.1", stop_timeout_s: float = 10.0,
                port: int | None = None, password: str | None = None) -> tuple[str, Child]:
    """A `redis-server` child on `port` (default: a free port) of `bind` (no persistence), its
    logs in `log_dir` (appended to when `port` is given: a restart); with `password` (URL-safe
    characters) it requires it (`requirepass` in a 0600 config file, not on the command line,
    which shows in ps) and the returned URL carries it. Returns (redis_url, child)
    once it answers PING. Raises LaunchError. The caller stops it."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise LaunchError(_INSTALL_REDIS)
    data_dir = log_dir / "redis"
    data_dir.mkdir(exist_ok=True)
    fixed = port
    for _attempt in range(3):   # a free port may be taken between the probe and the bind
        port = free_port(bind) if fixed is None else fixed
        child = spawn(log_dir, "redis", [exe, *_auth_conf(data_dir, password), "--port", str(port), "--bind", bind,
                                         "--save", "", "--appendonly", "no", "--daemonize", "no",
                                         "--dir", str(data_dir)],
                      append=fixed is not None)
        url = f"redis://{':' + quote(password, safe='') + '@' if password else ''}{bind}:{port}/0"
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and child.proc.poll() is None:
            try:
                with redis.Redis.from_url(url, socket_timeout=1.0) as client:
                    if client.ping():
                        return url, child
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                time.sleep(0.05)
        terminate([child], stop_timeout_s)
    raise LaunchError(f"redis-server did not answer PING on {bind} (3 tries)\n{child.tail()}")


def _auth_conf(data_dir: Path, password: str | None) -> list[str]:
    """redis-server's leading config-file argument holding `requirepass` (none without a password)."""
    if password is None:
        return []
    conf = data_dir / "auth.conf"
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f'requirepass "{password}"\n')
    return [str(conf)]


def port_free(host: str, port: int) -> bool:
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


def free_port(host: str) -> int:
    """A port free on `host` now (it may be taken again before the caller binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def dial_host(host: str) -> str:
    """The address a local client dials for a server bound on `host`."""
    return {"0.0.0.0": "127.0.0.1", "::": "[::1]", "[::]": "[::1]"}.get(host, host)
