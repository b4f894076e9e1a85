"""Fair share between tenants in the worker scheduler (worker/engine/fairness.py through
worker/engine/scheduler.py), driven step by step without a model: every scheduled request's
tokens count as computed, and a request whose whole sequence is computed samples one token."""
from __future__ import annotations

import itertools
from collections import Counter

import pytest

from contracts.requests import TenantShare
from kvstore.layout import KVLayout
from kvstore.store import KVStore
from tests.support.scheduling import step_scheduler
from worker.engine.fairness import Contention, FairShare
from worker.engine.request import Request, RequestStatus
from worker.engine.sampling import SamplingParams
from worker.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig

BS = 16
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS, kv_cache_dtype="fp32")
SALT = b"fair-test"
_tokens = itertools.count(1000)


def _scheduler(fair: bool = True, num_blocks: int = 4096, step_tokens: int = 128) -> Scheduler:
    cfg = SchedulerConfig(block_size=BS, max_num_seqs=64, max_num_batched_tokens=1024, fair_share=fair,
                          fair_step_tokens=step_tokens)
    return Scheduler(cfg, KVStore(LAYOUT, num_blocks, "cpu"), SALT)


def _request(rid: str, tenant: str, prompt_tokens: int, max_tokens: int = 2, weight: float = 1.0,
             priority: int = 0, busy_tenants: int = 0) -> Request:
    prompt = [next(_tokens) for _ in range(prompt_tokens)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), prompt_tokens + max_tokens,
                   priority=priority, tenant=TenantShare(tenant, weight, busy_tenants=busy_tenants))


def _step(s: Scheduler) -> ScheduledBatch:
    return step_scheduler(s, BS, SALT)


def _steps_until_first_token(s: Scheduler, req: Request, limit: int = 500) -> int:
    for n in range(1, limit + 1):
        _step(s)
        if req.output_token_ids:
            return n
    raise AssertionError(f"{req.request_id} had no token after {limit} steps")


@pytest.mark.parametrize("fair", [True, False])
def test_a_short_request_is_not_stuck_behind_a_flood_of_long_prompts(fair: bool) -> None:
    s = _scheduler(fair)
    for i in range(24):
        s.add(_request(f"beta-{i}", "beta", 1000, max_tokens=4))
    for _ in range(3):
        _step(s)
    alpha = _request("alpha-0", "alpha", 40)
    s.add(alpha)
    steps = _steps_until_first_token(s, alpha)
    if fair:
        assert steps <= 2
    else:   # the oracle that the flood does block it: admission in arrival order
        assert steps > 10


def test_weights_two_to_one_give_two_to_one_token_shares() -> None:
    s = _scheduler()
    for i in range(40):
        s.add(_request(f"a-{i}", "alpha", 300, max_tokens=8, weight=2.0))
        s.add(_request(f"b-{i}", "beta", 300, max_tokens=8, weight=1.0))
    shares: Counter[str] = Counter()
    for _ in range(120):
        batch = _step(s)
        for req, n in zip(batch.requests, batch.num_new_tokens):
            shares[req.tenant.name] += n
    assert sum(1 for r in s.waiting if r.tenant.name == "beta") > 0   # both still backlogged
    assert sum(1 for r in s.waiting if r.tenant.name == "alpha") > 0
    assert shares["alpha"] / shares["beta"] == pytest.approx(2.0, rel=0.1)


def test_equal_weights_run_every_request_of_both_tenants_to_completion() -> None:
    s = _scheduler(num_blocks=200)          # tight: preemptions happen
    reqs = [_request(f"{t}-{i}", t, 150 if t == "beta" else 20, max_tokens=6) for i in range(12)
            for t in ("alpha", "beta")]
    for r in reqs:
        s.add(r)
    for _ in range(2000):
        if not s.has_unfinished():
            break
        _step(s)
    assert all(r.status is RequestStatus.FINISHED for r in reqs)
    assert s.store.pool.num_used_blocks == 0


def test_priority_orders_admission_within_a_tenant() -> None:
    s = _scheduler(step_tokens=64)
    for i in range(4):
        s.add(_request(f"beta-{i}", "beta", 200))
    late = _request("alpha-late", "alpha", 48, priority=-5)
    early = _request("alpha-early", "alpha", 48, priority=5)
    s.add(early)
    s.add(late)
    order = []
    for _ in range(20):
        for req in _step(s).requests:
            if req.tenant.name == "alpha" and req.request_id not in order:
                order.append(req.request_id)
    assert order == ["alpha-late", "alpha-early"]


def test_one_tenant_alone_is_scheduled_as_without_fair_share() -> None:
    def trace(fair: bool) -> list[list[tuple[str, int]]]:
        s = _scheduler(fair, num_blocks=120)
        global _tokens
        _tokens = itertools.count(1000)
        for i in range(10):
            s.add(_request(f"r-{i}", "solo", 100 + 37 * i, max_tokens=5))
        out = []
        while s.has_unfinished():
            b = _step(s)
            out.append([(r.request_id, n) for r, n in zip(b.requests, b.num_new_tokens)])
        return out

    assert trace(True) == trace(False)


def test_an_idle_tenant_earns_no_credit() -> None:
    s = _scheduler()
    for i in range(100):
        s.add(_request(f"b-{i}", "beta", 300, max_tokens=4))
    for _ in range(20):
        _step(s)                            # beta alone: its counter grows
    assert s.fair is not None and s.waiting
    for i in range(30):
        s.add(_request(f"a-{i}", "alpha", 300, max_tokens=4))
    beta_steps = 0
    for _ in range(20):
        batch = _step(s)
        beta_steps += any(r.tenant.name == "beta" and n > 1 for r, n in zip(batch.requests, batch.num_new_tokens))
    assert beta_steps >= 8                  # alpha, lifted to beta's counter, does not monopolise


def test_contention_lasts_a_window_after_a_tenants_last_request() -> None:
    now = [0.0]
    fair = FairShare(window_s=2.0, clock=lambda: now[0])
    fair.arrive("beta", 1.0)
    assert fair.contention() is Contention.NONE
    fair.arrive("alpha", 1.0)
    assert fair.contention() is not Contention.NONE
    fair.leave("alpha")
    now[0] = 1.5
    assert fair.contention() is not Contention.NONE
    now[0] = 3.6
    assert fair.contention() is Contention.NONE
    with pytest.raises(ValueError):
        FairShare(window_s=-1)


def test_a_sequence_the_router_marked_shared_keeps_the_worker_contended_until_a_window_after_it() -> None:
    now = [0.0]
    fair = FairShare(window_s=2.0, clock=lambda: now[0])
    fair.arrive("beta", 1.0, num_sequences=2, shared=True)
    assert fair.contention() is Contention.ROUTER   # one tenant here, but another is busy on the router
    fair.arrive("alpha", 1.0)
    assert fair.contention() is Contention.LOCAL
    fair.leave("alpha")
    now[0] = 2.5
    assert fair.contention() is Contention.ROUTER
    fair.leave("beta", shared=True)
    now[0] = 10.0
    assert fair.contention() is not Contention.NONE                  # one shared sequence still here
    fair.leave("beta", shared=True)
    now[0] = 11.5
    assert fair.contention() is not Contention.NONE
    now[0] = 12.5
    assert fair.contention() is Contention.NONE
    fair.arrive("beta", 1.0)                 # the router saw beta alone
    assert fair.contention() is Contention.NONE


@pytest.mark.parametrize("busy_tenants", [0, 1, 2])
def test_one_tenants_flood_runs_in_short_steps_when_the_router_saw_another_tenant_busy(busy_tenants: int) -> None:
    s = _scheduler(step_tokens=16)             # contended only by the router's mark: 4 x 16
    for i in range(6):
        s.add(_request(f"beta-{i}", "beta", 1000, max_tokens=4, busy_tenants=busy_tenants))
    prefill = [_prefill_of(_step(s), "beta") for _ in range(3)]
    if busy_tenants >= 2:                     # alpha, routed here next, waits out a 64-token step
        assert prefill == [64, 64, 64]
    else:                                     # beta alone in the cluster: full steps
        assert min(prefill) > 900
    s.add(_request("alpha-0", "alpha", 12, busy_tenants=2))
    batch = _step(s)
    assert batch.requests[-1].request_id == "alpha-0" and batch.requests[-1].output_token_ids
    assert _prefill_of(_step(s), "beta") == 16   # both tenants here now: fair_step_tokens


def _prefill_of(batch: ScheduledBatch, tenant: str) -> int:
    """Prefill tokens of `tenant` in a step (a decode is one token of a request past its prompt)."""
    return sum(n for r, n in zip(batch.requests, batch.num_new_tokens)
               if r.tenant.name == tenant and r.num_computed_tokens - n < r.num_prompt_tokens)


def test_an_under_share_request_runs_in_the_next_step_without_the_over_share_prefill() -> None:
    s = _scheduler(step_tokens=64)
    for i in range(6):
        s.add(_request(f"beta-{i}", "beta", 1000, max_tokens=4))
    for _ in range(2):
        assert _prefill_of(_step(s), "beta") > 900          # alone: full steps
    alpha = _request("alpha-0", "alpha", 40)
    s.add(alpha)
    batch = _step(s)
    assert alpha in batch.requests and alpha.output_token_ids          # scheduled within one step
    assert _prefill_of(batch, "beta") == 0                            # a light step: only alpha prefills
    assert s.fair is not None and s.fair.num_light_steps == 1
    assert _prefill_of(_step(s), "beta") == 64              # contended: short steps for beta


def test_a_light_tenant_with_a_request_every_step_still_leaves_the_other_its_share() -> None:
    s = _scheduler(step_tokens=32)
    for i in range(4):
        s.add(_request(f"beta-{i}", "beta", 4000, max_tokens=4))
    _step(s)
    tokens: Counter[str] = Counter()
    beta_prefill_steps = 0
    for i in range(40):                      # a new short alpha request before every step
        s.add(_request(f"alpha-{i}", "alpha", 20))
        batch = _step(s)
        beta_prefill_steps += _prefill_of(batch, "beta") > 0
        for req, n in zip(batch.requests, batch.num_new_tokens):
            tokens[req.tenant.name] += n
    assert s.fair is not None and s.fair.num_light_steps >= 8      # alpha's requests run in light steps
    assert beta_prefill_steps >= 10                                 # and beta's prefill goes on
    assert tokens["beta"] >= 0.8 * tokens["alpha"]                  # about an equal share of the tokens


def test_a_lifted_tenant_goes_ahead_at_an_equal_counter_whatever_its_name() -> None:
    s = _scheduler(step_tokens=64)
    s.add(_request("beta-0", "beta", 3000, max_tokens=4))
    for _ in range(2):
        _step(s)                             # beta alone, still prefilling: no decode tokens
    zeta = _request("zeta-0", "zeta", 40)    # idle until now: lifted to beta's counter, named after it
    s.add(zeta)
    assert s.fair is not None and s.fair.counter("zeta") == s.fair.counter("beta")
    batch = _step(s)
    assert zeta in batch.requests and zeta.output_token_ids
