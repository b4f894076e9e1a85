"""`kvmesh bench transfer` runs and reports its figures (benchmarks are not tests: the numbers
are not checked against targets here, only that they exist and are consistent)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvmesh.bench.transfer import bench_offload
from kvmesh.bench.transfer_disk import bench_disk_io, bench_disk_ttft
from kvmesh.cli import build_parser, main
from kvstore.layout import KVLayout

ROOT = Path(__file__).resolve().parents[2]


def test_transfer_is_a_bench_command_and_checks_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["bench", "transfer", "--quick", "--json", "x.json"])
    assert args.quick and args.json == Path("x.json") and args.prefix_tokens is None
    assert main(["bench", "transfer", "--prefix-tokens", "8"]) == 2
    assert "--prefix-tokens" in capsys.readouterr().err


def test_offload_figures_on_a_small_layout() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, kv_cache_dtype="fp32")
    r = bench_offload(layout, num_blocks=8, repeats=1, seed=0)      # asserts the round trip is exact
    assert r["num_bytes"] == 8 * layout.bytes_per_block and r["target"] == 0.8
    for key in ("offload", "onload"):
        assert r[f"{key}_gb_s"] > 0
        assert r[f"{key}_vs_memcpy"] == pytest.approx(r[f"{key}_gb_s"] / r["memcpy_gb_s"])


def test_disk_io_figures_on_a_small_layout(tmp_path: Path) -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, kv_cache_dtype="fp32")
    r = bench_disk_io(layout, num_blocks=8, repeats=1, seed=0, tmp=tmp_path)   # asserts the round trip is exact
    assert r["num_bytes"] == 8 * layout.bytes_per_block and r["target"] == 0.8
    assert r["rounds"] == 1 and r["write_vs_raw"] == pytest.approx(r["write_vs_raw_rounds"][0]) and r["read_vs_raw"] > 0


@pytest.mark.timeout(120)
def test_disk_ttft_with_the_prefix_already_written_through(tiny_model_dir: Any, tmp_path: Path) -> None:
    """The engine's disk tier writes every cached block through (the default): the bench's own
    spill of the prefix finds them held or queued and must not wait for a write that never
    comes (it did: the bench hung)."""
    r = bench_disk_ttft(str(tiny_model_dir("llama-gqa")), prefix_tokens=64, seed=0, vocab=256, path=tmp_path / "t")
    assert r["first_token_equal"] is True and r["disk_cached_tokens"] == 64 and r["blocks_read"] >= 4
    assert min(r["disk_s"], r["recomputed_s"]) > 0


@pytest.mark.slow
@pytest.mark.multiproc
def test_kvmesh_bench_transfer_quick_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "transfer.json"
    proc = subprocess.run([sys.executable, "-m", "kvmesh.cli", "bench", "transfer", "--quick", "--prefix-tokens", "64",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["offload_vs_memcpy"] == r["offload"]["offload_vs_memcpy"] > 0
    assert r["peer_vs_raw"] == r["peer"]["peer_vs_raw"] > 0
    assert r["peer"]["cpu_vs_raw"] == pytest.approx(r["peer"]["raw_cpu_ms"] / r["peer"]["peer_cpu_ms"])
    assert set(r["peer"]["phases_ms"]) == {"first_piece", "last_piece", "recv_hashing", "send_hashing", "total"}
    t = r["ttft"]
    assert t["prefix_tokens"] == 64 and t["first_token_equal"] is True
    assert min(t["recomputed_s"], t["fetched_s"], t["local_hit_s"]) > 0
    assert t["local_cached_tokens"] == 64
    if t["cost_model"]["decision"] == "fetch":
        assert t["blocks_fetched"] == 4 and t["fetched_peer_cached_tokens"] == 64
        assert isinstance(t["fetch_beats_recompute"], bool)
    else:
        assert t["cost_model"]["decision"] == "recompute" and t["fetch_beats_recompute"] is None
