"""What each actor of `kvmesh serve --ray` serves (kvmesh/serve/ray_launch.py starts them): one
`WorkerSpec` per worker, made from the `ServeConfig` by `worker_specs`. torch- and ray-free."""
from __future__ import annotations

from dataclasses import dataclass

from contracts.cluster_token import TOKEN_ENV
from contracts.tls import PLAINTEXT, TlsConfig
from kvmesh.serve.config import ServeConfig
from kvmesh.serve.roles import Role
from worker.server.cli import DECODE_STEP_PREFILL_TOKENS


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What one worker actor serves. `env` goes into os.environ before the engine is built."""

    worker_id: str
    model: str
    engine_argv: tuple[str, ...]
    redis_url: str
    cluster_name: str
    loopback: bool
    env: tuple[tuple[str, str], ...]
    startup_timeout_s: float
    port: int = 0          # 0: a free port; a replacement actor serves where its predecessor did
    tls: TlsConfig = PLAINTEXT   # mutual TLS with --tls-ca (the files must exist on the actor's node)
    role: Role = Role.MIXED
    cpu_share: tuple[int, int] | None = None   # (i, n): pinned to share i of n of its node's CPUs
    decode_step_prefill_tokens: int = DECODE_STEP_PREFILL_TOKENS   # a decode worker's (--decode-step-prefill-tokens)


def worker_specs(cfg: ServeConfig, redis_url: str, loopback: bool,
                 nodes: dict[int, str] | None = None) -> list[WorkerSpec]:
    """One spec per worker actor: the peer plane (with more than one worker) and the cluster
    token by environment, with --tls-ca the same TLS files as `kvmesh serve`'s local workers
    (mutual TLS), its role, and with `cpu_affinity_per_worker` its share of its node's CPUs
    (`nodes`: worker index -> node id; the workers of one node split it, in index order)."""
    token = ((TOKEN_ENV, cfg.cluster_token),) if cfg.cluster_token is not None else ()
    peer = (("KVMESH_PEER_TRANSFER", "1"),) if cfg.num_workers > 1 else ()
    node_of = nodes if nodes is not None else dict.fromkeys(range(cfg.num_workers), "")
    shares: list[tuple[int, int] | None] = [None] * cfg.num_workers
    budget = DECODE_STEP_PREFILL_TOKENS if cfg.decode_step_prefill_tokens is None else cfg.decode_step_prefill_tokens
    if cfg.cpu_affinity_per_worker:
        for index in range(cfg.num_workers):
            peers = sorted(i for i, n in node_of.items() if n == node_of[index])
            shares[index] = (peers.index(index), len(peers))
    return [WorkerSpec(worker_id=f"worker-{index}", model=cfg.model, engine_argv=cfg.engine_argv,
                       redis_url=redis_url, cluster_name=cfg.cluster_name, loopback=loopback,
                       env=(*peer, *token),
                       startup_timeout_s=cfg.startup_timeout_s, tls=cfg.tls if cfg.tls.ca is not None else PLAINTEXT,
                       role=cfg.roles[index], cpu_share=shares[index], decode_step_prefill_tokens=budget)
            for index in range(cfg.num_workers)]
