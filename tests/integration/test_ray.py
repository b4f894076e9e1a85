"""`kvmesh serve --ray` (kvmesh.serve.ray_launch): a local Ray on CPU, 2 worker actors, Redis and the
router as child processes of this one. The oracle is `Engine.generate` on the same model in this process.

Ray hygiene on a shared machine: our own `ray.init` (no auth token, a short temp dir, a capped
object store, no dashboard) and `ray.shutdown()` in `finally`. Never `ray stop` — it kills every
Ray process on the host.
"""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvmesh.serve.config import ServeConfig
from kvmesh.serve.ray_launch import RayCluster, RayServeConfig, namespace_for, stop_named_cluster
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 16
NUM_BLOCKS = "256"
CHAT = ({"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "What is the tallest mountain on Earth?"})


def test_ray_flags_become_config() -> None:
    from kvmesh.cli import build_parser
    from kvmesh.serve.cli import ray_config_from_args
    args = build_parser().parse_args(["serve", "--ray", "--ray-address", "auto", "--workers", "3",
                                      "--gpus-per-worker", "2", "--placement-strategy", "SPREAD",
                                      "--cluster-name", "c1", "--num-blocks", "64"])
    cfg = ray_config_from_args(args)
    assert (cfg.address, cfg.gpus_per_worker, cfg.placement_strategy, cfg.namespace) == (
        "auto", 2.0, "SPREAD", "kvmesh-c1")
    assert (cfg.serve.workers, cfg.serve.engine_argv) == (3, ("--num-blocks", "64"))
    for bad in (dict(gpus_per_worker=0), dict(placement_strategy="pack"), dict(address=""),
                dict(object_store_memory=2**20)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RayServeConfig(**bad)  # type: ignore[arg-type]


def test_ray_worker_actors_get_the_tls_files_with_tls_ca(tmp_path: Path) -> None:
    # as `kvmesh serve`'s local workers: with --tls-ca every worker serves mutual TLS
    from contracts.tls import PLAINTEXT
    from kvmesh.cli import build_parser
    from kvmesh.serve.cli import ray_config_from_args
    from kvmesh.serve.ray_specs import worker_specs
    for name in ("c.pem", "k.pem", "ca.pem"):
        (tmp_path / name).write_text("x")
    tls = ["--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "k.pem")]
    for extra, mutual in ((["--tls-ca", str(tmp_path / "ca.pem")], True), ([], False)):
        cfg = ray_config_from_args(build_parser().parse_args(["serve", "--ray", "--workers", "2", *tls, *extra]))
        specs = worker_specs(cfg.serve, "redis://127.0.0.1:1/0", True)
        assert [s.worker_id for s in specs] == ["worker-0", "worker-1"]
        assert all((s.tls == cfg.serve.tls) if mutual else (s.tls == PLAINTEXT) for s in specs)
        assert all(dict(s.env).get("KVMESH_CLUSTER_TOKEN") == cfg.serve.cluster_token for s in specs)
        assert all(dict(s.env).get("KVMESH_PEER_TRANSFER") == "1" for s in specs)   # two workers: peers
        assert not any(k in dict(s.env) for s in specs for k in ("KVMESH_RANK", "KVMESH_WORLD_SIZE"))
    one = ray_config_from_args(build_parser().parse_args(["serve", "--ray", "--workers", "1"]))
    assert "KVMESH_PEER_TRANSFER" not in dict(worker_specs(one.serve, "redis://127.0.0.1:1/0", True)[0].env)


def test_stop_without_ray_is_a_usage_error() -> None:
    r = subprocess.run([sys.executable, "-m", "kvmesh.cli", "serve", "--stop"], cwd=ROOT, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2 and "--stop: only with --ray" in r.stderr
    assert "ray" not in subprocess.run([sys.executable, "-c", "import kvmesh.serve.local, kvmesh.cli, sys; "
                                        "print(' '.join(m for m in sys.modules "
                                        "if m.split('.')[0] in ('ray', 'torch')))"],
                                       cwd=ROOT, capture_output=True, text=True, timeout=30).stdout


def _chat_request() -> pb.GenerateRequest:
    req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    for m in CHAT:
        req.chat.messages.add(role=m["role"], content=m["content"])
    return req


def _oracle(smollm2_dir: Path) -> tuple[list[int], int]:
    """Greedy chat ids and prompt length from an in-process Engine (freed before Ray starts)."""
    from worker.engine.engine import Engine, EngineConfig
    from worker.engine.sampling import SamplingParams
    engine = Engine(EngineConfig(model=str(smollm2_dir), num_blocks=int(NUM_BLOCKS)))
    prompt = engine.apply_chat_template(list(CHAT))
    out = engine.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]
    return list(out.token_ids), len(prompt)


@pytest.mark.multiproc
def test_two_ray_actors_serve_generate_like_the_engine(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray
    expected_ids, prompt_len = _oracle(smollm2_dir)
    name = f"raytest-{uuid.uuid4().hex[:6]}"
    namespace = namespace_for(name)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    temp = Path(tempfile.mkdtemp(prefix="kvr", dir="/tmp"))   # short: Ray's socket paths must fit 107 bytes
    cluster: RayCluster | None = None
    try:
        ray.init(num_cpus=4, object_store_memory=100 * 2**20, _temp_dir=str(temp), include_dashboard=False,
                 namespace=namespace, log_to_driver=False)
        bystander: Any = ray.remote(num_cpus=0)(_Bystander).options(name="bystander", namespace="other").remote()
        cfg = RayServeConfig(serve=ServeConfig(workers=2, grpc_port=0, http_port=0, cluster_name=name,
                                               engine_argv=("--num-blocks", NUM_BLOCKS), startup_timeout_s=240),
                             cpus_per_worker=1)
        cluster = RayCluster(cfg).start()
        assert len(cluster.worker_addresses) == 2 and re.match(r"redis://:[^@]+@127\.0\.0\.1:", cluster.redis_url)
        with grpc.insecure_channel(cluster.grpc_target) as ch:
            ids: list[int] = []
            last = None
            for r in pb_grpc.RouterStub(ch).Generate(_chat_request(), timeout=120):
                ids.extend(r.token_ids)
                last = r
        assert last is not None and last.finished
        assert ids == expected_ids and last.prompt_tokens == prompt_len
        assert last.worker_id in ("worker-0", "worker-1")

        # the peer plane reaches each actor through its environment
        assert all(ray.get(ray.get_actor(f"worker-{i}", namespace=namespace).peer_transfer.remote()) for i in range(2))

        # `--stop`: exactly our named actors and placement group, not the bystander
        assert sorted(stop_named_cluster(None, name)) == ["actor worker-0", "actor worker-1",
                                                           f"placement group {namespace}"]
        deadline = time.monotonic() + 30
        while cluster.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert cluster.poll() is not None
        cluster.stop()
        assert [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace] == []
        assert ray.get(bystander.ping.remote(), timeout=30) == "pong"
    finally:
        if cluster is not None:
            cluster.stop()
        ray.shutdown()
        import shutil
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_dead_worker_actor_is_replaced_in_its_bundle(monkeypatch: pytest.MonkeyPatch) -> None:
    """kill the actor of worker-0: the supervisor's restart puts a new actor in the same
    placement-group bundle, serving at the same address; the router routes to it again."""
    import ray
    name = f"raykill-{uuid.uuid4().hex[:6]}"
    namespace = namespace_for(name)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    temp = Path(tempfile.mkdtemp(prefix="kvr", dir="/tmp"))
    cluster: RayCluster | None = None
    try:
        ray.init(num_cpus=2, object_store_memory=100 * 2**20, _temp_dir=str(temp), include_dashboard=False,
                 namespace=namespace, log_to_driver=False)
        cfg = RayServeConfig(serve=ServeConfig(workers=1, grpc_port=0, http_port=0, cluster_name=name,
                                               engine_argv=("--num-blocks", NUM_BLOCKS), startup_timeout_s=240),
                             cpus_per_worker=1)
        cluster = RayCluster(cfg).start()
        address = cluster.worker_addresses[0]
        old = ray.get_actor("worker-0", namespace=namespace)
        ray.kill(old, no_restart=True)
        deadline = time.monotonic() + 60
        while (event := cluster.poll()) is None:
            assert time.monotonic() < deadline, "the dead actor was not noticed"
            time.sleep(0.5)
        assert event.name == "worker-0"
        cluster.restart("worker-0")
        new = ray.get_actor("worker-0", namespace=namespace)
        assert new._actor_id != old._actor_id and cluster.poll() is None
        table = ray.util.placement_group_table(cluster.placement._pg)   # type: ignore[attr-defined]
        assert table["state"] == "CREATED"
        with grpc.insecure_channel(cluster.grpc_target) as ch:
            deadline = time.monotonic() + 60
            while True:
                try:
                    last = list(pb_grpc.RouterStub(ch).Generate(_chat_request(), timeout=120))[-1]
                    break
                except grpc.RpcError:
                    assert time.monotonic() < deadline
                    time.sleep(1.0)
        assert last.finished and last.worker_id == "worker-0" and cluster.worker_addresses[0] == address
    finally:
        if cluster is not None:
            cluster.stop()
        ray.shutdown()
        import shutil
        shutil.rmtree(temp, ignore_errors=True)


class _Bystander:
    """An actor that is not ours: teardown must leave it alone."""

    def ping(self) -> str:
        return "pong"


@pytest.mark.multiproc
def test_ray_actors_serve_their_roles_pinned_to_their_own_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvmesh serve --ray --prefill-workers 1 --decode-workers 1 --cpu-affinity-per-worker`: each
    actor serves its role (the router's /v1/cluster) and every thread of it runs on its own
    share of the node's CPUs."""
    import json
    import os
    import urllib.request

    import ray

    from kvmesh.serve.roles import split_cpus
    from worker.server.cli import DECODE_STEP_PREFILL_TOKENS, PREFILL_CHUNK_TOKENS
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    name = f"rayroles-{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    temp = Path(tempfile.mkdtemp(prefix="kvr", dir="/tmp"))
    cluster: RayCluster | None = None
    try:
        ray.init(num_cpus=2, object_store_memory=100 * 2**20, _temp_dir=str(temp), include_dashboard=False,
                 namespace=namespace_for(name), log_to_driver=False)
        cfg = RayServeConfig(serve=ServeConfig(workers=0, prefill_workers=1, decode_workers=1,
                                               cpu_affinity_per_worker=True, grpc_port=0, http_port=0,
                                               cluster_name=name, engine_argv=("--num-blocks", NUM_BLOCKS),
                                               startup_timeout_s=240), cpus_per_worker=1)
        cluster = RayCluster(cfg).start()
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"{cluster.http_base_url}/cluster", timeout=30) as r:
            roles = {w["worker_id"]: w["role"] for w in json.loads(r.read())["workers"]}
        assert roles == {"worker-0": "prefill", "worker-1": "decode"}
        for i, share in enumerate(split_cpus(cpus, 2)):
            actor = ray.get_actor(f"worker-{i}", namespace=namespace_for(name))
            pinned = ray.get(actor.__ray_call__.remote(lambda self: sorted(os.sched_getaffinity(0))), timeout=30)
            assert tuple(pinned) == share
            # the role's engine settings, as `kvmesh worker --role` gives them (worker.server.cli)
            steps = ray.get(actor.__ray_call__.remote(
                lambda self: (self._server.engine_cfg.max_num_batched_tokens,
                              self._server.engine_cfg.step_prefill_tokens)), timeout=30)
            assert steps == ((PREFILL_CHUNK_TOKENS, 0) if i == 0 else (2048, DECODE_STEP_PREFILL_TOKENS)), steps
    finally:
        if cluster is not None:
            cluster.stop()
        ray.shutdown()
        import shutil
        shutil.rmtree(temp, ignore_errors=True)
