"""`kvmesh plan`: the capacity planner's flags and its table (the math is `kvstore.plan`)."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvstore.plan import (
    DEFAULT_LENGTHS,
    KV_CACHE_DTYPES,
    PRESETS,
    WEIGHTS_DTYPES,
    Plan,
    PlanError,
    format_bytes,
    load_model_shape,
    make_plan,
)


def _fmt_opt(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(row[i])) for row in (headers, *rows)) for i in range(len(headers))]
    fmt = "  " + "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return [fmt.format(*headers).rstrip(), *(fmt.format(*row).rstrip() for row in rows)]


def render_table(plan: Plan) -> str:
    """The human report: aligned sections with GiB/MiB/KiB units."""
    m, c = plan.model, plan.config
    kind = ("MHA" if m.num_key_value_heads == m.num_attention_heads else
            "MQA" if m.num_key_value_heads == 1 else "GQA")
    out = [f"kvmesh plan: {m.name} - {m.num_hidden_layers} layers, {m.num_attention_heads} heads,"
           f" {m.num_key_value_heads} kv heads ({kind}), head_dim {m.head_dim}",
           f"  {plan.num_params / 1e9:.2f} B params, weights {c.weights_dtype}, "
           f"kv_cache_dtype {plan.kv_cache_dtype}, block_size {c.block_size}", ""]
    out += _table(("KV cache", ""), [
        ("bytes per token", format_bytes(plan.bytes_per_token)),
        (f"bytes per block ({c.block_size} tokens)", format_bytes(plan.bytes_per_block)),
        (f"blocks per sequence ({c.context} tokens)", f"{plan.blocks_per_sequence:,}"),
        ("bytes per sequence", format_bytes(plan.bytes_per_sequence)),
        (f"bytes total (batch {c.batch})", format_bytes(plan.bytes_total)),
        ("weights", format_bytes(plan.weights_bytes)),
        (f"KV blocks the {c.weights_dtype} weights free vs fp32", f"+{plan.extra_blocks_vs_fp32:,}")])
    out.append("")
    if plan.usable_bytes is None or plan.kv_budget_bytes is None:
        out.append("  no --gpu-memory given: max_sequences and fit not computed")
    else:
        out += _table((f"GPU {c.gpu_memory_gib:g} GiB x {c.gpu_memory_utilization:g}", ""), [
            ("usable", format_bytes(plan.usable_bytes)),
            ("KV budget (usable - weights)", format_bytes(plan.kv_budget_bytes)),
            ("blocks in budget", _fmt_opt(plan.num_blocks)),
            (f"max sequences of {c.context} tokens", _fmt_opt(plan.max_sequences))])
        if plan.fits:
            out.append(f"  FITS: batch {c.batch} needs {format_bytes(plan.bytes_total)} of KV, "
                       f"{format_bytes(plan.kv_budget_bytes)} available")
        else:
            out.append(f"  DOES NOT FIT: needs {format_bytes(plan.bytes_total)} of KV, "
                       f"{format_bytes(plan.kv_budget_bytes)} available "
                       f"(batch {c.batch}, at most {plan.max_sequences} sequences fit)")
    out.append("")
    out += _table(("attention", "kv heads", "per token", "per sequence", "max seqs"), [
        (v.name + (" (model)" if v.is_model else ""), str(v.num_key_value_heads),
         format_bytes(v.bytes_per_token), format_bytes(v.bytes_per_sequence),
         _fmt_opt(v.max_sequences)) for v in plan.attention_variants])
    out.append("")
    out += _table(("kv dtype", "per token", "per sequence", "max seqs"), [
        (d.kv_cache_dtype, format_bytes(d.bytes_per_token), format_bytes(d.bytes_per_sequence),
         _fmt_opt(d.max_sequences)) for d in plan.per_dtype])
    if plan.sliding_window is not None:
        w = plan.sliding_window
        out.append("")
        out += _table((f"sliding window {w.window}", "per sequence", "max seqs"), [
            ("uncapped", format_bytes(w.bytes_per_sequence_uncapped),
             _fmt_opt(w.max_sequences_uncapped)),
            (f"capped ({w.blocks_per_sequence_capped} blocks)",
             format_bytes(w.bytes_per_sequence_capped), _fmt_opt(w.max_sequences_capped))])
    ws = plan.waste
    out.append("")
    out.append(f"  lengths {ws.lengths}: {ws.num_lengths} sequences, mean {ws.mean_length:.1f},"
               f" max {ws.max_length} tokens")
    out += _table(("allocation", "waste", "sequences admitted"), [
        (f"paged (block {c.block_size})", f"{ws.paged_waste_fraction:.1%}",
         _fmt_opt(ws.paged_sequences_admitted)),
        (f"contiguous ({ws.max_length} tokens)", f"{ws.contiguous_waste_fraction:.1%}",
         _fmt_opt(ws.contiguous_sequences_admitted))])
    out += [f"warning: {text}" for text in plan.warnings]
    return "\n".join(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvmesh plan`."""
    parser.add_argument("--model", required=True,
                        help=f"a preset ({', '.join(PRESETS)}), a local HF model dir, "
                             "or a config.json path")
    parser.add_argument("--context", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="concurrent sequences")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="KV storage dtype; auto = the compute dtype of the weights")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--gpu-memory", type=float, default=None, dest="gpu_memory",
                        help="GPU memory in GiB (enables max_sequences and fits)")
    parser.add_argument("--weights-dtype", choices=WEIGHTS_DTYPES, default="fp16",
                        help="the weights' format; q8_0 / q4_0 / q4_1 at the size kvmesh's CPU engine holds them "
                             "(8.5 / 5 / 5 bits a weight, scales included)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="fraction of GPU memory kvmesh may use, like vLLM")
    parser.add_argument("--lengths", default=None,
                        help=f"workload for the waste report: a,b,c | uniform:N | zipf:N[:S] "
                             f"(default {DEFAULT_LENGTHS})")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def main(args: argparse.Namespace) -> int:
    """Run `kvmesh plan`: 0 with a plan printed (fitting or not), 2 on bad input."""
    try:
        plan = make_plan(load_model_shape(args.model), context=args.context, batch=args.batch,
                         kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
                         gpu_memory_gib=args.gpu_memory, weights_dtype=args.weights_dtype,
                         gpu_memory_utilization=args.gpu_memory_utilization,
                         lengths=args.lengths)
    except PlanError as exc:
        print(f"kvmesh plan: {exc}", file=sys.stderr)
        return 2
    print(plan.to_json() if args.json else render_table(plan))
    return 0
