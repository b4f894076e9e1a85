"""Partitions on the rendered chart run as processes, one network namespace
per pod (tests/support/podnet.py): Redis, the router and two workers exactly as the manifests start them,
traffic cut with iptables DROP inside one pod's namespace.

- worker <-> Redis: the worker keeps serving at its speed; after the heal the router's block
  index holds exactly what the worker holds again (past the heartbeat TTL through an inventory,
  the router having dropped the silent worker; a short cut through the queued events alone);
- worker <-> worker mid peer transfer: the receiver recomputes, its output equals the sender's
  own uninterrupted greedy run; after the heal a later transfer between them works;
- router <-> worker: the worker leaves routing within the probe window, a stream open on it
  migrates to the other worker (its output equals an uninterrupted run), new requests go to the
  other worker; after the heal it returns;
- peer transfer to a restarted worker (kill -9, started again under the same pod name): both
  directions work (also the restart case).
The oracle for every output is the same prompt computed from scratch on a worker (greedy).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from kvmesh.bench.chaos_harness import wait_until
from tests.support.podnet import PodCluster, skip_reason
from tests.support.podnet_client import (
    FULL,
    Reply,
    cluster_doc,
    index_matches_worker,
    load,
    on_worker,
    prompt,
    running,
    via_router,
    workers_up,
)

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def cl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodCluster]:
    reason = skip_reason()
    if reason:
        pytest.skip(f"pod network unavailable: {reason}")
    cluster = PodCluster(tmp_path_factory.mktemp("podnet"))
    with running(cluster) as c:
        yield c


def test_worker_redis_partition_keeps_serving_and_the_index_is_exact_after_heal(cl: PodCluster) -> None:
    w = cl.worker(0)
    t0 = time.monotonic()
    for seed in (1, 2, 3):                           # something in the index before the cut
        on_worker(cl, w, prompt(seed))
    base_s = time.monotonic() - t0
    assert wait_until(lambda: index_matches_worker(cl, w)[0], 60) is not None, index_matches_worker(cl, w)[1]
    before = index_matches_worker(cl, w)[1]["index_blocks"]["device"]
    cl.cut(w, cl.redis)
    try:
        t0 = time.monotonic()
        cut_prompts = [prompt(s) for s in (101, 102, 103)]
        for ids in cut_prompts:                      # the worker keeps serving, no slower than a timeout
            reply = on_worker(cl, w, ids, timeout_s=60)
            assert len(reply.tokens) == 6
        served_s = time.monotonic() - t0
        # no Redis call on the engine thread: the cut does not slow serving by Redis timeouts
        assert served_s < 2 * base_s + 3, (served_s, base_s)
        time.sleep(1.0)
        # the cut took: the index lags — it still has the old blocks, or dropped the silent
        # worker's blocks, or (the cut outlasted the 3 s heartbeat TTL, as on a loaded machine)
        # the router dropped the worker itself, blocks and all
        equal, entry = index_matches_worker(cl, w)
        assert not equal and (not entry or entry["index_blocks"]["device"] in (before, 0)), entry
    finally:
        cl.heal(w, cl.redis)
    waited = wait_until(lambda: index_matches_worker(cl, w)[0], 60)
    assert waited is not None, (index_matches_worker(cl, w)[1], cl.logs(w)[-3000:])
    # the blocks made during the cut are the ones the index learned: the router sends those
    # prompts to this worker, which serves them from cache
    assert wait_until(lambda: workers_up(cl).get(w), 60) is not None
    for ids in cut_prompts:
        reply = via_router(cl, ids)
        assert reply.final.worker_id == w and reply.final.cached_tokens == FULL, reply.final
    print(f"3 requests served in {base_s:.1f} s before the cut, in {served_s:.1f} s during it; "
          f"index exact {waited:.1f} s after heal; "
          f"router view {cluster_doc(cl)['router']['kv_events']}")


def test_short_worker_redis_cut_is_healed_by_replay_alone(cl: PodCluster) -> None:
    """A cut shorter than the heartbeat TTL (3 s) and the Redis socket timeout (2 s): the router
    keeps the worker, and the events made during the cut reach it on heal, in sequence, so the
    index is exact again without a resync. (A cut past the TTL, above, is healed by an inventory:
    the router dropped the silent worker and asks for one when it returns.)"""
    w = cl.worker(0)
    assert wait_until(lambda: workers_up(cl).get(w) and index_matches_worker(cl, w)[0], 60) is not None
    before = cluster_doc(cl)["router"]["kv_events"]
    cl.cut(w, cl.redis)
    t0 = time.monotonic()
    try:
        on_worker(cl, w, prompt(201, 40), max_tokens=1)
    finally:
        cl.heal(w, cl.redis)
    cut_s = time.monotonic() - t0
    assert wait_until(lambda: index_matches_worker(cl, w)[0], 30) is not None, index_matches_worker(cl, w)[1]
    after = cluster_doc(cl)["router"]["kv_events"]
    assert after["entries"] > before["entries"], (before, after)          # the queued events arrived
    if cut_s < 2.0:         # well inside the TTL: nothing was lost, so nothing needed a resync
        assert (after["gaps"], after["resyncs"]) == (before["gaps"], before["resyncs"]), (cut_s, before, after)
    print(f"short cut {cut_s:.2f} s: kv_events {before} -> {after}")


def test_worker_worker_partition_mid_transfer_recomputes_and_heals(cl: PodCluster) -> None:
    a, b = cl.worker(0), cl.worker(1)
    p1 = prompt(11)
    want1 = on_worker(cl, a, p1).tokens
    got = on_worker(cl, b, p1, hint=a)               # a pair B<-A forms; its link is measured
    assert got.tokens == want1 and got.final.peer_cached_tokens == FULL, got.final
    peer = load(cl, b).peer
    per_block = peer.bytes_fetched // max(1, peer.blocks_fetched)
    p2 = prompt(12)
    want2 = on_worker(cl, a, p2).tokens
    # slow A's sends to ~6 s for the 6 blocks, so the cut lands mid-transfer
    cl.shape(a, f"{max(64, FULL // 16 * per_block * 8 // 6 // 1000)}kbit")
    tx0 = cl.tx_bytes(a)
    result: list[Reply | BaseException] = []

    def run() -> None:
        try:
            result.append(on_worker(cl, b, p2, hint=a, timeout_s=120))
        except BaseException as e:          # noqa: BLE001 - handed to the test thread
            result.append(e)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        moving = wait_until(lambda: cl.tx_bytes(a) - tx0 > per_block, 30, poll_s=0.05)
        assert moving is not None, "the transfer never started"
        cl.cut(a, b)
        thread.join(120)
    finally:
        if (a, b) in cl.cuts:
            cl.heal(a, b)
        cl.shape(a, None)
    assert not thread.is_alive() and result and not isinstance(result[0], BaseException), result
    reply = result[0]
    assert isinstance(reply, Reply)
    assert reply.tokens == want2, "the receiver's output differs from the uninterrupted run"
    assert reply.final.peer_cached_tokens < FULL, reply.final      # not everything came over
    after = load(cl, b).peer
    assert after.fetch_failures > peer.fetch_failures and after.pairs_broken > peer.pairs_broken, after
    # healed: a later transfer between them works (a new pair)
    p3 = prompt(13)
    want3 = on_worker(cl, a, p3).tokens
    got3 = on_worker(cl, b, p3, hint=a)
    assert got3.tokens == want3 and got3.final.peer_cached_tokens == FULL, (got3.final, load(cl, b).peer)
    assert load(cl, b).peer.blocks_fetched >= after.blocks_fetched + FULL // 16


def test_router_worker_partition_migrates_the_open_stream_and_heals(cl: PodCluster) -> None:
    a, b = cl.worker(0), cl.worker(1)
    assert wait_until(lambda: all(workers_up(cl).get(w) for w in (a, b)), 60) is not None
    ids, n = prompt(31), 160
    want = on_worker(cl, b, ids, max_tokens=n).tokens          # the uninterrupted greedy run, on b:
    # b alone holds the prefix, so kv_aware sends the stream there
    assert wait_until(lambda: index_matches_worker(cl, b)[0], 60) is not None
    result: list[Reply | BaseException] = []

    def run() -> None:
        try:
            result.append(via_router(cl, ids, timeout_s=240, max_tokens=n))
        except BaseException as e:          # noqa: BLE001 - handed to the test thread
            result.append(e)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert wait_until(lambda: load(cl, b).num_running > 0, 60, poll_s=0.05) is not None, "the stream never reached b"
    cl.cut(b, cl.router)
    try:
        left = wait_until(lambda: not workers_up(cl).get(b), 30, poll_s=0.1)
        assert left is not None, "the partitioned worker stayed in routing"
        other = via_router(cl, prompt(32))                    # new requests go to the other worker
        assert other.final.worker_id == a, other.final
        thread.join(240)
    finally:
        cl.heal(b, cl.router)
    assert not thread.is_alive() and result and not isinstance(result[0], BaseException), result
    reply = result[0]
    assert isinstance(reply, Reply)
    assert reply.final.migrations >= 1 and reply.final.worker_id == a, reply.final
    assert reply.tokens == want, "the migrated stream differs from the uninterrupted run"
    back = wait_until(lambda: workers_up(cl).get(b), 60)
    assert back is not None, "the worker did not return to routing after the heal"
    print(f"router <-> worker cut: out of routing {left:.1f} s after the cut, the stream migrated "
          f"({reply.final.migrations}), back in routing {back:.1f} s after the heal")


def test_peer_transfer_to_and_from_a_restarted_worker(cl: PodCluster) -> None:
    a, b = cl.worker(0), cl.worker(1)
    old_generation = load(cl, b).peer.generation
    cl.kill(b)                                      # kill -9, then the StatefulSet starts it again
    cl.restart(b)
    assert load(cl, b).peer.generation != old_generation
    p4 = prompt(21)
    want4 = on_worker(cl, a, p4).tokens
    got = on_worker(cl, b, p4, hint=a)              # restarted receiver, old sender
    assert got.tokens == want4 and got.final.peer_cached_tokens == FULL, (got.final, load(cl, b).peer)
    p5 = prompt(22)
    want5 = on_worker(cl, b, p5).tokens
    got = on_worker(cl, a, p5, hint=b)              # old receiver, restarted sender
    assert got.tokens == want5 and got.final.peer_cached_tokens == FULL, (got.final, load(cl, a).peer)
    assert wait_until(lambda: workers_up(cl).get(b), 60) is not None      # back in routing
