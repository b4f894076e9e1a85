"""`kvmesh bench tenants`: its flags, its figures from what the clients saw, and a tiny real run."""
from __future__ import annotations

import argparse

import pytest

from contracts.cli import CLIError
from kvmesh.bench.tenants import QUICK, TenantsConfig, _Done, _phase, config_from_args, register, run_tenants


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    return p.parse_args(["tenants", *argv])


def test_flags_and_their_errors() -> None:
    cfg = config_from_args(_parse("--quick", "--concurrency", "3", "--alone-s", "2.5"))
    assert (cfg.flood_prompts, cfg.flood_tokens, cfg.concurrency, cfg.alone_s) == (QUICK.flood_prompts, 1000, 3, 2.5)
    assert config_from_args(_parse()).flood_prompts == TenantsConfig().flood_prompts
    with pytest.raises(CLIError, match="--modes"):
        config_from_args(_parse("--modes", "fair,sloppy"))
    with pytest.raises(CLIError, match="--flood-tokens"):
        config_from_args(_parse("--flood-tokens", "0"))


def test_phase_figures() -> None:
    done = [_Done(t, 100, c, 2) for t, c in ((0.1, 96), (0.4, 96), (0.2, 0), (0.3, 96))]
    out = _phase(done)
    assert out == {"requests": 4, "ttft_p50_s": 0.2, "ttft_p90_s": 0.4, "cached_frac": 288 / 400}


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_bench_runs_both_modes_on_real_clusters() -> None:
    cfg = TenantsConfig(flood_prompts=3, flood_tokens=64, flood_output_tokens=4, concurrency=2,
                        alpha_prompt_tokens=48, alone_s=1.0, num_blocks=128)
    out = run_tenants(cfg)
    for mode in ("unfair", "fair"):
        r = out[mode]
        assert r["alone"]["requests"] >= 2 and r["flood"]["requests"] >= 1
        assert r["alpha_ttft_p90_ratio"] > 0 and r["output_tok_s"] > 0
        assert r["alone"]["cached_frac"] > 0      # the warm-up cached alpha's prompt
    assert out["fair"]["throughput_ratio"] > 0


def test_the_docs_render_its_figures() -> None:
    from kvmesh.bench.docs_figures import bench_of, figures_of

    mode = {"alone": {"ttft_p90_s": 0.5, "cached_frac": 0.96}, "flood": {"ttft_p90_s": 1.0, "cached_frac": 0.96},
            "alpha_ttft_p90_ratio": 2.0, "alpha_cached_frac_ratio": 1.0, "output_tok_s": 30.0}
    result = {"unfair": mode, "fair": mode | {"throughput_ratio": 0.95}}
    assert bench_of({}, result) == "tenants"
    _, figures = figures_of("tenants", result)
    rows = {f.name: f for f in figures}
    assert rows["fair: alpha TTFT p90 during the flood"].versus == "2.00x"
    assert rows["fair ÷ unfair output tok/s"].value == "0.95x"
