"""Partitions inside a network namespace this test creates: `kvmesh bench
chaos --only partition_router_worker` runs in it (cluster, load and the iptables rules, all on
the namespace's own loopback); the namespace is deleted at the end. Skipped, with the reason,
where the machine refuses namespaces or iptables. Slow: a 3-worker cluster under load.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def _netns_or_skip() -> str:
    name = f"kvm-{uuid.uuid4().hex[:8]}"
    if shutil.which("ip") is None or shutil.which("iptables") is None:
        pytest.skip("ip / iptables not installed")
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"network namespaces refused here: {made.stderr.strip()}")
    probe = subprocess.run(["ip", "netns", "exec", name, "iptables", "-S"], capture_output=True, text=True)
    if probe.returncode:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        pytest.skip(f"iptables refused inside a namespace: {probe.stderr.strip()}")
    subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
    return name


def test_partition_router_worker_leaves_routing_and_returns(tmp_path: Path) -> None:
    ns = _netns_or_skip()
    out = tmp_path / "chaos.json"
    try:
        run = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-m", "kvmesh.cli", "bench", "chaos",
                              "--quick", "--in-netns", "--only", "partition_router_worker", "--json", str(out)],
                             cwd=ROOT, capture_output=True, text=True, timeout=900)
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["failed"] == 0 and result["hung"] == 0, result
    assert result["outputs_equal_frac"] == 1.0, result
    rec = result["recovery_s"]["partition_router_worker"]
    # two unanswered probes (1 s apart, 2 s timeout each) take it out of routing; after the heal it returns
    assert rec["left_routing_s"] is not None and rec["left_routing_s"] < 15, rec
    assert rec["back_after_heal_s"] is not None, rec
    print(json.dumps(result))
