"""`kvmesh worker --cpu-affinity CPUS`: the CPU list syntax ("0", "0-1,3") and pinning a process.

Pinning happens before the engine is built, so torch's intra-op threads (created later) inherit
the mask, and the engine runs one thread per pinned CPU. Torch-free.
"""
from __future__ import annotations

import os
import re

_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """The sorted CPUs of a list like "0-1,3" (Linux cpuset syntax); ValueError naming the bad part."""
    cpus: set[int] = set()
    if not text.strip():
        raise ValueError("cpu_affinity='' is empty (e.g. 0 or 0-1,3)")
    for item in text.split(","):
        m = _ITEM.match(item.strip())
        if m is None:
            raise ValueError(f"cpu_affinity={text!r}: {item!r} is not a CPU number or range (e.g. 0 or 0-1,3)")
        first, last = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
        if last < first:
            raise ValueError(f"cpu_affinity={text!r}: range {item!r} runs backwards")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: tuple[int, ...] | list[int]) -> str:
    """The shortest list form of `cpus` ("0-1,3"); `parse_cpu_list` reads it back."""
    out: list[str] = []
    ordered = sorted(set(cpus))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def pin_process(cpus: tuple[int, ...]) -> None:
    """Restrict every thread of this process (and the threads and children it starts later) to
    `cpus`; ValueError when one of them is not among the CPUs the process may use now."""
    allowed = os.sched_getaffinity(0)
    outside = sorted(set(cpus) - allowed)
    if not cpus or outside:
        raise ValueError(f"cpu_affinity={format_cpu_list(cpus)!r}: CPU(s) {format_cpu_list(outside)} not among "
                         f"the CPUs this process may use ({format_cpu_list(sorted(allowed))})")
    for tid in sorted(int(t) for t in os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:   # a thread that ended meanwhile
            continue
