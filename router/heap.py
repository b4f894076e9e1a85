"""The router process's garbage-collector setting: its start-up heap frozen.

CPython's full (gen-2) collections traverse every tracked container alive, and the router
keeps ~10^5 of them from start-up on (the modules, classes and functions of gRPC, the HTTP
front, numpy, the tokenizer) that never become garbage. `freeze_startup_heap`, called once
the router has started (router/server.py `_serve_until_signal`), moves them to the collector's
permanent generation: a full pass then walks only what was made since, a few ms less per pass
— passes that otherwise land inside routing decisions. The block index, the process's one
large structure, is out of the collector's sight by construction (router/index/compact.py),
not by this: it grows after start-up, as workers join. `kvmesh bench scale` runs its router
passes the same way.

Objects frozen are never collected as cyclic garbage (their memory is kept if they ever
become garbage in a cycle); freezing what start-up built, once, bounds that.
"""
from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect, then freeze every object alive now; returns how many the permanent generation holds."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
