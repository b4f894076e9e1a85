"""Worker roles and CPU pinning in the launchers: `kvmesh worker --cpu-affinity`, `kvmesh serve
--prefill-workers/--decode-workers/--cpu-affinity-per-worker` (local processes), the Ray specs.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvmesh.bench.chaos_harness import ServeProcess, run_streams, wait_until
from kvmesh.cli import build_parser
from kvmesh.serve.cli import config_from_args
from kvmesh.serve.config import ServeConfig
from kvmesh.serve.ray_specs import worker_specs
from kvmesh.serve.roles import Role, role_argv, split_cpus
from worker.server.affinity import format_cpu_list, parse_cpu_list

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_lists_read_and_write_the_cpuset_syntax() -> None:
    assert parse_cpu_list("0") == (0,)
    assert parse_cpu_list("0-2,5, 7-8") == (0, 1, 2, 5, 7, 8)
    assert parse_cpu_list("3,1,1-2") == (1, 2, 3)
    for cpus in [(0,), (0, 1, 2, 5, 7, 8), (1, 3, 5), tuple(range(64))]:
        assert parse_cpu_list(format_cpu_list(cpus)) == cpus
    assert format_cpu_list((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"
    for bad, why in [("", "empty"), ("a", "not a CPU"), ("1-", "not a CPU"), ("3-1", "backwards"), ("-1", "not a")]:
        with pytest.raises(ValueError, match=why):
            parse_cpu_list(bad)


def test_cpus_split_into_disjoint_runs_one_per_worker() -> None:
    assert split_cpus([0, 1], 2) == ((0,), (1,))
    assert split_cpus(range(7), 3) == ((0, 1, 2), (3, 4), (5, 6))   # type: ignore[arg-type]
    assert split_cpus([4, 2, 3], 1) == ((2, 3, 4),)
    with pytest.raises(ValueError, match="3 workers but only 2 CPU"):
        split_cpus([0, 1], 3)


def test_serve_flags_give_each_worker_its_role() -> None:
    def cfg(*argv: str) -> ServeConfig:
        return config_from_args(build_parser().parse_args(["serve", *argv]))
    plain = cfg()
    assert (plain.workers, plain.num_workers, plain.roles) == (2, 2, (Role.MIXED, Role.MIXED))
    split = cfg("--prefill-workers", "2", "--decode-workers", "1", "--cpu-affinity-per-worker")
    assert split.workers == 0 and split.cpu_affinity_per_worker
    assert split.roles == (Role.PREFILL, Role.PREFILL, Role.DECODE)
    both = cfg("--workers", "1", "--prefill-workers", "1", "--decode-workers", "1")
    assert both.roles == (Role.PREFILL, Role.DECODE, Role.MIXED)
    for bad, match in [(dict(workers=0), "workers=0"), (dict(workers=0, prefill_workers=1), "add --decode-workers"),
                       (dict(decode_workers=-1), "decode_workers=-1"), (dict(engine_argv=("--role", "decode")),
                                                                        "engine_argv")]:
        with pytest.raises(ValueError, match=match):
            ServeConfig(**bad)  # type: ignore[arg-type]
    assert ServeConfig(workers=0, decode_workers=1).roles == (Role.DECODE,)


def test_the_decode_workers_step_budget_reaches_only_the_decode_workers() -> None:
    from worker.server.cli import DECODE_STEP_PREFILL_TOKENS
    args = build_parser().parse_args(["serve", "--prefill-workers", "1", "--decode-workers", "1",
                                      "--decode-step-prefill-tokens", "24"])
    cfg = config_from_args(args)
    assert cfg.decode_step_prefill_tokens == 24
    assert role_argv(Role.DECODE, 24) == ["--role", "decode", "--decode-step-prefill-tokens", "24"]
    assert role_argv(Role.PREFILL, 24) == ["--role", "prefill"] and role_argv(Role.MIXED, 24) == []
    assert role_argv(Role.DECODE) == ["--role", "decode"]          # None: the worker's default
    assert config_from_args(build_parser().parse_args(["serve"])).decode_step_prefill_tokens is None
    assert [s.decode_step_prefill_tokens for s in worker_specs(cfg, "redis://x:1/0", loopback=True)] == [24, 24]
    default = worker_specs(ServeConfig(workers=0, decode_workers=1), "redis://x:1/0", loopback=True)
    assert default[0].decode_step_prefill_tokens == DECODE_STEP_PREFILL_TOKENS
    with pytest.raises(ValueError, match="decode_step_prefill_tokens=-1"):
        ServeConfig(decode_step_prefill_tokens=-1)
    r = subprocess.run([sys.executable, "-m", "kvmesh.cli", "worker", "--decode-step-prefill-tokens", "-1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("kvmesh worker: --decode-step-prefill-tokens:"), r.stderr


def test_ray_specs_carry_roles_and_split_each_nodes_cpus() -> None:
    cfg = ServeConfig(workers=1, prefill_workers=1, decode_workers=2, cpu_affinity_per_worker=True)
    specs = worker_specs(cfg, "redis://x:1/0", loopback=False, nodes={0: "a", 1: "b", 2: "a", 3: "b"})
    assert [s.role for s in specs] == [Role.PREFILL, Role.DECODE, Role.DECODE, Role.MIXED]
    assert [s.cpu_share for s in specs] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    unpinned = worker_specs(ServeConfig(workers=2), "redis://x:1/0", loopback=True)
    assert [s.cpu_share for s in unpinned] == [None, None] and {s.role for s in unpinned} == {Role.MIXED}


def test_worker_rejects_a_bad_cpu_list_naming_the_flag() -> None:
    outside = max(os.sched_getaffinity(0)) + 1
    for value, why in [("x", "not a CPU number"), ("2-1", "backwards"), (str(outside), "not among the CPUs")]:
        r = subprocess.run([sys.executable, "-m", "kvmesh.cli", "worker", "--cpu-affinity", value], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stderr.startswith("kvmesh worker: --cpu-affinity:") and why in r.stderr, \
            r.stderr


def _cpus_of(pid: int) -> set[str]:
    """The Cpus_allowed_list of every thread of process `pid`."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except FileNotFoundError:   # a thread that ended meanwhile
            continue
        out.add(next(line.split(":", 1)[1].strip() for line in status.splitlines()
                     if line.startswith("Cpus_allowed_list")))
    return out


@pytest.mark.multiproc
def test_pinned_worker_runs_every_thread_on_its_cpus(tmp_path: Path) -> None:
    cpu = max(os.sched_getaffinity(0))
    out = tmp_path / "w.out"
    with open(out, "wb") as fo:
        proc = subprocess.Popen([sys.executable, "-m", "kvmesh.cli", "worker", "--cpu-affinity", str(cpu),
                                 "--metrics-port", "-1", "--num-blocks", "64"], cwd=ROOT, stdout=fo,
                                stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: "serving on" in out.read_text(), 180) is not None, out.read_text()
        assert _cpus_of(proc.pid) == {str(cpu)}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


@pytest.mark.multiproc
@pytest.mark.slow
def test_serve_pins_each_worker_to_its_own_cpu_and_a_restart_keeps_it(tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    serve = ServeProcess(2, tmp_path, ("--cpu-affinity-per-worker", "--restart-policy", "always",
                                       "--num-blocks", "64")).start()
    try:
        groups = split_cpus(cpus, 2)
        for i in range(2):
            assert _cpus_of(serve.pid(f"worker-{i}")) == {format_cpu_list(groups[i])}
        assert f"worker-1={format_cpu_list(groups[1])}" in serve.out.read_text()
        serve.kill("worker-1")
        assert wait_until(lambda: serve.restarts("worker-1") == 1, 120) is not None
        want = {format_cpu_list(groups[1])}   # the restarted worker pins itself once its CLI runs
        assert wait_until(lambda: _cpus_of(serve.pid("worker-1")) == want, 120) is not None
    finally:
        serve.stop()


def _cluster(http_base: str) -> dict[str, Any]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{http_base}/cluster", timeout=30) as r:
        return dict(json.loads(r.read()))


@pytest.mark.multiproc
def test_serve_starts_prefill_and_decode_workers_and_a_restart_keeps_the_role(tmp_path: Path) -> None:
    serve = ServeProcess(0, tmp_path, ("--prefill-workers", "1", "--decode-workers", "1", "--restart-policy",
                                       "always", "--num-blocks", "128", "--disagg-min-prompt-tokens", "32",
                                       "--decode-step-prefill-tokens", "16")).start()
    try:
        roles = {w["worker_id"]: w["role"] for w in _cluster(serve.http_base)["workers"]}
        assert roles == {"worker-0": "prefill", "worker-1": "decode"}
        assert "roles    worker-0=prefill worker-1=decode" in serve.out.read_text()
        long_prompt = " ".join(["the lighthouse keeper wrote"] * 20)
        (out,) = asyncio.run(run_streams(serve.grpc_target, [long_prompt], 4, 120, [0]))
        assert out.ok and out.worker_id == "worker-1" and len(out.tokens) == 4   # decoded on the decode worker
        assert _cluster(serve.http_base)["router"]["disagg"]["handoffs"] >= 1
        serve.kill("worker-0")
        assert wait_until(lambda: serve.restarts("worker-0") == 1, 120) is not None
        cmdline = Path(f"/proc/{serve.pid('worker-0')}/cmdline").read_bytes().split(b"\0")
        assert cmdline[cmdline.index(b"--role") + 1] == b"prefill"
        assert b"--decode-step-prefill-tokens" not in cmdline
        decode = Path(f"/proc/{serve.pid('worker-1')}/cmdline").read_bytes().split(b"\0")
        assert decode[decode.index(b"--decode-step-prefill-tokens") + 1] == b"16"
        assert wait_until(lambda: {w["worker_id"]: w["role"] for w in _cluster(serve.http_base)["workers"]
                                   if w.get("up", True)} == roles, 180) is not None
    finally:
        serve.stop()
