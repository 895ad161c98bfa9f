"""Counts of a StatefulFunction's trace cache, for `get_cache_stats`."""

import threading


class CacheStats:
    """Hits, misses, traces and evictions of one trace cache (thread-safe)."""

    __slots__ = ("_lock", "evictions", "hits", "misses", "traces")

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.hits = self.misses = self.traces = self.evictions = 0

    def hit(self) -> None:
        with self._lock:
            self.hits += 1

    def miss(self) -> None:
        with self._lock:
            self.misses += 1

    def traced(self) -> None:
        with self._lock:
            self.traces += 1

    def evicted(self, n: int) -> None:
        if n:
            with self._lock:
                self.evictions += n

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {
                "hits": self.hits,
                "misses": self.misses,
                "traces": self.traces,
                "evictions": self.evictions,
            }
