"""The disk tier's figures: counters and time histograms (`kvstore.disk.DiskTier.stats`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

# seconds; read/write of one block (or one read-ahead run)
TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True, slots=True)
class TimeHistogram:
    """Cumulative counts per upper bound in `bounds` (then +Inf), with the sum and count. A dataclass,
    not a NamedTuple: its `count` field would shadow `tuple.count`."""

    buckets: tuple[int, ...]
    sum_s: float
    count: int
    bounds: tuple[float, ...] = TIME_BUCKETS


class DiskTierStats(NamedTuple):
    """Counters since the tier was opened (blocks) and its size now."""

    enabled: bool
    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    written: int
    read: int
    dropped_checksum: int      # records that failed a check (torn, flipped, truncated, wrong key)
    dropped_queue_full: int    # writes dropped because the write-behind queue was full
    dropped_fingerprint: int   # directories of other fingerprints or format versions beside this tier's (ignored, kept)
    evicted: int               # records deleted by the tier's LRU
    reopened: int              # records found valid at open
    write_seconds: TimeHistogram
    read_seconds: TimeHistogram

    def read_bytes_s(self, block_bytes: int) -> float:
        """The measured read speed: payload bytes read back over the seconds reading them (0.0
        before the first read); GetLoad's disk_read_bytes_s."""
        return self.read * block_bytes / self.read_seconds.sum_s if self.read_seconds.sum_s > 0 else 0.0


class Histogram:
    """Seconds observed, counted per `TIME_BUCKETS` bound (the tier's threads update it under its lock)."""

    def __init__(self) -> None:
        self.counts = [0] * (len(TIME_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.sum += seconds
        for i, bound in enumerate(TIME_BUCKETS):
            if seconds <= bound:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def snapshot(self) -> TimeHistogram:
        out, total = [], 0
        for c in self.counts:
            total += c
            out.append(total)
        return TimeHistogram(tuple(out), self.sum, total)
