"""Figure extractor of `kvmesh bench disagg` (kvmesh/bench/disagg.py): disaggregated serving
against mixed serving on the same pinned cores, the issue's two targets, and the crossover."""

from __future__ import annotations

from typing import Any

from kvmesh.bench.docs_figures_fmt import Extract, Figure, _g, _x


def _disagg(r: dict[str, Any]) -> tuple[str, list[Figure]]:
    mixed, dis = r.get("mixed") or {}, r.get("disaggregated") or {}
    t = r.get("targets") or {}
    out = [
        Figure("ITL p99 (p50)", f"{_g(dis.get('itl_p99_s'), 's')} ({_g(dis.get('itl_p50_s'), 's')})",
               f"{_g(mixed.get('itl_p99_s'), 's')} ({_g(mixed.get('itl_p50_s'), 's')}) mixed",
               f"{_x(t.get('itl_p99_ratio'))} (target <= {_g(t.get('itl_p99_ratio_target'))}x)"),
        Figure("ITL max (the longest stall of a stream)", _g(dis.get("itl_max_s"), "s"),
               f"{_g(mixed.get('itl_max_s'), 's')} mixed", ""),
        Figure("stalls: gaps over 5x ITL p50 (p99 falls on stalls above 1%)", _pct1(dis.get("stall_gap_frac")),
               f"{_pct1(mixed.get('stall_gap_frac'))} mixed",
               f"mixed: {_per_worker(mixed.get('streams_per_worker'))} streams per worker, "
               f"{_mean(mixed.get('streams_stalled_per_long'))} stalled per arriving prompt"),
        Figure("output tok/s", _g(dis.get("output_tok_s")), _g(mixed.get("output_tok_s")) + " mixed",
               f"{_x(t.get('output_tok_s_ratio'))} (target >= {_g(t.get('output_tok_s_ratio_target'))}x)"),
        Figure("TTFT p50 / p99 of the arriving prompts",
               f"{_g(dis.get('ttft_p50_s'), 's')} / {_g(dis.get('ttft_p99_s'), 's')}",
               f"{_g(mixed.get('ttft_p50_s'), 's')} / {_g(mixed.get('ttft_p99_s'), 's')} mixed", ""),
        Figure("requests/s", _g(dis.get("req_s")), _g(mixed.get("req_s")) + " mixed", ""),
        Figure("hand-off seconds per handed-off request", _g(dis.get("handoff_s_mean"), "s"), "",
               f"{_g(dis.get('handoffs'))} hand-offs, {_g(dis.get('handoff_failures'))} failed"),
        Figure("greedy outputs equal across modes", _g(r.get("outputs_equal_frac")), "1", ""),
    ]
    for p in r.get("sweep") or []:
        out.append(Figure(f"sweep: {_g(p.get('prompt_tokens'))}-token prompts at {_g(p.get('arrival_rate'))}/s",
                          f"ITL p99 {_x(p.get('itl_p99_ratio'))}, tok/s {_x(p.get('output_tok_s_ratio'))}",
                          "mixed", "pays" if p.get("pays") else "does not pay"))
    cross = r.get("crossover") or {}
    by_rate = ", ".join(f"{rate}/s: {_g(v)}" for rate, v in (cross.get("by_rate") or {}).items())
    out.append(Figure("crossover: shortest prompt from which on it pays", _g(cross.get("min_prompt_tokens")),
                      "", f"per rate {by_rate}" if by_rate else ""))
    out += _skip_rule(r)
    return "mixed serving (2 mixed workers) on the same pinned cores, same prompts, same run", out


def _pct1(x: Any) -> str:
    return "—" if not isinstance(x, (int, float)) else f"{x * 100:.1f}%"


def _per_worker(x: Any) -> str:
    return " / ".join(_g(v, digits=2) for v in x.values()) if isinstance(x, dict) and x else "—"


def _mean(x: Any) -> str:
    return _g(sum(x) / len(x), digits=2) if isinstance(x, list) and x else "—"


def _skip_rule(r: dict[str, Any]) -> list[Figure]:
    """The skip rule's figures: every prompt skipping the hop (the decode worker computes it at
    its step budget) against the hop, the crossover the router's default follows, and the budget."""
    out = []
    for p in r.get("sweep") or []:
        skip = p.get("skip")
        if skip:
            where = f"{_g(p.get('prompt_tokens'))}-token prompts at {_g(p.get('arrival_rate'))}/s"
            out.append(Figure(f"skip vs hop: {where}",
                              f"TTFT p50 hop/skip {_x(skip.get('hop_vs_skip_ttft_p50_ratio'))}, ITL p99 hop/skip "
                              f"{_x(skip.get('hop_vs_skip_itl_p99_ratio'))}",
                              f"skip vs mixed: TTFT {_x(skip.get('skip_vs_mixed_ttft_p50_ratio'))}, ITL p99 "
                              f"{_x(skip.get('skip_vs_mixed_itl_p99_ratio'))}",
                              "hop pays" if p.get("hop_pays_over_skip") else "skip pays"))
    cross = r.get("skip_crossover")
    if cross:
        by_rate = ", ".join(f"{rate}/s: {_g(v)}" for rate, v in (cross.get("by_rate") or {}).items())
        out.append(Figure("skip crossover: shortest prompt from which on the hop beats skipping it",
                          _g(cross.get("min_prompt_tokens")), "", f"per rate {by_rate}" if by_rate else ""))
    rule = r.get("default_rule")
    if rule:
        out.append(Figure("router default --disagg-min-prompt-tokens", _g(rule.get("min_prompt_tokens")), "",
                          f"longest skipped sweep prompt ({_g(rule.get('skipped_prompt_tokens'))} tokens): TTFT "
                          f"{_x(rule.get('skipped_ttft_vs_mixed'))} mixed"))
    budget = r.get("decode_step_budget")
    if budget:
        in_use: dict[str, Any] = next((b for b in budget.get("budgets") or []
                                       if b.get("step_prefill_tokens") == budget.get("in_use")), {})
        out.append(Figure("decode worker's prompt tokens per step (in use / recommended)",
                          f"{_g(budget.get('in_use'))} / {_g(budget.get('recommended'))}",
                          f"step p90 within {_g(budget.get('slo_s'), 's')} (half of mixed ITL p99)",
                          f"in use: step p90 {_g(in_use.get('step_p90_s'), 's')}, a "
                          f"{_g(budget.get('prompt_tokens'))}-token prompt's TTFT {_x(in_use.get('ttft_vs_whole'))} "
                          "of computing it whole"))
    return out


DISAGG_EXTRACT: dict[str, Extract] = {"disagg": _disagg}
