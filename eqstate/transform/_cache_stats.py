"""Counts of a StatefulFunction's trace cache, for `get_cache_stats`."""

import itertools
import threading


class CacheStats:
    """Hits, misses, traces and evictions of one trace cache (thread-safe).

    `next(stats.reused)` counts a hit without a lock, for `jit`'s steady-state calls
    (`next` on an `itertools.count` is atomic): reading the count takes a number
    from it too, which `counts` leaves out."""

    __slots__ = ("_lock", "_taken", "evictions", "hits", "misses", "reused", "traces")

    def __init__(self):
        self._lock = threading.Lock()
        self.reused = itertools.count()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.hits = self.misses = self.traces = self.evictions = 0
            # Numbers taken from `reused` that count no hit: all so far, this one too.
            self._taken = next(self.reused) + 1

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

    def not_reused(self) -> None:
        """Takes back a count of `reused`: the call traced anew (JAX retraced it for
        new shapes, and its lookup counted a miss)."""
        with self._lock:
            self._taken += 1

    def counts(self) -> dict[str, int]:
        with self._lock:
            reused = max(next(self.reused) - self._taken, 0)
            self._taken += 1
            return {
                "hits": self.hits + reused,
                "misses": self.misses,
                "traces": self.traces,
                "evictions": self.evictions,
            }
