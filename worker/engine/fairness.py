"""Fair share of one worker's compute between tenants: a virtual token counter (VTC).

Each tenant (`Request.tenant.name`, set by the router from the caller's key) has a counter of
the tokens the scheduler computed for it — prompt tokens prefilled (cache hits are free) and
output tokens decoded — divided by its weight (the keys file's `weight=`, default 1). While
requests of two or more tenants share the worker (`contended`), the scheduler hands the
prefill budget of a step to the tenant with the lowest counter first (`rank`: ties go to the
tenant that computed fewer tokens so far), a chunk at a time, so a tenant over its share waits
for the others and one under it is served in the next step; decode tokens (one per running
request) are never held back, and within a tenant requests keep their (priority, arrival)
order. A tenant whose requests all finished is lifted, when its next request arrives, to the
lowest counter of the tenants still busy (as in VTC, Sheng et al., OSDI '24): idle time earns
no credit to flood with later.

A step is also shorter while contended (`fair_step_tokens` of prefill instead of
`max_num_batched_tokens`): a request of a light tenant that arrives during a step waits for
that step to end, and on a CPU a full step of prefill lasts seconds. And a step that starts a
request whose whole prefill fits in it, for the tenant with the lowest counter, carries no
prefill of tenants with higher counters (a *light step*, `light_step`): that request's first
token then costs about what it costs alone, plus the decode tokens of the step. The counters
alone bound how often that happens: a light step's tokens are charged as any, and once the
light tenant's counter passes another's, that one's prefill goes first again.
A tenant counts as sharing the worker from its request's arrival until `window_s` after
its last one finished, so steps stay short between the requests of a tenant that sends one
every few hundred ms. The router sees more: a request it marks `shared` (contracts
`TenantShare.busy_tenants` >= 2, another tenant was busy at the router when it was sent) keeps
the worker contended from its arrival until `window_s` after it finished, even while it is the
only tenant's request here. Otherwise a worker that the light tenant has not used for a while
runs the flood in full steps (thousands of tokens, seconds each on a CPU), and the light
tenant's next request, routed there, waits them out. Contended only that way
(`Contention.ROUTER`) a step takes `ROUTER_STEP_FACTOR` x `fair_step_tokens` of prefill: a
request of another tenant that lands here waits out one such step (a fraction of a second on a
CPU), once, and from then on the worker is contended here (`Contention.LOCAL`, the short steps),
while a worker the other tenant does not use loses less of its prefill rate to per-step costs.

Only counters and counts live here; the scheduler (`worker.engine.scheduler`) asks it for the
order. The clock is injectable for tests.
"""
from __future__ import annotations

import enum
import time
from collections import Counter
from collections.abc import Callable

from contracts.busy import BusyTenants
from contracts.requests import TENANT_BUSY_WINDOW_S

ROUTER_STEP_FACTOR = 4   # a step's prefill under `Contention.ROUTER`, in units of fair_step_tokens


class Contention(enum.Enum):
    NONE = "none"       # one tenant, and the router saw no other busy
    ROUTER = "router"   # one tenant here, but a sequence here was sent while another was busy
    LOCAL = "local"     # two or more tenants here (busy now or within window_s)


class FairShare:
    """Per-tenant virtual token counters, weights and busy counts (see the module docstring)."""

    def __init__(self, window_s: float = TENANT_BUSY_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._busy = BusyTenants(window_s, clock)   # unfinished sequences per tenant, and the recently done
        self.window_s = window_s
        self._clock = clock
        self.counters: dict[str, float] = {}
        self.tokens: Counter[str] = Counter()      # tokens computed per tenant since start
        self._weights: dict[str, float] = {}
        self._shared = 0                           # unfinished sequences the router marked shared
        self._last_shared: float | None = None     # when the last of those finished
        self.num_light_steps = 0                   # steps that held the others' prefill (`light_step`)

    def arrive(self, tenant: str, weight: float, num_sequences: int = 1, shared: bool = False) -> None:
        """A request of `tenant` joins the scheduler (lifted first if the tenant was idle);
        `shared`: the router saw another tenant busy when it sent the request."""
        self._weights[tenant] = weight
        if tenant not in self._busy.in_flight:
            busy = [self.counters.get(t, 0.0) for t in self._busy.in_flight if t != tenant]
            floor = min(busy) if busy else max(self.counters.values(), default=0.0)
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
        self._busy.arrive(tenant, num_sequences)
        self._shared += num_sequences if shared else 0

    def leave(self, tenant: str, shared: bool = False) -> None:
        """One sequence of `tenant` finished (or was aborted); `shared` as it arrived."""
        self._busy.leave(tenant)
        if shared:
            self._shared -= 1
            assert self._shared >= 0, "more shared sequences left than arrived"
            if not self._shared:
                self._last_shared = self._clock()

    def charge(self, tenant: str, num_tokens: int) -> None:
        """`num_tokens` computed for `tenant` in this step."""
        self.tokens[tenant] += num_tokens
        self.counters[tenant] = self.counters.get(tenant, 0.0) + num_tokens / self._weights.get(tenant, 1.0)

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def rank(self, tenant: str) -> tuple[float, int, str]:
        """Sort key of the tenants whose prefill a contended step serves, lowest first: the
        counter, then the tokens computed so far (a tenant lifted to the busy ones' counter goes
        ahead of them), then the name."""
        return self.counter(tenant), self.tokens[tenant], tenant

    def light_step(self) -> None:
        """The scheduler holds the other tenants' prefill in this step: a request of the
        lowest-ranked tenant with prefill queued starts and finishes its prefill in it."""
        self.num_light_steps += 1

    def contention(self) -> Contention:
        """LOCAL: two or more tenants share the worker, busy now or within `window_s`. ROUTER:
        otherwise, a sequence the router marked shared is here or finished within `window_s`."""
        if len(self._busy.busy()) >= 2:
            return Contention.LOCAL
        now = self._clock()
        if self._shared or (self._last_shared is not None and now - self._last_shared <= self.window_s):
            return Contention.ROUTER
        return Contention.NONE
