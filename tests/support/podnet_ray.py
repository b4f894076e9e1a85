"""A Ray cluster of several "hosts" on this machine: each host a network namespace of a
tests/support/podnet_ns.py `PodNet` (own IP on one bridge, own loopback, own hostname that
resolves to that IP, as a real host's does: gloo, under the peer plane, binds the address its
hostname resolves to), the head running
`ray start --head --block` and every other host `ray start --address HEAD:PORT --block`, each
with `--node-ip-address` its namespace's IP, explicit `--num-cpus` and a small object store.

The Ray processes are children of this process (`--block` keeps `ray start` in the
foreground); `tear_down(host)` SIGKILLs every process in that host's namespace and deletes the
namespace (a host lost with its network), `close()` does that for every host. Never `ray stop`:
it would kill every Ray process on the machine. The head's GCS checks node health every 500 ms
and declares a node dead after 4 missed checks, so a torn-down host is noticed within seconds.
`run(host, argv)` starts another process inside a host (a driver: `kvmesh serve --ray`).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.podnet_ns import PodNet, _ip

__all__ = ["RAY_ENV", "RayHosts"]

HEAD_PORT = 6390
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "1000",
           "RAY_health_check_failure_threshold": "4", "RAY_health_check_initial_delay_ms": "1000"}
RAY = str(Path(sys.executable).with_name("ray"))


class RayHosts:
    """Hosts "head", "host-1" … "host-<nodes>"; `address` is the head's GCS (IP:PORT)."""

    def __init__(self, log_dir: Path, nodes: int = 2, num_cpus: int = 2,
                 object_store_bytes: int = 100 * 2**20) -> None:
        self.net = PodNet()
        self.log_dir = log_dir
        self.procs: dict[str, list[subprocess.Popen[bytes]]] = {}
        self.gone: set[str] = set()
        # Ray's socket paths must fit 107 bytes: a short temp dir, not the test's tmp_path
        self.temp_dir = Path(tempfile.mkdtemp(prefix="kvr", dir="/tmp"))
        try:
            head_ip = self.net.add("head", ["ray-head"])
            self.address = f"{head_ip}:{HEAD_PORT}"
            common = ["--block", "--object-store-memory", str(object_store_bytes), "--disable-usage-stats"]
            head = self.run("head", [RAY, "start", "--head", "--node-ip-address", head_ip, "--port", str(HEAD_PORT),
                                     "--num-cpus", "0", "--include-dashboard", "false", "--temp-dir",
                                     str(self.temp_dir), *common], "ray-head")
            self._wait_port(head_ip, HEAD_PORT, 120, head)
            # one node at a time: `ray start` gives a raylet 30 s to register, which two starting
            # at once on a loaded 2-core machine may miss (then that node is tried once more)
            for n in range(1, nodes + 1):
                host = f"host-{n}"
                ip = self.net.add(host, [f"ray-{host}"])
                argv = [RAY, "start", "--address", self.address, "--node-ip-address", ip, "--num-cpus",
                        str(num_cpus), *common]
                if not self._started(host, self.run(host, argv, f"ray-{host}")):
                    self._kill(host)
                    if not self._started(host, self.run(host, argv, f"ray-{host}")):
                        raise RuntimeError(f"ray start on {host} failed twice:\n{self.log(f'ray-{host}')}")
        except BaseException:
            self.close()
            raise

    @property
    def ips(self) -> dict[str, str]:
        return dict(self.net.ips)

    def run(self, host: str, argv: list[str], log_name: str,
            env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """`argv` inside `host`'s namespace, stdout+stderr to <log_dir>/<log_name>.log."""
        with open(self.log_dir / f"{log_name}.log", "ab") as log:
            proc = subprocess.Popen([*self.net.exec_prefix(host), *argv], stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=os.environ | RAY_ENV | dict(env or {}), start_new_session=True)
        self.procs.setdefault(host, []).append(proc)
        return proc

    def log(self, log_name: str, lines: int = 40) -> str:
        path = self.log_dir / f"{log_name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def tear_down(self, host: str) -> None:
        """Every process in `host`'s namespace SIGKILLed, then the namespace deleted."""
        self._kill(host)
        _ip("netns", "del", self.net.ns[host], check=False)
        self.gone.add(host)

    def _started(self, host: str, proc: subprocess.Popen[bytes], timeout_s: float = 180) -> bool:
        """Whether `ray start --block` on `host` got as far as blocking (its node joined)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if "will now block forever" in self.log(f"ray-{host}", 20):
                return True
            if proc.poll() is not None:
                return False
            time.sleep(0.5)
        return False

    def _kill(self, host: str) -> None:
        ns = self.net.ns[host]
        for _ in range(3):     # processes may fork while we kill
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.2)
        for proc in self.procs.get(host, []):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)

    def close(self) -> None:
        for host in list(self.net.ns):
            if host not in self.gone:
                self.tear_down(host)
        self.net.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _wait_port(self, host: str, port: int, timeout_s: float, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ray start on {host} exited with {proc.returncode}:\n{self.log('ray-head')}")
            with socket.socket() as s:
                s.settimeout(1.0)
                if s.connect_ex((host, port)) == 0:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s:.0f} s")
            time.sleep(0.5)
