"""The one writer of benchmark results, torch-free so that `kvmesh bench router` (router)
and the worker's benches (`kvmesh.bench.engine`) print and save their JSON the same way.

Every result gets a `meta` block: the command that produced it, the UTC date and the machine.
`kvmesh bench docs` renders `docs/benchmarks.md` from result files carrying it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from contracts.cli import CLIError

__all__ = ["emit", "run_meta", "machine_summary"]

_INTERNAL_FLAGS = ("--in-netns",)  # set by a bench re-running itself, not by the user
# flags whose value is a scratch place on the machine that ran the bench (not part of the
# result, and no place a reader has): `command` and `argv` show it as this placeholder
_PLACEHOLDERS = {"--log-dir": "DIR"}


def _placeheld(args: Sequence[str]) -> list[str]:
    out: list[str] = []
    for a in args:
        flag, eq, _ = a.partition("=")
        if out and out[-1] in _PLACEHOLDERS:
            out.append(_PLACEHOLDERS[out[-1]])
        elif eq and flag in _PLACEHOLDERS:
            out.append(f"{flag}={_PLACEHOLDERS[flag]}")
        else:
            out.append(a)
    return out


def emit(result: dict[str, Any], path: Path | None) -> int:
    """Print a benchmark's JSON and, with --json PATH, write it there; returns exit status 0.

    Adds `result["meta"]` (`run_meta()`) unless the bench set one itself.
    """
    result.setdefault("meta", run_meta())
    text = json.dumps(result, indent=2)
    print(text)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return 0


def check_json_path(path: Path) -> None:
    """CLIError naming `--json` unless a result can be written at `path`: checked before a
    bench runs, not found out after minutes of it. Creates the missing folders, as `emit` does."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CLIError(f"--json: cannot create {str(path.parent)!r}: {e.strerror or e}") from None
    if path.is_dir():
        raise CLIError(f"--json: {str(path)!r} is a directory")
    if not os.access(path if path.exists() else path.parent, os.W_OK):
        raise CLIError(f"--json: {str(path)!r} is not writable")


def run_meta(argv: Sequence[str] | None = None, now: datetime.datetime | None = None) -> dict[str, Any]:
    """`{"bench", "command", "argv", "date", "machine"}` of this process's run.

    `command` is the `kvmesh ...` command line when the process is the kvmesh CLI (the console
    script or `python -m kvmesh.cli`), a `--log-dir` value shown as DIR (the machine's scratch
    place; in `argv` too), else None (a bench called from a test); `bench` is the
    subcommand after `bench` in it.
    """
    argv = list(sys.argv if argv is None else argv)
    prog = Path(argv[0]).name if argv else ""
    is_cli = prog == "kvmesh" or (bool(argv) and argv[0].replace(os.sep, "/").endswith("kvmesh/cli.py"))
    args = [a for a in argv[1:] if a not in _INTERNAL_FLAGS] if is_cli else []
    bench = args[args.index("bench") + 1] if "bench" in args[:-1] else None
    when = (now or datetime.datetime.now(datetime.timezone.utc)).astimezone(datetime.timezone.utc)
    return {
        "bench": bench,
        "command": shlex.join(["kvmesh", *_placeheld(args)]) if is_cli else None,
        "argv": argv[:1] + _placeheld(argv[1:]),
        "date": when.isoformat(timespec="seconds"),
        "machine": machine_summary(),
    }


def machine_summary() -> dict[str, Any]:
    """What the machine is, without importing torch: CPU model, cores, memory, OS, Python, the
    load average (1, 5, 15 min) when the result is written, and torch's version and device when
    the bench has loaded torch."""
    out: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "load_avg": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = torch.__version__
        out["torch_threads"] = torch.get_num_threads()
        out["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return out


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux
        lines = []
    for line in lines:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:  # not Linux
        return None
    for line in lines:
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 2**20, 1)
    return None
