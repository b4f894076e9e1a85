"""`make demo`: the capacity planner on the default model, then a real generation."""
from __future__ import annotations

import sys

from router.cli import main as kvmesh


def run() -> int:
    steps = [
        ["plan", "--model", "smollm2-135m", "--context", "8192", "--batch", "16", "--gpu-memory", "4"],
        ["generate", "--model", "smollm2", "--chat", "--max-tokens", "48",
         "--prompt", "In two sentences, what does a KV cache store in a transformer?"],
    ]
    for argv in steps:
        print(f"\n$ kvmesh {' '.join(repr(a) if ' ' in a else a for a in argv)}", flush=True)
        rc = kvmesh(argv)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(run())
