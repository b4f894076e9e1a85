"""The network half of tests/support/podnet.py: one "cluster" network namespace with a Linux bridge,
one namespace per pod joined to it by a veth pair (own IP 10.77.S.N/24 and loopback), a veth
from the root namespace for the test process (10.77.S.254), per-pod hosts files standing in for
cluster DNS (/etc/netns/<ns>/hosts, which `ip netns exec` mounts over /etc/hosts), and iptables
rules inside one pod's namespace. Names carry the creating process's pid, so a run killed before
its teardown is cleaned up by the next one (`remove_stale`).
"""
from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
from pathlib import Path

__all__ = ["PodNet", "remove_stale", "skip_reason"]

SUBNET = "10.77"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def skip_reason() -> str | None:
    """Why this machine cannot run pod networks (None: it can)."""
    for tool in ("ip", "iptables", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"kvmprobe{secrets.token_hex(3)}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode:
        return f"ip netns add refused: {made.stderr.strip()}"
    try:
        rules = subprocess.run(["ip", "netns", "exec", probe, "iptables", "-S"], capture_output=True, text=True)
        if rules.returncode:
            return f"iptables refused inside a namespace: {rules.stderr.strip()}"
        bridge = _ip("-n", probe, "link", "add", "br0", "type", "bridge", check=False)
        if bridge.returncode:
            return f"cannot create a bridge: {bridge.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def remove_stale() -> None:
    """Namespaces (and their processes, /etc/netns dirs) left by a test process that died
    without its teardown (SIGKILL): their names carry its pid, which no longer runs."""
    listed = _ip("netns", "list", check=False).stdout.split()
    for ns in listed:
        parts = ns.split("-")
        if len(parts) < 3 or parts[0] not in ("kvc", "kvp") or not re.fullmatch(r"p\d+", parts[1]):
            continue
        if Path(f"/proc/{parts[1][1:]}").exists():
            continue
        for pid in _ip("netns", "pids", ns, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "del", ns, check=False)
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


class PodNet:
    """The namespaces, bridge and veths of one run. `add(pod)` gives a pod its namespace and IP."""

    def __init__(self) -> None:
        remove_stale()
        self.id = f"p{os.getpid()}-{secrets.token_hex(2)}"
        short = secrets.token_hex(3)          # interface names: at most 15 characters
        used = _ip("-4", "route").stdout
        third = next(s for s in (secrets.randbelow(250) for _ in range(50)) if f"{SUBNET}.{s}." not in used)
        self.prefix = f"{SUBNET}.{third}"
        self.cluster_ns = f"kvc-{self.id}"
        self.host_if, self._short = f"kvr{short}", short
        self.ns: dict[str, str] = {}       # pod -> namespace
        self.ips: dict[str, str] = {}      # pod -> IP
        self.names: dict[str, list[str]] = {}   # pod -> DNS names
        self._made_ns: list[str] = []
        self._made_etc_netns = not Path("/etc/netns").exists()
        _ip("netns", "add", self.cluster_ns)
        self._made_ns.append(self.cluster_ns)
        _ip("-n", self.cluster_ns, "link", "set", "lo", "up")
        _ip("-n", self.cluster_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.cluster_ns, "link", "set", "br0", "up")
        # the test process's way in: a veth from the root namespace into the bridge
        _ip("link", "add", self.host_if, "type", "veth", "peer", "name", f"kvq{short}")
        _ip("link", "set", f"kvq{short}", "netns", self.cluster_ns)
        _ip("-n", self.cluster_ns, "link", "set", f"kvq{short}", "master", "br0", "up")
        _ip("addr", "add", f"{self.prefix}.254/24", "dev", self.host_if)
        _ip("link", "set", self.host_if, "up")

    def add(self, pod: str, names: list[str]) -> str:
        """A namespace for `pod`, joined to the bridge; `names` resolve to its IP in every pod."""
        if pod in self.ns:
            self.names[pod] = sorted(set(self.names[pod]) | set(names))
            self.write_hosts()
            return self.ips[pod]
        n = len(self.ns) + 1
        ns, ip = f"kvp-{self.id}-{n}", f"{self.prefix}.{n}"
        _ip("netns", "add", ns)
        self._made_ns.append(ns)
        outer, inner = f"kvh{self._short}{n:02d}", f"kvi{self._short}{n:02d}"
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", outer, "netns", self.cluster_ns)
        _ip("link", "set", inner, "netns", ns)
        _ip("-n", self.cluster_ns, "link", "set", outer, "master", "br0", "up")
        _ip("-n", ns, "link", "set", inner, "name", "eth0")
        _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        self.ns[pod], self.ips[pod], self.names[pod] = ns, ip, sorted(set(names) | {pod})
        Path(f"/etc/netns/{ns}").mkdir(parents=True, exist_ok=True)
        self.write_hosts()
        return ip

    def write_hosts(self) -> None:
        """Every pod's hosts file (rewritten in place: `ip netns exec` bind-mounts the file)."""
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        lines += [f"{self.ips[p]} {' '.join(self.names[p])}" for p in self.ns]
        text = "\n".join(lines) + "\n"
        for ns in self.ns.values():
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write(text)

    def exec_prefix(self, pod: str) -> list[str]:
        """argv prefix that runs a command inside `pod`'s namespace (and its own hostname)."""
        return ["ip", "netns", "exec", self.ns[pod], "unshare", "--uts", "--", "sh", "-c",
                'hostname "$0" && exec "$@"', pod]

    def iptables(self, pod: str, *rule: str) -> None:
        subprocess.run(["ip", "netns", "exec", self.ns[pod], "iptables", *rule], check=True, capture_output=True,
                       timeout=30)

    def close(self) -> None:
        for ns in reversed(self._made_ns):
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        _ip("link", "del", self.host_if, check=False)      # gone with its peer already, normally
        self._made_ns.clear()
        if self._made_etc_netns:
            with contextlib.suppress(OSError):
                Path("/etc/netns").rmdir()
