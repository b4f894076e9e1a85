"""Every `kvmesh bench` runs with --quick and writes JSON with its documented keys.

Benchmarks are not tests: these only check that each one runs end to end (through the CLI,
on a tiny random-weight model so each takes seconds) and that its JSON is well formed.
The accuracy bench reads the tiny model's inputs as UTF-8 bytes (it has no tokenizer).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from kvmesh.bench.accuracy_text import accuracy_text
from kvmesh.bench.engine import capacity_per_dtype
from kvmesh.bench.engine_speed import MachineSpeed, ModelCost, decode_roofline, workload_roofline
from kvmesh.cli import main
from kvstore.layout import KVLayout

DTYPES = ["fp32", "fp16", "bf16", "fp8", "int8", "int4"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> str:
    # 2,048 positions: the prefix bench sends a 1,024-token prefix, memory up to 1,025 tokens
    return str(tiny_model_dir("llama-gqa", max_position_embeddings=2048))


def run_bench(name: str, model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
              *extra: str) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    assert main(["bench", name, "--quick", "--json", str(out), "--model", model, *extra]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert json.loads(printed) == result
    assert {"cpu", "cores", "torch", "cuda"} <= set(result["machine"])
    return result


def finite(*values: Any) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def test_bench_engine(tiny: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = run_bench("engine", tiny, tmp_path, capsys)
    for batch in ("batch1", "batch16"):
        row = r[batch]
        assert {"kvmesh_tok_s", "hf_tok_s", "speedup", "kvmesh_s", "hf_s", "tokens"} <= set(row)
        assert finite(row["kvmesh_tok_s"], row["hf_tok_s"], row["speedup"]) and row["tokens"] > 0
    assert finite(r["roofline_tok_s"]) and r["roofline_tok_s"] > 0
    assert r["config"]["batch1_new_tokens"] == 32
    for batch in ("batch1", "batch16"):
        row = r[batch]
        assert finite(row["roofline_tok_s"], row["roofline_frac"], row["linear_gb_s"]) and row["linear_gb_s"] > 0
        assert row["roofline_frac"] == pytest.approx(row["kvmesh_tok_s"] / row["roofline_tok_s"])
    assert r["batch1"]["roofline_tok_s"] == r["roofline_tok_s"] == r["roofline"]["batch1_tok_s"]
    roof = r["roofline"]
    assert finite(roof["read_gb_s"], roof["copy_gb_s"], roof["matmul_gflop_s"]) and roof["weight_bytes"] > 0
    pre = r["prefill"]
    assert pre["tokens"] == 1024 and finite(pre["tok_s"], pre["peak_frac"]) and pre["tok_s"] > 0
    assert pre["peak_frac"] == pytest.approx(pre["gflop_s"] / roof["matmul_gflop_s"])
    assert r["config"]["native_linear"] and {"roofline_frac", "prefill", "metrics_cost"} <= set(r["notes"])
    cost = r["metrics_cost"]         # decode with worker metrics on vs off, same run
    assert finite(cost["off_tok_s"], cost["on_tok_s"]) and cost["off_tok_s"] > 0 and cost["runs"] == 3
    assert cost["on_vs_off"] == pytest.approx(cost["on_tok_s"] / cost["off_tok_s"])
    assert cost["within_3pct"] == (cost["on_vs_off"] >= 0.97)
    assert r["config"]["attention_backend"] in ("native", "torch") and r["config"]["cuda_graphs"] is False
    assert r["weight_dtype"] == "auto" and r["weight_format"].startswith("fp32")   # an fp32 HF dir's own
    assert r["batch1"]["weight_bytes_per_token"] == roof["weight_bytes"]
    for batch in ("batch1", "batch16"):   # llama-batched-bench's shape, the decode timed apart from the prefill
        row = r[batch]
        assert finite(row["decode_tok_s"], row["decode_prefill64_tok_s"]) and row["decode_tok_s"] > 0
    assert r["batch1"]["decode_roofline_frac"] == pytest.approx(r["batch1"]["decode_tok_s"] / r["roofline_tok_s"])
    assert {"decode_tok_s", "decode_roofline_frac"} <= set(r["notes"])


def test_bench_engine_weight_dtype(tiny: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--weight-dtype q8_0: the weights quantized at load, their real bytes (8.5 bits a weight)
    in the roofline; the prefill of a 64-token prompt is reported too."""
    r = run_bench("engine", tiny, tmp_path, capsys, "--weight-dtype", "q8_0")
    assert r["weight_dtype"] == "q8_0" and r["weight_format"] == "q8_0 (15)"
    params = 2 * (64 * (64 + 2 * 32) + 64 * 64 + 2 * 128 * 64 + 64 * 128) + 256 * 64   # layers + tied head
    norms = (2 * 2 + 1) * 64 * 4
    weight_bytes = params * 17 // 16 + norms
    assert r["batch1"]["weight_bytes_per_token"] == weight_bytes
    assert r["batch1"]["roofline_tok_s"] == pytest.approx(r["roofline"]["read_gb_s"] * 1e9 / weight_bytes)
    assert finite(r["prefill"]["tok_s_64"]) and r["config"]["qlinear_isa"] in ("avx512", "avx2")


@pytest.mark.multiproc
def test_bench_profile(tiny: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both sides run in their own process: the native kernels loaded on one, off on the other."""
    r = run_bench("profile", tiny, tmp_path, capsys)
    assert r["native"]["native_kernels"] is True and r["torch"]["native_kernels"] is False
    for side in ("native", "torch"):
        row = r[side]
        assert finite(row["step_ms"], row["linear_ms"], row["linear_gb_s"], row["rest_ms"]) and row["step_ms"] > 0
        assert row["rest_ms"] == pytest.approx(row["step_ms"] - row["linear_ms"])
        assert row["ops"] and all(ms >= 0 for ms in row["ops"].values())
    assert "aten::mm" in r["torch"]["ops"]          # F.linear on the torch side
    assert r["speedup"]["step"] == pytest.approx(r["torch"]["step_ms"] / r["native"]["step_ms"])
    assert r["config"]["steps"] == 16


def test_roofline_formulas() -> None:
    """The workload roofline against the cases it reduces to: all memory-bound steps, and all
    compute-bound (every step's flops at the peak)."""
    cost = ModelCost(weight_bytes=1000, layer_params=100, head_params=20, attn_flops_per_pair=4)
    assert cost.decode_flops(0) == 240 and cost.decode_flops(10) == 280
    assert cost.prefill_flops(3) == 2 * 100 * 3 + 2 * 20 + 4 * 6
    slow_memory = MachineSpeed(read_gb_s=1e-9, copy_gb_s=1e-9, matmul_gflop_s=1e9)   # 1 byte/s, 1e18 flop/s
    assert decode_roofline(slow_memory, cost) == pytest.approx(1 / 1000)
    # prefill costs one weight read, then one read per decode step: 1 + (max(out) - 1) reads
    assert workload_roofline(slow_memory, cost, [5, 9], [4, 2]) == pytest.approx(6 / (4 * 1000))
    slow_compute = MachineSpeed(read_gb_s=1e9, copy_gb_s=1e9, matmul_gflop_s=1e-9)   # 1 flop/s
    assert decode_roofline(slow_compute, cost) == pytest.approx(1 / 240)
    flops = cost.prefill_flops(5) + cost.prefill_flops(9)
    flops += sum(cost.decode_flops(p + s) for p, n in ((5, 4), (9, 2)) for s in range(1, n))
    assert workload_roofline(slow_compute, cost, [5, 9], [4, 2]) == pytest.approx(6 / flops)


def test_bench_prefix(tiny: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = run_bench("prefix", tiny, tmp_path, capsys)
    assert finite(r["cold_ttft_s"], r["warm_ttft_s"], r["speedup"])
    assert r["speedup"] == pytest.approx(r["cold_ttft_s"] / r["warm_ttft_s"])
    assert r["config"]["prefix_tokens"] == 1024


def test_bench_memory(tiny: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = run_bench("memory", tiny, tmp_path, capsys)
    assert 0 <= r["paged_waste_frac"] < r["contiguous_waste_frac"] < 1
    assert r["paged_max_seqs"] >= r["contiguous_max_seqs"] > 0
    per = r["per_dtype"]
    assert set(per) == set(DTYPES)
    for row in per.values():
        assert {"bytes_per_token", "max_seqs"} <= set(row) and row["max_seqs"] > 0
    # the pool itself is the fp32 one; its own row reproduces paged_max_seqs
    assert r["config"]["kv_cache_dtype"] == "fp32"
    assert abs(per["fp32"]["max_seqs"] - r["paged_max_seqs"]) <= 1
    # capacity follows bytes per token (tiny: head_dim 16, so scales cost more than on real models)
    for dtype in ("int8", "fp8", "int4"):
        ratio = per["fp16"]["bytes_per_token"] / per[dtype]["bytes_per_token"]
        assert per[dtype]["max_seqs"] == pytest.approx(ratio * per["fp16"]["max_seqs"], rel=0.01, abs=1)


def test_capacity_per_dtype_on_smollm2_shape() -> None:
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, kv_cache_dtype="fp32")
    per = capacity_per_dtype(layout, budget_bytes=1 << 30, mean_blocks=16.0)
    assert per["int8"]["capacity_vs_fp16"] == pytest.approx(128 / 66, abs=0.01)  # 2x minus one fp16 scale
    assert per["int4"]["capacity_vs_fp16"] == pytest.approx(128 / 40, abs=0.01)  # 4x minus a scale per 16
    assert per["fp32"]["capacity_vs_fp16"] == pytest.approx(0.5, abs=0.01)
    assert per["int8"]["num_blocks"] == (1 << 30) // (16 * 30 * 2 * 3 * 66)


def test_bench_accuracy(tiny: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = run_bench("accuracy", tiny, tmp_path, capsys)
    for dtype in [*DTYPES, "int4-uncalibrated"]:
        row = r[dtype]
        assert {"ppl", "ppl_delta_frac", "token_agreement", "bytes_per_token"} <= set(row)
        assert finite(row["ppl"], row["ppl_delta_frac"], row["token_agreement"]) and row["ppl"] > 1
        assert 0 <= row["token_agreement"] <= 1 and 0 <= row["free_running_agreement"] <= 1
    assert r["fp32"]["ppl_delta_frac"] == 0 and r["fp32"]["token_agreement"] == 1
    bpt = [r[d]["bytes_per_token"] for d in ("fp32", "fp16", "int8", "int4")]
    assert bpt == sorted(bpt, reverse=True) and r["int8"]["bytes_per_token"] == r["fp8"]["bytes_per_token"]
    assert r["int4-uncalibrated"]["bytes_per_token"] == r["int4"]["bytes_per_token"]
    for name in ("streaming-50", "h2o-50", "streaming-25", "h2o-25", "h2o-50-nodecay"):
        row = r[name]
        assert finite(row["ppl"], row["text_agreement"]) and row["ppl"] > 1
        assert row["kv_budget_tokens"] == 512 * int(name.split("-")[1]) // 100
        assert 0 <= row["text_agreement"] <= 1
    assert r["fp32"]["text_agreement"] == 1
    assert {"baseline", "text", "ppl", "token_agreement", "eviction"} <= set(r["notes"])
    assert r["config"]["window_tokens"] == 512
    weights = r["weights"]                # the weight-dtype axis, fp32 weights the baseline
    assert weights["fp32"]["ppl_delta_frac"] == 0 and weights["auto"]["weight_format"].startswith("fp32")
    for wd in ("bf16", "q8_0", "q4_0", "q4_1"):
        row = weights[wd]
        assert finite(row["ppl"], row["ppl_delta_frac"]) and row["weight_format"].startswith(wd)
        assert row["weight_bytes"] < weights["fp32"]["weight_bytes"]
    assert weights["q4_1"]["weight_bytes"] < weights["q8_0"]["weight_bytes"] < weights["bf16"]["weight_bytes"]


def test_windowed_ppl_counts_the_second_half_of_each_window() -> None:
    """llama-perplexity's protocol: the NLL of tokens ctx/2 + 1 .. ctx - 1 of each window."""
    import torch

    from kvmesh.bench.accuracy_weights import windowed_ppl

    class Uniform:  # every next token of a vocab of 8 equally likely but token 3, twice as likely
        def logits(self, ids: list[int]) -> torch.Tensor:
            row = torch.zeros(8)
            row[3] = math.log(2)
            return row.repeat(len(ids), 1)

    ids = [3] * 8 + [5] * 8          # window 0 scores three 3s, window 1 three 5s
    p3, p5 = 2 / 9, 1 / 9
    expected = math.exp(-(3 * math.log(p3) + 3 * math.log(p5)) / 6)
    assert windowed_ppl(Uniform(), ids, 8, 2) == pytest.approx(expected)


def test_llama_cpp_batched_bench_table_is_parsed() -> None:
    """The table llama-batched-bench prints (tools/batched-bench: its LOG format), as `--llama-cpp` reads it."""
    from kvmesh.bench.llama_cpp import BatchedRow, parse_batched_table

    text = ("main: n_kv_max = 3136, n_batch = 2048\n\n"
            "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |\n"
            "|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|\n"
            "|    64 |    128 |    1 |    192 |    0.101 |   633.66 |    1.085 |   117.97 |    1.186 |   161.89 |\n"
            "|    64 |    128 |   16 |   3072 |    1.552 |   659.79 |    7.750 |   264.26 |    9.302 |   330.26 |\n")
    assert parse_batched_table(text) == [BatchedRow(64, 128, 1, 633.66, 117.97),
                                         BatchedRow(64, 128, 16, 659.79, 264.26)]


def test_bench_accuracy_text_flag(tiny: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    short = tmp_path / "short.txt"
    short.write_text("too short to score")
    assert main(["bench", "accuracy", "--quick", "--model", tiny, "--text", str(short)]) == 2
    assert capsys.readouterr().err.startswith("kvmesh bench: --text:")
    assert main(["bench", "accuracy", "--quick", "--model", tiny, "--text", str(tmp_path / "missing.txt")]) == 2
    assert "--text: cannot read" in capsys.readouterr().err
    text, source, path = accuracy_text(short)
    assert text == "too short to score" and source == str(short) and path == short


def test_accuracy_text_is_the_interpreters_license() -> None:
    import sysconfig
    text, source, path = accuracy_text()
    assert len(text) > 10_000 and "Python" in text
    assert path == Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"   # the file llama.cpp's tools read
    assert text == path.read_text(encoding="utf-8")
    assert source.startswith("the interpreter's LICENSE.txt") and "/" not in source   # no machine path in docs


def test_decode_phase_splits_prefill_from_decode(tiny: str) -> None:
    """llama-batched-bench's split: every request's first token comes from the prefill; the decode
    phase counts the tokens after it, new_tokens per request."""
    from kvmesh.bench.engine_speed import best_decode_phase, decode_phase
    from worker.engine.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=tiny, block_size=16, num_blocks=64))
    prompts = [[5 + i] * 16 for i in range(3)]
    ph = decode_phase(engine, prompts, 4)
    assert ph.decode_tokens == 3 * 4 and ph.prefill_s > 0 and ph.decode_s > 0
    assert ph.decode_tok_s == pytest.approx(12 / ph.decode_s)
    assert not engine.has_unfinished()
    best = best_decode_phase(engine, prompts[:1], 3, 2)
    assert best.decode_tokens == 3


def test_llama_cpp_gguf_for_each_weight_dtype(tmp_path: Path) -> None:
    """`auto` runs the checkpoint itself; a named format a pure file made once by llama-quantize,
    the embedding and output tensor in that format too (the weights kvmesh's --weight-dtype runs),
    even when the format is the file's main one (the shipped Q4_1 file's embedding is Q8_0)."""
    import os
    import stat

    from kvmesh.bench.llama_cpp import gguf_for

    source = tmp_path / "model.Q4_1.gguf"
    source.write_bytes(b"gguf")
    log = tmp_path / "calls.txt"
    fake = tmp_path / "llama-quantize"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\n: > "$(eval echo \\${{$(($# - 1))}})"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    assert gguf_for(tmp_path, source, "auto") == source and not log.exists()
    for wd, t in (("q4_1", "Q4_1"), ("q8_0", "Q8_0"), ("fp32", "F32")):
        out = gguf_for(tmp_path, source, wd)
        assert out == tmp_path / f"model.Q4_1.pure-{t}.gguf" and out.is_file()
        assert log.read_text().splitlines()[-1] == (f"--allow-requantize --pure --token-embedding-type {t} "
                                                    f"--output-tensor-type {t} {source} {out.with_suffix('.tmp')} {t}")
    calls = len(log.read_text().splitlines())
    gguf_for(tmp_path, source, "q8_0")      # made once
    assert len(log.read_text().splitlines()) == calls == 3
    assert os.access(fake, os.X_OK)


def test_docs_engine_section_shows_llama_cpp_rows() -> None:
    """`kvmesh bench docs`: an engine result with --llama-cpp figures gets their rows first (decode
    against S_TG, prefill against S_PP, the decode against the read roofline); one without, none."""
    from kvmesh.bench.docs_figures_engine import ENGINE_EXTRACT

    r: dict[str, Any] = {"batch1": {"decode_tok_s": 100.0, "roofline_tok_s": 200.0, "decode_roofline_frac": 0.5},
                         "batch16": {"decode_tok_s": 300.0}, "prefill": {"tok_s_64": 450.0},
                         "weight_dtype": "q8_0", "weight_format": "q8_0 (211)"}
    plain = ENGINE_EXTRACT["engine"](r)[1]
    r["llama_cpp"] = {"threads": 2, "batch1_tok_s": 80.0, "batch16_tok_s": 150.0, "prefill64_tok_s": 300.0,
                      "kvmesh_vs_llama_cpp": {"batch1_tok_s": 1.25, "batch16_tok_s": 2.0, "prefill64_tok_s": 1.5}}
    baseline, figures = ENGINE_EXTRACT["engine"](r)
    assert baseline.startswith("llama.cpp on the same GGUF") and figures[4:] == plain   # llama.cpp rows first
    rows = figures[:4]
    assert [(f.value, f.baseline, f.versus) for f in rows] == [
        ("100 tok/s", "80 tok/s (llama.cpp S_TG)", "1.25x"), ("300 tok/s", "150 tok/s (llama.cpp S_TG)", "2.00x"),
        ("450 tok/s", "300 tok/s (llama.cpp S_PP)", "1.50x"), ("100 tok/s", "200 tok/s (roofline)", "0.5 of roofline")]
    assert rows[0].name == "batch 1 decode vs llama.cpp (q8_0: q8_0 (211), 2 threads)"


def test_llama_tokenize_ids_are_parsed() -> None:
    """llama-tokenize --ids prints the ids as one list (its last such line is read)."""
    from kvmesh.bench.llama_cpp import parse_token_ids

    assert parse_token_ids("load: ...\n[49, 30, 48534, 6016]\n") == [49, 30, 48534, 6016]
    assert parse_token_ids("[]\n") == []
    with pytest.raises(RuntimeError, match="no ids"):
        parse_token_ids("error: cannot open file\n")


def test_docs_accuracy_section_shows_the_weight_axis() -> None:
    """`kvmesh bench docs`: the accuracy section ends with a row per weight format, against
    llama-perplexity where it ran, else against fp32 weights; the KV rows stay first."""
    from kvmesh.bench.docs_figures_engine import ENGINE_EXTRACT

    r = {"fp32": {"ppl": 12.0}, "int8": {"ppl": 12.1, "ppl_delta_frac": 0.0083, "token_agreement": 0.99},
         "notes": {"ppl": "exp(mean NLL) ..."},
         "weights": {"fp32": {"ppl": 12.47, "weight_format": "fp32 (211)", "llama_cpp_ppl": 12.5,
                              "vs_llama_cpp_frac": -0.0024},
                     "bf16": {"ppl": 12.49, "weight_format": "bf16 (211)", "ppl_delta_frac": 0.0011},
                     "notes": {"ppl": "..."}}}
    figs = ENGINE_EXTRACT["accuracy"](r)[1]
    assert [f.name for f in figs] == ["int8: perplexity", "weights fp32 (fp32 (211)): perplexity vs llama.cpp",
                                      "weights bf16 (bf16 (211)): perplexity vs fp32 weights"]
    assert (figs[1].value, figs[1].baseline, figs[1].versus) == ("12.47", "12.5 (llama-perplexity)", "-0.24%")
    assert figs[2].versus == "+0.11%"
