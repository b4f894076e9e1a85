"""`kvmesh bench scale`'s memory and collector figures: the bytes an index holds (`deep_size`)
and what one full garbage collection costs the process (`full_collection_ms`)."""
from __future__ import annotations

import gc
import sys
import time
import types
from collections import deque


def full_collection_ms(tries: int = 3) -> float:
    """What one full collection costs the process now (ms, best of `tries`: the least disturbed
    by other processes): the traversal of every tracked container not frozen."""
    best = float("inf")
    for _ in range(tries):
        t = time.perf_counter()
        gc.collect()
        best = min(best, (time.perf_counter() - t) * 1000)
    return best


_NOT_FOLLOWED = (type, types.FunctionType, types.MethodType, types.ModuleType, types.BuiltinFunctionType)


def deep_size(root: object) -> int:
    """Bytes of every object reachable from `root` (sys.getsizeof, each object once; types,
    functions and modules are not followed). Canonical ints shared by many entries count once."""
    seen: set[int] = set()
    stack = [root]
    total = 0
    gc.collect()
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _NOT_FOLLOWED):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset, deque)):
            stack.extend(obj)
        elif isinstance(obj, (int, float, str, bytes, bool)) or obj is None:
            continue
        else:
            if hasattr(obj, "__dict__"):
                stack.append(vars(obj))
            for cls in type(obj).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if hasattr(obj, name):
                        stack.append(getattr(obj, name))
    return total
