"""llama.cpp side by side: its `llama-batched-bench` and `llama-perplexity` on the same GGUF, text
and thread count as kvmesh (`kvmesh bench engine --llama-cpp DIR`, `kvmesh bench accuracy
--llama-cpp DIR`). DIR holds the binaries `scripts/build-llama-cpp` builds from the llama.cpp
copy vendored in the `llama-cpp-python` sdist. Never part of `make test`.

The GGUF for a weight format: the checkpoint itself for `auto` (kvmesh runs the file's own
tensors as they are stored); for an explicit format, `llama-quantize --allow-requantize --pure`
of it with the token embedding and output tensor in that format too, written once beside the
binaries: every weight in the one format, as kvmesh's `--weight-dtype` puts them (tensors already
in it are copied as stored, the others dequantized and quantized again with ggml's reference
quantizers, as kvmesh does). The shipped Q4_1 file is not a pure Q4_1 file (its embedding, which
is also the tied LM head, is Q8_0), so its side-by-side format is `auto`.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import NamedTuple

_LLAMA_TYPES = {"fp32": "F32", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1"}


class BatchedRow(NamedTuple):
    """One row of llama-batched-bench: `batch` sequences of `pp` prompt and `tg` new tokens."""

    pp: int
    tg: int
    batch: int
    s_pp: float   # prompt tokens / s (prefill)
    s_tg: float   # generated tokens / s, all sequences together (decode)


def _binary(bin_dir: Path, name: str) -> Path:
    path = bin_dir / name
    if not path.is_file():
        from contracts.cli import CLIError
        raise CLIError(f"--llama-cpp: {path} not found (scripts/build-llama-cpp {bin_dir.parent.parent} builds it)")
    return path


def quantize_args(source: Path, out: Path, weight_dtype: str) -> list[str]:
    """llama-quantize's arguments for a file with every weight in `weight_dtype` (see the module doc)."""
    t = _LLAMA_TYPES[weight_dtype]
    return ["--allow-requantize", "--pure", "--token-embedding-type", t, "--output-tensor-type", t,
            str(source), str(out), t]


def gguf_for(bin_dir: Path, source: Path, weight_dtype: str) -> Path:
    """The GGUF llama.cpp runs for kvmesh's `weight_dtype`: `source` for `auto`, else a pure
    file of that format made from it (once)."""
    if weight_dtype == "auto":
        return source
    out = bin_dir / f"{source.stem}.pure-{_LLAMA_TYPES[weight_dtype]}.gguf"
    if not out.is_file():
        tmp = out.with_suffix(".tmp")
        subprocess.run([str(_binary(bin_dir, "llama-quantize")), *quantize_args(source, tmp, weight_dtype)],
                       check=True, capture_output=True, timeout=1800)
        tmp.rename(out)
    return out


def batched_bench(bin_dir: Path, gguf: Path, threads: int, pp: int, tg: int,
                  batches: tuple[int, ...]) -> list[BatchedRow]:
    """llama-batched-bench -npp pp -ntg tg -npl batches on `threads` threads; its table's rows."""
    cmd = [str(_binary(bin_dir, "llama-batched-bench")), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
           "-c", str(max(batches) * (pp + tg) + 64), "-b", "2048", "-ub", "512", "-npp", str(pp), "-ntg", str(tg),
           "-npl", ",".join(map(str, batches))]
    run = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
    rows = parse_batched_table(run.stdout + "\n" + run.stderr)
    if not rows:
        raise RuntimeError(f"llama-batched-bench printed no table:\n{(run.stdout + run.stderr)[-2000:]}")
    return rows


def parse_batched_table(text: str) -> list[BatchedRow]:
    """The rows of llama-batched-bench's table (| PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s |
    S_TG t/s | T s | S t/s |)."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[0].isdigit():
            rows.append(BatchedRow(int(cells[0]), int(cells[1]), int(cells[2]), float(cells[5]), float(cells[7])))
    return rows


def perplexity(bin_dir: Path, gguf: Path, text: Path, ctx: int, chunks: int, threads: int) -> float:
    """llama-perplexity's final estimate over the first `chunks` windows of `ctx` tokens of `text`."""
    cmd = [str(_binary(bin_dir, "llama-perplexity")), "-m", str(gguf), "-f", str(text), "-c", str(ctx),
           "-b", str(ctx), "--chunks", str(chunks), "-t", str(threads)]
    run = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=3600)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr)
    if found is None:
        raise RuntimeError(f"llama-perplexity printed no final estimate:\n{(run.stdout + run.stderr)[-2000:]}")
    return float(found.group(1))


def tokenize(bin_dir: Path, gguf: Path, text: Path) -> list[int]:
    """`text`'s tokens by llama.cpp's own tokenizer (llama-tokenize, no BOS): the stream
    llama-perplexity scores. HF's tokenizer splits some whitespace runs differently (SmolLM2:
    "\n\n    " is one token here, "\n\n   " + " " there), which shifts every later window."""
    cmd = [str(_binary(bin_dir, "llama-tokenize")), "-m", str(gguf), "-f", str(text), "--ids", "--log-disable",
           "--no-bos"]
    run = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    return parse_token_ids(run.stdout)


def parse_token_ids(out: str) -> list[int]:
    """The id list llama-tokenize --ids prints ("[1, 2, 3]", its last such line)."""
    lines = [line.strip() for line in out.splitlines() if line.strip().startswith("[")]
    if not lines:
        raise RuntimeError(f"llama-tokenize printed no ids:\n{out[-2000:]}")
    body = lines[-1].strip("[]").strip()
    return [int(t) for t in body.split(",")] if body else []


def llama_tokens(bin_dir: Path, model: str, text: Path) -> list[int]:
    """`tokenize` with the model's own GGUF."""
    return tokenize(bin_dir, _source(model), text)


def _source(model: str) -> Path:
    from contracts.models import locate_model

    source = locate_model(model).gguf
    if source is None:
        from contracts.cli import CLIError
        raise CLIError(f"--llama-cpp: {model} is not a GGUF (llama.cpp runs GGUF files)")
    return source


def llama_perplexity(bin_dir: Path, model: str, weight_dtype: str, text: Path, ctx: int, chunks: int,
                     threads: int) -> float:
    """`perplexity` on the GGUF of `weight_dtype` (see `gguf_for`)."""
    return perplexity(bin_dir, gguf_for(bin_dir, _source(model), weight_dtype), text, ctx, chunks, threads)


def side_by_side(bin_dir: Path, model: str, weight_dtype: str, threads: int, tg: int,
                 kvmesh: dict[str, float], runs: int = 2) -> dict[str, object]:
    """llama-batched-bench (64-token prompts, `tg` new tokens, batch 1 and 16) on the GGUF of
    `weight_dtype`, `runs` times, the best of each figure (a busy moment on a shared machine
    only slows a run down; kvmesh's figures are best-of too), and kvmesh's figures over it:
    `kvmesh` holds batch1 / batch16 decode tok/s and prefill64 tok/s of the same run."""
    gguf = gguf_for(bin_dir, _source(model), weight_dtype)
    tables = [{r.batch: r for r in batched_bench(bin_dir, gguf, threads, 64, tg, (1, 16))} for _ in range(runs)]
    lc = {"batch1_tok_s": max(t[1].s_tg for t in tables), "batch16_tok_s": max(t[16].s_tg for t in tables),
          "prefill64_tok_s": max(t[1].s_pp for t in tables)}
    return {"gguf": str(gguf), "threads": threads, "runs": runs, **lc,
            "kvmesh_vs_llama_cpp": {k: kvmesh[k] / v for k, v in lc.items()}}
