"""Peer transfer across processes: three `kvmesh worker --peer-transfer` processes on
SmolLM2 (CPU), pairs formed on demand over gloo. Worker A computes prompts; worker B gets the
same prompts with a hint to A and pulls the prefix instead of recomputing it; C pulls from B.

A's sends are scripted with the test-only fault plan (KVMESH_TEST_TRANSFER_FAULTS): the
first goes through, the second flips a byte of block 2 after its checksum, the third kills
A before its payload goes out. Then, with A gone, B and C keep transferring both ways; A is
started again (same worker id, a new generation) and B fetches from it over a new pair. The
oracle for every output is a cold run of the same prompt (a full recompute); the prefix of
each fetched run comes from elsewhere — a peer, a peer then recompute, the host tier, B's
device pool — and the greedy tokens must not change.
"""
from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import grpc
import pytest

from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[2]
WORKER_LINE = re.compile(r"^kvmesh worker (\S+) serving on (\S+):(\d+)$", re.M)
BLOCK = 16
PROMPT_TOKENS = 97           # 6 full blocks: the first 6 may come from a cache (the last token never does)
MAX_TOKENS = 6


class Worker(NamedTuple):
    proc: subprocess.Popen[bytes]
    address: str
    log: Path


def _spawn(tmp: Path, worker_id: str, *flags: str, env: dict[str, str] | None = None) -> Worker:
    out, log = tmp / f"{worker_id}.out", tmp / f"{worker_id}.log"
    argv = [sys.executable, "-m", "kvmesh.cli", "worker", "--port", "0", "--worker-id", worker_id,
            "--model", "smollm2", "--peer-transfer", *flags]
    with open(out, "wb") as fo, open(log, "ab") as fe:
        proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                                env=os.environ | {"PYTHONUNBUFFERED": "1"} | (env or {}))
    return Worker(proc, "", log)


def _wait_serving(w: Worker, timeout: float = 600.0) -> Worker:
    out = w.log.with_suffix(".out")
    deadline = time.monotonic() + timeout
    while (m := WORKER_LINE.search(out.read_text(errors="replace"))) is None:
        if w.proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"worker did not start (rc {w.proc.poll()}):\n{w.log.read_text()[-3000:]}")
        time.sleep(0.1)
    return w._replace(address=f"{m.group(2)}:{m.group(3)}")


class Cluster(NamedTuple):
    workers: dict[str, Worker]      # "a", "b", "c"; a restarted A replaces "a"
    tmp: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("peer")
    spawned = {"a": _spawn(tmp, "w-a", env={"KVMESH_TEST_TRANSFER_FAULTS": "ok,corrupt:2,exit"}),
               # B: a 16-block device pool (prompts get evicted to its host tier)
               "b": _spawn(tmp, "w-b", "--num-blocks", "16", "--kv-offload-gib", "0.05"),
               "c": _spawn(tmp, "w-c")}
    started = dict(spawned)
    try:
        started.update({k: _wait_serving(w) for k, w in spawned.items()})
        yield Cluster(started, tmp)
    finally:
        for w in started.values():
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait(timeout=30)


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 20000) for _ in range(PROMPT_TOKENS)]


def _run(address: str, prompt: list[int], hint_to: Worker | None = None,
         hint_id: str = "w-a") -> tuple[list[int], pb.GenerateResponse]:
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                             sampling=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    if hint_to is not None:
        req.peer_hints.append(pb.PeerHint(worker_id=hint_id, address=hint_to.address,
                                          num_blocks=PROMPT_TOKENS // BLOCK))
    with grpc.insecure_channel(address) as ch:
        msgs = list(pb_grpc.WorkerStub(ch).Generate(req, timeout=120))
    assert msgs and msgs[-1].finished
    return [t for m in msgs for t in m.token_ids], msgs[-1]


def _load(w: Worker) -> pb.Load:
    with grpc.insecure_channel(w.address) as ch:
        return pb_grpc.WorkerStub(ch).GetLoad(pb.LoadRequest(), timeout=30)


def test_prefix_from_peer_host_device_or_recompute_gives_the_same_tokens(cluster: Cluster) -> None:
    a, b = cluster.workers["a"], cluster.workers["b"]
    full = (PROMPT_TOKENS - 1) // BLOCK * BLOCK              # 96 tokens may come from a cache
    figures = _load(b).peer
    assert (figures.worker_id, figures.backend, figures.pairs_formed) == ("w-b", "gloo", 0)
    assert figures.prefill_tokens_per_s > 0 and figures.generation > 0

    # recomputed on A (the oracle), then A's device pool
    p1 = _prompt(1)
    want1, cold = _run(a.address, p1)
    assert cold.cached_tokens == 0
    again, hit = _run(a.address, p1)
    assert again == want1 and hit.cached_tokens == full

    # from the peer: all 6 blocks over a pair formed now, checksums good
    got, final = _run(b.address, p1, hint_to=a)
    assert got == want1 and (final.cached_tokens, final.peer_cached_tokens) == (full, full)
    peer = _load(b).peer
    assert (peer.last_decision, peer.blocks_fetched, peer.blocks_bad, peer.fetch_failures) == ("fetch", 6, 0, 0)
    assert peer.pairs_formed == 1 and [(x.worker_id, x.lost) for x in peer.links] == [("w-a", "")]
    assert peer.links[0].bandwidth_bytes_s > 0

    # a corrupted block 2: blocks 0-1 from the peer, the rest recomputed
    p2 = _prompt(2)
    want2, _ = _run(a.address, p2)
    got, final = _run(b.address, p2, hint_to=a)
    assert got == want2 and (final.cached_tokens, final.peer_cached_tokens) == (2 * BLOCK, 2 * BLOCK)
    peer = _load(b).peer
    assert (peer.blocks_fetched, peer.blocks_bad) == (8, 1)

    # B's own traffic pushes p1 out of its 16-block pool into its host tier; back from there
    p3 = _prompt(3)
    want3, _ = _run(a.address, p3)
    assert _run(b.address, p3)[0] == want3                     # recomputed on B, no hint
    onloaded = _load(b).num_onloaded_blocks
    got, final = _run(b.address, p1)
    assert got == want1 and final.cached_tokens == full and final.peer_cached_tokens == 0
    assert _load(b).num_onloaded_blocks > onloaded

    # A dies mid-transfer (its third send): B recomputes, same tokens, and serves on
    p4 = _prompt(4)
    want4, _ = _run(a.address, p4)
    t0 = time.monotonic()
    got, final = _run(b.address, p4, hint_to=a)
    assert got == want4 and final.peer_cached_tokens == 0
    assert a.proc.wait(timeout=30) == 17
    peer = _load(b).peer
    assert peer.fetch_failures == 1 and peer.pairs_broken == 1 and peer.links[0].lost
    # a hint to the dead peer: its control plane refuses at once, the request just computes
    p8 = _prompt(8)
    want8, _ = _run(cluster.workers["c"].address, p8)           # the oracle, on C
    got, final = _run(b.address, p8, hint_to=a)
    assert got == want8 and final.peer_cached_tokens == 0 and _load(b).peer.fetch_failures == 2
    assert time.monotonic() - t0 < 60


def test_after_one_worker_leaves_the_others_transfer_and_a_restarted_one_rejoins(cluster: Cluster) -> None:
    a, b, c = (cluster.workers[k] for k in "abc")
    if a.proc.poll() is None:                                  # (run alone: A leaves now)
        a.proc.kill()
    a.proc.wait(timeout=30)
    full = (PROMPT_TOKENS - 1) // BLOCK * BLOCK
    # with A gone, B and C still exchange blocks both ways (pairs B->C and C->B form now)
    p5, p6 = _prompt(5), _prompt(6)
    want5, _ = _run(b.address, p5)
    got, final = _run(c.address, p5, hint_to=b, hint_id="w-b")
    assert got == want5 and final.peer_cached_tokens == full
    want6, _ = _run(c.address, p6)
    got, final = _run(b.address, p6, hint_to=c, hint_id="w-c")
    assert got == want6 and final.peer_cached_tokens == full
    assert _load(c).peer.pairs_formed == 2                     # one as receiver, one as sender
    # A starts again under the same id: a new generation, a new pair, B fetches from it
    old_generation = next(x for x in _load(b).peer.links if x.worker_id == "w-a")
    a2 = cluster.workers["a"] = _wait_serving(_spawn(cluster.tmp, "w-a"))
    assert _load(a2).peer.generation > 0 and old_generation.lost
    p7 = _prompt(7)
    want7, _ = _run(a2.address, p7)
    got, final = _run(b.address, p7, hint_to=a2)
    assert got == want7 and final.peer_cached_tokens == full
    links = {x.worker_id: x.lost for x in _load(b).peer.links}
    assert links == {"w-a": "", "w-c": ""}
