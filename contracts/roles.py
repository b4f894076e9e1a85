"""A worker's role in disaggregated serving (`kvmesh worker --role`), spoken by the worker
(its registry record, GetLoad, metrics) and the router (which pools it routes to).
Torch-free and gRPC-free."""
from __future__ import annotations

import enum


class WorkerRole(enum.Enum):
    """MIXED prefills and decodes its own requests (the default). PREFILL computes prompts for
    other workers (prefill-only requests) and serves their blocks over the peer plane; DECODE
    takes requests whose prompt blocks a PREFILL worker computed, fetches them and streams the
    tokens. The value is the CLI and wire spelling."""

    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"

    @classmethod
    def parse(cls, value: WorkerRole | str) -> WorkerRole:
        """The member for a member or its spelling ("" is MIXED: a worker that reports no role);
        raises ValueError naming the accepted ones."""
        if isinstance(value, cls):
            return value
        if value == "":
            return cls.MIXED
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"role={value!r}; accepted: {', '.join(r.value for r in cls)}") from None
