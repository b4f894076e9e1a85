"""scripts/gpu-check --cpu-dry-run: runs here, writes one JSON and one log, says what it skipped.

The quick test runs the steps that need no model; the slow one runs every step (as the
issue asks: the dry run goes to the end on a CPU machine)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check"


def dry_run(out: Path, *only: str) -> dict:  # type: ignore[type-arg]
    argv = [sys.executable, str(SCRIPT), "--cpu-dry-run", "--out", str(out)]
    for step in only:
        argv += ["--only", step]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "gpu-check.log").read_text().strip()
    return json.loads((out / "gpu-check.json").read_text())


@pytest.mark.multiproc
def test_dry_run_of_the_steps_without_a_model(tmp_path: Path) -> None:
    result = dry_run(tmp_path, "env", "bench_engine", "attention_bw")
    steps = result["steps"]
    assert result["dry_run"] is True and list(steps) == ["env", "bench_engine", "attention_bw"]
    assert steps["env"]["status"] == "ok" and steps["env"]["triton_interpret"] == "1"
    assert steps["bench_engine"]["status"] == "skipped" and "needs CUDA" in steps["bench_engine"]["reason"]
    bw = steps["attention_bw"]
    assert bw["status"] == "ok" and bw["bf16_batch64_4k_fraction"] is None and len(bw["rows"]) == 2


@pytest.mark.multiproc
@pytest.mark.skipif(importlib.util.find_spec("torch") is None or __import__("torch").cuda.is_available(),
                    reason="with CUDA the real run would start")
def test_without_cuda_the_real_run_refuses(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "--cpu-dry-run" in proc.stderr


@pytest.mark.slow
@pytest.mark.multiproc
def test_whole_dry_run_goes_to_the_end(tmp_path: Path) -> None:
    steps = dry_run(tmp_path)["steps"]
    assert list(steps) == ["env", "compile", "gpu_tests", "bench_engine", "attention_bw", "graph_vs_eager",
                           "peer_transfer"]
    assert steps["compile"]["arch"] == "sm_90" and all("error" not in r for r in steps["compile"]["variants"])
    assert all(s["status"] in ("ok", "skipped") for s in steps.values()), steps
    assert steps["peer_transfer"]["gloo"]["bytes_equal"] is True
    assert "CUDA graphs need CUDA" in steps["graph_vs_eager"]["skipped"]
