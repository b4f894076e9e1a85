"""Which worker does what in a launched cluster: its role (`kvmesh worker --role`) and, with
`--cpu-affinity-per-worker`, the CPUs it is pinned to. Pure functions of the config; no
processes. Used by both launchers (kvmesh.serve.local, kvmesh.serve.ray_launch).

Worker i of a cluster with N prefill, M decode and K mixed workers: indices 0..N-1 prefill,
N..N+M-1 decode, the rest mixed. A restarted worker keeps its index, hence its role and CPUs.
"""
from __future__ import annotations

from contracts.roles import WorkerRole as Role
from worker.server.affinity import format_cpu_list

__all__ = ["Role", "affinity_argv", "role_argv", "split_cpus", "worker_roles"]


def worker_roles(prefill: int, decode: int, mixed: int) -> tuple[Role, ...]:
    """The role of each worker index (see the module docstring for the order)."""
    return (Role.PREFILL,) * prefill + (Role.DECODE,) * decode + (Role.MIXED,) * mixed


def role_argv(role: Role, decode_step_prefill_tokens: int | None = None) -> list[str]:
    """A worker's --role flag (none for a mixed worker: the worker's default), and a decode
    worker's --decode-step-prefill-tokens when given (None: the worker's default)."""
    if role is Role.MIXED:
        return []
    budget = ["--decode-step-prefill-tokens", str(decode_step_prefill_tokens)] \
        if role is Role.DECODE and decode_step_prefill_tokens is not None else []
    return ["--role", role.value, *budget]


def split_cpus(cpus: tuple[int, ...] | list[int], num_workers: int) -> tuple[tuple[int, ...], ...]:
    """`cpus` cut into `num_workers` disjoint runs of consecutive entries, as equal as they come
    (the first ones one longer when they do not divide); ValueError when there are fewer CPUs
    than workers."""
    ordered = sorted(set(cpus))
    if num_workers < 1:
        raise ValueError(f"num_workers={num_workers} must be >= 1")
    if len(ordered) < num_workers:
        raise ValueError(f"{num_workers} workers but only {len(ordered)} CPU(s) "
                         f"({format_cpu_list(ordered)}) to pin them to, one at least each")
    share, extra = divmod(len(ordered), num_workers)
    out, start = [], 0
    for i in range(num_workers):
        size = share + (1 if i < extra else 0)
        out.append(tuple(ordered[start:start + size]))
        start += size
    return tuple(out)


def affinity_argv(cpus: tuple[int, ...] | None) -> list[str]:
    """A worker's --cpu-affinity flag (none when it is not pinned)."""
    return [] if cpus is None else ["--cpu-affinity", format_cpu_list(cpus)]
