"""Shared timing helpers: interleaved rounds, medians and spreads."""

import importlib.metadata
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable

import jax


def machine() -> str:
    """A one-line description of the machine and software."""
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU(s), "
        f"Python {platform.python_version()}, jax {jax.__version__} "
        f"({jax.default_backend()})"
    )


def versions(packages: Iterable[str]) -> dict[str, str | None]:
    """The installed version of each distribution, or `None` where it is missing."""
    found: dict[str, str | None] = {}
    for name in packages:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


class Timing:
    """Times of one system, one sample per round: microseconds per call from
    `interleaved`, milliseconds per first call from `first_calls`."""

    def __init__(self, samples: list[float]):
        self.samples = samples
        self.median = statistics.median(samples)
        self.min = min(samples)
        self.max = max(samples)

    def ratio_to(self, floor: "Timing") -> float:
        """The median over rounds of this system's time divided by the floor's time in
        the same round: paired, so that drift in the machine's speed cancels out."""
        return statistics.median(a / b for a, b in zip(self.samples, floor.samples))

    def per(self, n: int) -> "Timing":
        """The same samples divided by `n`, e.g. a time per state."""
        return Timing([x / n for x in self.samples])


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


def first_calls(
    factories: dict[str, Callable[[], Callable[[], object]]],
    *,
    repeats: int = 5,
    warmup: int = 1,
) -> dict[str, Timing]:
    """Times the first call of freshly built functions, in milliseconds. Each
    `factory()` builds a new function and new states (not timed); its first call, blocked
    on, is one sample. The systems take turns, `repeats` times (rotating the order), after
    `warmup` untimed turns that pay each system's one-off import and setup costs."""
    names = list(factories)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(warmup + repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            first = factories[name]()
            elapsed = once(first)
            if r >= warmup:
                samples[name].append(elapsed)
    return {name: Timing(s) for name, s in samples.items()}
