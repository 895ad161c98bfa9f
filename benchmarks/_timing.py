"""Shared timing helpers: interleaved rounds, medians and spreads."""

import os
import platform
import statistics
import time
from collections.abc import Callable

import jax


def machine() -> str:
    """A one-line description of the machine and software."""
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU(s), "
        f"Python {platform.python_version()}, jax {jax.__version__} "
        f"({jax.default_backend()})"
    )


class Timing:
    """Per-call times of one system, in microseconds, one sample per round."""

    def __init__(self, samples: list[float]):
        self.samples = samples
        self.median = statistics.median(samples)
        self.min = min(samples)
        self.max = max(samples)

    def ratio_to(self, floor: "Timing") -> float:
        """The median over rounds of this system's time divided by the floor's time in
        the same round: paired, so that drift in the machine's speed cancels out."""
        return statistics.median(a / b for a, b in zip(self.samples, floor.samples))


def interleaved(
    systems: dict[str, Callable[[], object]],
    *,
    rounds: int = 30,
    calls: int = 20,
    warmup: int = 5,
) -> dict[str, Timing]:
    """Times each system in turn, `rounds` times (rotating the order), so that drift in
    the machine's speed affects them alike. Each sample is the mean per-call time over
    `calls` consecutive calls, the last one blocked on."""
    for fn in systems.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    samples: dict[str, list[float]] = {name: [] for name in systems}
    names = list(systems)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            fn = systems[name]
            start = time.perf_counter()
            for _ in range(calls - 1):
                fn()
            jax.block_until_ready(fn())
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: Timing(s) for name, s in samples.items()}


def once(fn: Callable[[], object]) -> float:
    """Wall time of one call, blocked on, in milliseconds."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return (time.perf_counter() - start) * 1e3
