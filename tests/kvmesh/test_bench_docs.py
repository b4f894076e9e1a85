"""`kvmesh bench docs` renders one section per result file with its command, date, machine and
headline figures against the same-run baseline, and the README's headline block from the same
files; `emit` records the metadata it reads."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from kvmesh.bench.docs import BEGIN, END, load_sections, update_readme
from kvmesh.bench.docs_figures import bench_of
from kvmesh.bench.report import emit, run_meta
from kvmesh.cli import main

PREFIX = {
    "cold_ttft_s": 4.31,
    "warm_ttft_s": 0.225,
    "speedup": 4.31 / 0.225,
    "config": {"prefix_tokens": 1024, "suffix_tokens": 32, "trials": 2, "block_size": 16},
}
META = {
    "bench": "prefix",
    "command": "kvmesh bench prefix --quick --json docs/results/prefix.json",
    "date": "2026-01-02T03:04:05+00:00",
    "machine": {"cpu": "Test CPU 9000", "cores": 2, "memory_gib": 24.0, "torch": "2.13.0+cpu", "cuda": None},
}
TRANSFER = {
    "bench": "transfer",
    "offload_vs_memcpy": 0.99,
    "peer_vs_raw": 0.74,
    "offload": {
        "offload_gb_s": 4.41,
        "onload_gb_s": 5.1,
        "memcpy_gb_s": 4.44,
        "offload_vs_memcpy": 0.99,
        "onload_vs_memcpy": 1.15,
    },
    "peer": {"peer_gb_s": 1.11, "raw_gb_s": 1.50, "peer_vs_raw": 0.74},
    "ttft": {"prefix_tokens": 1024, "fetched_s": 0.81, "recomputed_s": 6.85, "local_hit_s": 0.20},
}


def write(path: Path, doc: dict) -> Path:
    path.write_text(json.dumps(doc))
    return path


def test_a_result_becomes_a_section_with_its_command_date_machine_and_ratio(tmp_path: Path, capsys) -> None:
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    write(results / "prefix.json", PREFIX | {"meta": META})
    write(results / "transfer-quick.json", TRANSFER)  # metadata in a sidecar file
    write(
        results / "transfer-quick.meta.json", META | {"bench": "transfer", "command": "kvmesh bench transfer --quick"}
    )
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{BEGIN}\nstale row\n{END}\n\nrest\n")
    out = tmp_path / "docs" / "benchmarks.md"
    assert main(["bench", "docs", "--results", str(results), "--out", str(out), "--readme", str(readme)]) == 0
    page = out.read_text()
    assert "### `kvmesh bench prefix --quick --json docs/results/prefix.json`" in page
    assert "2026-01-02T03:04:05+00:00" in page and "Test CPU 9000, 2 cores, 24.0 GiB" in page
    assert "| TTFT, 1024-token cached prefix | 0.225 s | 4.31 s (cold) | 19.16x faster |" in page
    assert "| peer transfer | 1.11 GB/s | 1.5 GB/s (raw send) | 0.74x |" in page
    assert "| TTFT, 1024-token peer-held prefix fetched | 0.81 s | 6.85 s (recomputed) | 8.46x faster |" in page
    assert "[`results/prefix.json`](results/prefix.json)" in page
    assert "transfer-quick.meta" not in page  # a sidecar is no section of its own
    text = readme.read_text()
    assert "stale row" not in text and text.endswith("\n\nrest\n")
    assert "[`kvmesh bench prefix --quick --json docs/results/prefix.json`](docs/benchmarks.md#prefix)" in text
    assert "kvmesh bench docs: 2 result(s)" in capsys.readouterr().out


def test_missing_figures_render_as_a_dash_and_unknown_files_list_their_numbers(tmp_path: Path) -> None:
    write(tmp_path / "engine.json", {"batch1": {"kvmesh_tok_s": 20.6}, "batch16": {}})
    write(tmp_path / "other.json", {"answer": 42, "label": "text"})
    engine, other = load_sections(tmp_path)
    assert engine.bench == "engine" and engine.command == "not recorded"
    assert engine.figures[0].value == "20.6 tok/s" and engine.figures[0].baseline == "—"
    assert other.bench == "unknown" and [f.name for f in other.figures] == ["answer"]


def test_every_bench_is_recognised_by_its_keys() -> None:
    assert bench_of({}, {"batch1": {}, "batch16": {}}) == "engine"
    assert bench_of({}, {"pressure": {}}) == "routing-live"
    assert bench_of({}, {"int8": {"ppl": 1.0, "ppl_delta_frac": 0.0}}) == "accuracy"
    assert bench_of({}, {"simulation": {}}) == "router"
    assert bench_of({"bench": "chaos"}, {}) == "chaos"


def test_a_readme_without_markers_is_left_alone() -> None:
    assert update_readme("no markers here\n", "| table |") == "no markers here\n"


def test_emit_records_the_command_date_and_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr("sys.argv", ["/venv/bin/kvmesh", "bench", "prefix", "--quick", "--json", "r.json"])
    out = tmp_path / "r.json"
    assert emit({"speedup": 2.0}, out) == 0
    doc = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == doc
    meta = doc["meta"]
    assert meta["bench"] == "prefix" and meta["command"] == "kvmesh bench prefix --quick --json r.json"
    assert datetime.datetime.fromisoformat(meta["date"]).tzinfo is not None
    assert meta["machine"]["cores"] >= 1
    when = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    inner = run_meta(["/repo/kvmesh/cli.py", "bench", "chaos", "--in-netns", "--quick"], when)
    assert inner["command"] == "kvmesh bench chaos --quick" and inner["date"] == "2026-01-02T03:04:05+00:00"
    assert run_meta(["pytest", "-q"])["command"] is None
    logged = run_meta(["kvmesh", "bench", "routing-live", "--log-dir", "/tmp/x", "--quick", "--log-dir=/tmp/y"])
    assert logged["command"] == "kvmesh bench routing-live --log-dir DIR --quick --log-dir=DIR"   # a scratch place
    assert logged["argv"][:3] == ["kvmesh", "bench", "routing-live"] and "/tmp/x" not in str(logged["argv"])


def test_a_routing_live_row_shows_the_cached_ceiling_when_the_run_has_one() -> None:
    from kvmesh.bench.docs_figures import figures_of

    def entry(cached: float, **more: float) -> dict:
        return {"ttft_p50_s": 0.3, "req_s": 6.0, "cached_token_frac": cached, "cold_requests": 11,
                "min_cold_requests": 11, "mismatch_rate": 0.0, "requests_per_worker": {"w0": 24, "w1": 24}} | more

    new = {"shift": {"kv_aware": entry(0.685, max_cached_token_frac=0.685), "round_robin": entry(0.639)}}
    old = {"shift": {"kv_aware": entry(0.685), "round_robin": entry(0.639)}}
    (row,) = figures_of("routing-live", new)[1]
    assert "cached 0.685 (ceiling 0.685), cold 11 (min 11)" in row.value
    (row,) = figures_of("routing-live", old)[1]
    assert "ceiling" not in row.value and "cached 0.685, cold 11" in row.value
