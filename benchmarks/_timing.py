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


def interleaved(
    systems: dict[str, Callable[[], object]],
    *,
    rounds: int = 30,
    calls: int = 20,
    warmup: int = 5,
) -> dict[str, tuple[float, float, float]]:
    """Times each system in turn, `rounds` times, so that drift in the machine's speed
    affects them alike. Each sample is the mean over `calls` consecutive calls, the last
    one blocked on.

    **Returns:**

    `{name: (median, min, max)}` of the per-call time, in microseconds.
    """
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
    return {name: (statistics.median(s), min(s), max(s)) for name, s in samples.items()}


def once(fn: Callable[[], object]) -> float:
    """Wall time of one call, blocked on, in milliseconds."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return (time.perf_counter() - start) * 1e3
