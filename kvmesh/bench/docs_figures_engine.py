"""Figure extractors of the benches on one engine (engine, profile, prefix, memory, accuracy,
transfer): each takes a result and returns (the baseline in words, the headline figures)."""

from __future__ import annotations

from typing import Any

from kvmesh.bench.docs_figures_fmt import Extract, Figure, _at, _g, _pct, _ratio, _x


def _engine(r: dict[str, Any]) -> tuple[str, list[Figure]]:
    out = []
    for batch, label in (("batch1", "batch 1"), ("batch16", "batch 16")):
        row = r.get(batch, {})
        out.append(
            Figure(
                f"{label} decode vs HF",
                _g(row.get("kvmesh_tok_s"), "tok/s"),
                _g(row.get("hf_tok_s"), "tok/s (HF)"),
                _x(row.get("speedup")),
            )
        )
        out.append(
            Figure(
                f"{label} vs roofline",
                _g(row.get("kvmesh_tok_s"), "tok/s"),
                _g(row.get("roofline_tok_s"), "tok/s (roofline)"),
                f"{_g(row.get('roofline_frac'))} of roofline",
            )
        )
    pre = r.get("prefill", {})
    out.append(
        Figure(
            "cold prefill vs matmul peak",
            _g(pre.get("gflop_s"), "GFLOP/s"),
            _g(_at(r, "roofline", "matmul_gflop_s"), "GFLOP/s (peak)"),
            f"{_g(pre.get('peak_frac'))} of peak",
        )
    )
    mc = r.get("metrics_cost", {})
    out.append(
        Figure(
            "batch 16 with metrics on vs off",
            _g(mc.get("on_tok_s"), "tok/s"),
            _g(mc.get("off_tok_s"), "tok/s (off)"),
            _x(mc.get("on_vs_off")),
        )
    )
    lc = _llama_cpp(r)   # first when present: the README's row for the file is its first figure
    base = "HF transformers and the measured rooflines, same run"
    return (f"llama.cpp on the same GGUF and threads, {base}", lc + out) if lc else (base, out)


def _llama_cpp(r: dict[str, Any]) -> list[Figure]:
    """`--llama-cpp` rows: kvmesh's decode (timed apart from the prefill, as llama-batched-bench
    times it) and 64-token prefill against llama.cpp on the same GGUF and threads."""
    lc = r.get("llama_cpp")
    if not isinstance(lc, dict):
        return []
    vs = lc.get("kvmesh_vs_llama_cpp", {})
    fmt = f"{r.get('weight_dtype', '?')}: {r.get('weight_format', '?')}, {lc.get('threads', '?')} threads"
    out = [
        Figure(
            f"batch {b} decode vs llama.cpp ({fmt})",
            _g(_at(r, f"batch{b}", "decode_tok_s"), "tok/s"),
            _g(lc.get(f"batch{b}_tok_s"), "tok/s (llama.cpp S_TG)"),
            _x(vs.get(f"batch{b}_tok_s")),
        )
        for b in (1, 16)
    ]
    out.append(
        Figure(
            "64-token prefill vs llama.cpp",
            _g(_at(r, "prefill", "tok_s_64"), "tok/s"),
            _g(lc.get("prefill64_tok_s"), "tok/s (llama.cpp S_PP)"),
            _x(vs.get("prefill64_tok_s")),
        )
    )
    out.append(
        Figure(
            "batch 1 decode vs read roofline",
            _g(_at(r, "batch1", "decode_tok_s"), "tok/s"),
            _g(_at(r, "batch1", "roofline_tok_s"), "tok/s (roofline)"),
            f"{_g(_at(r, 'batch1', 'decode_roofline_frac'))} of roofline",
        )
    )
    return out


def _profile(r: dict[str, Any]) -> tuple[str, list[Figure]]:
    n, t, s = r.get("native", {}), r.get("torch", {}), r.get("speedup", {})
    return "the torch path (`KVMESH_NATIVE_KERNELS=0`), same run", [
        Figure(
            "batch-1 decode step",
            _g(n.get("step_ms"), "ms"),
            _g(t.get("step_ms"), "ms (torch)"),
            _x(s.get("step"), "faster"),
        ),
        Figure(
            "linear layers",
            _g(n.get("linear_ms"), "ms"),
            _g(t.get("linear_ms"), "ms (torch)"),
            _x(s.get("linear"), "faster"),
        ),
        Figure(
            "weight stream of the linear layers",
            _g(n.get("linear_gb_s"), "GB/s"),
            _g(t.get("linear_gb_s"), "GB/s (torch)"),
            _x(_ratio(n.get("linear_gb_s"), t.get("linear_gb_s"))),
        ),
        Figure(
            "rest of the step",
            _g(n.get("rest_ms"), "ms"),
            _g(t.get("rest_ms"), "ms (torch)"),
            _x(s.get("rest"), "faster"),
        ),
    ]


def _prefix(r: dict[str, Any]) -> tuple[str, list[Figure]]:
    prefix = _at(r, "config", "prefix_tokens")
    return "the same prompts cold (prefix cache reset), same run", [
        Figure(
            f"TTFT, {prefix or '?'}-token cached prefix",
            _g(r.get("warm_ttft_s"), "s"),
            _g(r.get("cold_ttft_s"), "s (cold)"),
            _x(r.get("speedup"), "faster"),
        )
    ]


def _memory(r: dict[str, Any]) -> tuple[str, list[Figure]]:
    out = [
        Figure(
            "KV slots wasted",
            _pct(r.get("paged_waste_frac")).lstrip("+"),
            _pct(r.get("contiguous_waste_frac")).lstrip("+") + " (contiguous)",
            "paged vs contiguous",
        ),
        Figure(
            "sequences in the budget",
            _g(r.get("paged_max_seqs")),
            _g(r.get("contiguous_max_seqs")) + " (contiguous)",
            _x(r.get("capacity_gain")),
        ),
    ]
    for dtype, row in (r.get("per_dtype") or {}).items():
        out.append(
            Figure(
                f"sequences in the budget, {dtype} KV",
                _g(row.get("max_seqs")),
                _g(_at(r, "per_dtype", "fp16", "max_seqs")) + " (fp16)",
                _x(row.get("capacity_vs_fp16")),
            )
        )
    return "a contiguous allocator reserving the full length; fp16 KV for the dtype rows", out


def _accuracy(r: dict[str, Any]) -> tuple[str, list[Figure]]:
    rows = {k: v for k, v in r.items() if isinstance(v, dict) and isinstance(v.get("ppl"), (int, float))}
    names = list(rows)
    base = names[0] if names else "fp32"
    out = []
    for name in names[1:]:
        v = rows[name]
        out.append(
            Figure(
                f"{name}: perplexity",
                _g(v.get("ppl"), digits=5),
                _g(rows[base].get("ppl"), digits=5) + f" ({base})",
                f"{_pct(v.get('ppl_delta_frac'))}, agreement {_g(v.get('token_agreement'))}",
            )
        )
    out += _weight_axis(r.get("weights"))
    return f"the {base} KV cache, same model and text, same run; " + str(_at(r, "notes", "text") or ""), out


def _weight_axis(w: Any) -> list[Figure]:
    """The weight-dtype axis: each format's perplexity against llama-perplexity on the GGUF of the
    same weights (with --llama-cpp), else against fp32 weights."""
    if not isinstance(w, dict):
        return []
    out = []
    for name, v in w.items():
        if not isinstance(v, dict) or not isinstance(v.get("ppl"), (int, float)):   # "notes" has a ppl text
            continue
        fmt = v.get("weight_format", name)
        if "llama_cpp_ppl" in v:
            out.append(Figure(f"weights {name} ({fmt}): perplexity vs llama.cpp", _g(v.get("ppl"), digits=5),
                              _g(v.get("llama_cpp_ppl"), digits=5) + " (llama-perplexity)",
                              _pct(v.get("vs_llama_cpp_frac"))))
        else:
            out.append(Figure(f"weights {name} ({fmt}): perplexity vs fp32 weights", _g(v.get("ppl"), digits=5),
                              "fp32 weights", _pct(v.get("ppl_delta_frac"))))
    return out


def _transfer(r: dict[str, Any]) -> tuple[str, list[Figure]]:
    off, peer, ttft = r.get("offload", {}), r.get("peer", {}), r.get("ttft", {})
    disk = r.get("disk", {})
    disk_rows = [
        Figure(
            f"disk tier write-behind ({disk.get('num_blocks', '?')} blocks, "
            f"median of {disk.get('rounds', '?')} rounds)",
            _g(disk.get("write_behind_gb_s"), "GB/s"),
            _g(disk.get("raw_write_gb_s"), "GB/s (sequential write)"),
            _x(disk.get("write_vs_raw")),
        ),
        Figure(
            "disk tier read-back",
            _g(disk.get("read_back_gb_s"), "GB/s"),
            _g(disk.get("raw_read_gb_s"), "GB/s (sequential read)"),
            _x(disk.get("read_vs_raw")),
        ),
        Figure(
            f"TTFT, {_at(disk, 'ttft', 'prefix_tokens') or '?'}-token prefix read back from disk",
            _g(_at(disk, "ttft", "disk_s"), "s"),
            _g(_at(disk, "ttft", "recomputed_s"), "s (recomputed)"),
            _x(disk.get("ttft_speedup"), "faster"),
        ),
    ] if disk else []
    return "a raw copy / raw `torch.distributed` send / plain file I/O of the same bytes; the prefix recomputed; " \
        "same run", [
        Figure(
            "offload to the host tier",
            _g(off.get("offload_gb_s"), "GB/s"),
            _g(off.get("memcpy_gb_s"), "GB/s (memcpy)"),
            _x(off.get("offload_vs_memcpy")),
        ),
        Figure(
            "onload from the host tier",
            _g(off.get("onload_gb_s"), "GB/s"),
            _g(off.get("memcpy_gb_s"), "GB/s (memcpy)"),
            _x(off.get("onload_vs_memcpy")),
        ),
        Figure(
            "peer transfer",
            _g(peer.get("peer_gb_s"), "GB/s"),
            _g(peer.get("raw_gb_s"), "GB/s (raw send)"),
            _x(peer.get("peer_vs_raw")),
        ),
        Figure(
            f"TTFT, {ttft.get('prefix_tokens', '?')}-token peer-held prefix fetched",
            _g(ttft.get("fetched_s"), "s"),
            _g(ttft.get("recomputed_s"), "s (recomputed)"),
            _x(_ratio(ttft.get("recomputed_s"), ttft.get("fetched_s")), "faster"),
        ),
        Figure(
            "TTFT, the same prefix as a local hit",
            _g(ttft.get("local_hit_s"), "s"),
            _g(ttft.get("recomputed_s"), "s (recomputed)"),
            _x(_ratio(ttft.get("recomputed_s"), ttft.get("local_hit_s")), "faster"),
        ),
        *disk_rows,
    ]


ENGINE_EXTRACT: dict[str, Extract] = {
    "engine": _engine,
    "profile": _profile,
    "prefix": _prefix,
    "memory": _memory,
    "accuracy": _accuracy,
    "transfer": _transfer,
}
