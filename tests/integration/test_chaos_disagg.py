"""Chaos in disaggregated serving (`kvmesh bench chaos --disagg`'s scenario, small): one `kvmesh
serve --prefill-workers 1 --decode-workers 2` under load where every request takes the prefill
hop; its prefill worker is killed -9 while hops are in flight, then a decode worker while it
streams. No request is lost or hangs, streams off the dead decode worker migrate, and every
output equals the fault-free baseline of the same run (or parts from it only at a near-tie, HF
transformers the oracle)."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.bench.chaos_disagg import PROMPTS, measure
from tests.support.oracle import assert_outcomes_equal_or_near_tie

# slow: ~100 s of chaos under load; the default run covers the same faults small (tests/integration/test_disagg.py:
# a prefill worker SIGKILLed and SIGSTOPed mid-hop, a decode worker killed mid-stream).
pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def _errors_logged(log_dir: Path) -> str:
    """The router's and workers' logged errors (tracebacks and ERROR lines), for a failure's message."""
    lines = [f"{f.name}: {line}" for f in sorted((log_dir / "children").glob("*.log"))
             for line in f.read_text(errors="replace").splitlines()
             if " ERROR " in line or "Traceback" in line or line.startswith(("    raise", "grpc.", "Exception"))]
    return "\n".join(lines[-60:])


def test_prefill_killed_mid_handoff_and_decode_killed_mid_stream_lose_nothing(smollm2_dir: Path,
                                                                               tmp_path: Path) -> None:
    run = measure(concurrency=4, max_tokens=32, gap_s=5.0, request_timeout_s=180.0, log_dir=tmp_path)
    assert run.survived
    failed = [o for o in run.outcomes if not o.ok]
    assert run.outcomes and failed == [], f"{failed}\n{_errors_logged(tmp_path)}"     # none failed, none hung
    assert all(len(o.tokens) == 32 for o in run.outcomes)
    assert set(run.recovery) == {"kill9_prefill_mid_handoff", "kill9_decode_mid_stream"}
    assert all(v is not None for v in run.recovery.values()), run.recovery    # both back in routing
    assert run.hops["handoffs"] > 0                                          # the load took the hop
    failed = {k: v for k, v in run.hops.items() if k.startswith("failed:")}
    assert sum(failed.values()) >= 1, run.hops     # the prefill kill cut hops in flight: they fell back
    assert any(o.migrations for o in run.outcomes)   # streams moved off the killed decode worker
    assert {o.worker_id for o in run.outcomes} <= {"worker-1", "worker-2"}    # decoded on decode workers only
    assert_outcomes_equal_or_near_tie(run.outcomes, run.baseline, PROMPTS, smollm2_dir)
