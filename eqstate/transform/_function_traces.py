"""The traces of one function: its argument parser, its trace cache, and calls of a
trace against a frame. `StatefulFunction`, `jit`'s plans and the other transforms all
reach a function's pure form through this."""

import dataclasses
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax

from .. import _context, _jax_compat as compat
from .._context import rule_reads
from .._custom_types import MISSING
from .._errors import UnknownCacheKeyError, UnstableStatesError
from .._pretty_print import shape_summary
from .._state import draws_atomically, lock_keys
from ._cache_stats import CacheStats
from ._call_args import ArgParser, CallArgs
from ._trace import flat_jit, out_shapes, StaleTrace, Trace, trace_function


compat.hide_from_tracebacks(__file__)

# Argument keys kept per function, and traces per key (for states of other shapes, e.g.
# in other threads); the least recently used are dropped first.
CACHE_SIZE = 128
VARIANTS = 8
# Retraces of one call whose states keep changing shape under it (other threads).
_RETRIES = 8
_KEEPS_CHANGING = (
    "The states of {name} changed shape {n} times while it was being traced and "
    "called: other threads keep writing values of new shapes to them. Give each "
    "thread its own states (e.g. with `eqstate.scope`), or synchronise the writes."
)

ValuesOf = Callable[[Trace], "list | None"]
"""The caller's values of a trace's states, or `None` if it cannot give them."""

_NOT_KEPT = (
    "{name} was last traced inside a JAX transform, closing over its tracers or "
    "using custom derivative rules (`jax.nn.relu` has one), and such a trace is "
    "not kept: it holds values of that transform. Its states and output shapes "
    "are known (`get_states()`, `get_out_shapes()`), its {what} is not. Call "
    "`make_jaxpr(*args)` outside the transform for a kept trace, or use "
    "`eqstate.transform.make_jaxpr(fun)(*args)`, which returns the jaxpr of any "
    "trace."
)


@dataclasses.dataclass(frozen=True)
class Summary:
    """What the `get_*` methods of `StatefulFunction` say of a trace that is not
    kept: its key, states and output shapes, without its jaxpr (which holds the
    enclosing transform's tracers)."""

    key: Hashable
    states: tuple
    read_states: tuple
    write_states: tuple
    new_states: tuple
    out_shapes: tuple

    @classmethod
    def of(cls, key: Hashable, trace: Trace) -> "Summary":
        return cls(
            key,
            trace.states,
            trace.read_states,
            trace.write_states,
            trace.new_states,
            out_shapes(trace),
        )


class FunctionTraces:
    """Traces `fun` once per cache key and state signature, keeps the traces, and
    calls them against frames.

    **Arguments:**

    - `fun`, `name`: the function, and its name for messages.
    - `parser`: splits its calls (static arguments) into `CallArgs`.
    - `state_returns`, `axis_env`: as for `StatefulFunction`.
    - `axes_around_win`: whether a named axis that a transform around a call binds
        replaces the one `axis_env` declares under that name (`StatefulFunction`'s
        `axis_env`, which stands in for such a transform), rather than binding a new
        axis inside it (`vmap`'s own axis).
    """

    def __init__(
        self,
        fun: Callable,
        name: str,
        parser: ArgParser,
        state_returns: tuple[str, ...] = ("write",),
        axis_env: Sequence[tuple[Hashable, int]] | None = None,
        axes_around_win: bool = False,
    ):
        self.fun = fun
        self.name = name
        self.parser = parser
        self.state_returns = state_returns
        self.axis_env = axis_env
        self.axes_around_win = axes_around_win
        self._cache: OrderedDict[Hashable, list[Trace]] = OrderedDict()
        self._pending: dict[Hashable, threading.RLock] = {}
        self._lock = threading.Lock()
        self._last_key: Hashable = MISSING
        self._unkept: Summary | None = None  # The last trace, if not kept.
        self.stats = CacheStats()
        self._kept: weakref.WeakKeyDictionary[Any, FunctionTraces] = (
            weakref.WeakKeyDictionary()
        )

    def emptied(self) -> "FunctionTraces":
        """A new cache for the same function, holding no trace (and counting into
        these `stats`)."""
        fresh = FunctionTraces(
            self.fun,
            self.name,
            self.parser,
            self.state_returns,
            self.axis_env,
            self.axes_around_win,
        )
        fresh.stats = self.stats
        return fresh

    def kept_for(self, enclosing: Any) -> "FunctionTraces":
        """The cache for calls made inside the JAX trace `enclosing`: the one earlier
        calls made in it used, or a new one. Each lives as long as its trace."""
        with self._lock:
            kept = self._kept.get(enclosing)
            if kept is None:
                kept = self.emptied()
                try:
                    self._kept[enclosing] = kept
                except TypeError:  # pragma: no cover - a trace without weak references
                    pass
        return kept

    def parse(self, args: tuple, kwargs: dict) -> CallArgs:
        return self.parser.parse(args, kwargs, self._axis_env())

    def _axis_env(self) -> Sequence[tuple[Hashable, int]] | None:
        """The named axes a call is traced inside besides those around it."""
        env = self.axis_env
        if env and self.axes_around_win:
            # Traced under the declared size, `jax.lax.axis_size` and the like
            # would bake in a size the call does not run with.
            env = tuple((name, size) for name, size in env if not _bound(name))
        return env

    # ------------------------------------------------------------------- lookups

    def by_key(self, cache_key: Hashable = (), what: str = "jaxpr") -> Trace:
        """The trace for `cache_key` (`()`: the most recent one). Of several traces
        for one key (states of other shapes), the most recently used. `what` the
        caller needs of it, for the error if that trace was not kept."""
        if self.unkept(cache_key) is not None:
            raise UnknownCacheKeyError(_NOT_KEPT.format(name=self.name, what=what))
        key = self._resolve_key(cache_key)
        trace = self.latest(key)
        if trace is None:
            with self._lock:
                known = list(self._cache)
            raise UnknownCacheKeyError(
                f"{self.name} has no trace for the cache key {key!r}. "
                f"{_summarise_keys(known)} Trace it with `make_jaxpr(*args)`; "
                "`get_arg_cache_key(*args)` gives the key of a call."
            )
        return trace

    def unkept(self, cache_key: Hashable = ()) -> Summary | None:
        """The summary of the most recent trace if it was not kept and `cache_key`
        (`()`: the most recent one) is its key."""
        unkept = self._unkept
        if unkept is not None and (cache_key == () or cache_key == unkept.key):
            return unkept
        return None

    def described(self, cache_key: Hashable = ()) -> "Trace | Summary":
        """The trace for `cache_key`, or the summary of one not kept."""
        return self.unkept(cache_key) or self.by_key(cache_key)

    def latest(self, key: Hashable) -> Trace | None:
        """The most recently used trace for `key`, if any."""
        with self._lock:
            variants = self._cache.get(key)
            return variants[0] if variants else None

    def variants(self, key: Hashable) -> tuple[Trace, ...]:
        """The kept traces for `key`, the most recently used first."""
        with self._lock:
            return tuple(self._cache.get(key, ()))

    def _resolve_key(self, cache_key: Hashable) -> Hashable:
        if cache_key == ():
            if self._last_key is MISSING:
                raise UnknownCacheKeyError(
                    f"{self.name} has not been traced yet: call `make_jaxpr(*args)` "
                    "first."
                )
            return self._last_key
        return cache_key

    def trace_for(self, call: CallArgs, parent: _context.Frame) -> Trace:
        """The trace for `call` that fits the current values of its states in
        `parent`, tracing against `parent` if there is none."""
        trace, _ = self.lookup(call, parent, lambda t: _peek_values(parent, t))
        return trace

    def lookup(
        self,
        call: CallArgs,
        parent: "_context.Frame | Callable[[], _context.Frame]",
        values_of: ValuesOf,
        count_hit: bool = True,
    ) -> tuple[Trace, list]:
        """The trace for `call` whose states fit `values_of(trace)`, and those values.
        On a miss it traces against `parent` (a frame, or a function making one). A
        trace is only ever used with values of the structure, shapes and dtypes it was
        made with: the cache keeps up to `VARIANTS` per argument key, for callers
        (e.g. threads) whose states differ in shape. `count_hit=False` for a lookup
        of a call that already counted its own (a plan's, when JAX traces it).

        **Raises:**

        `StaleTrace` if even a fresh trace does not fit the caller's values (its
        states changed shape meanwhile, or it wants values for other states).
        """
        found = self.find(call.key, values_of, count_hit)
        if found is not None:
            return found
        with self._lock:
            key_lock = self._pending.setdefault(call.key, threading.RLock())
        # Concurrent first calls with the same key and shapes trace once.
        with key_lock:
            found = self.find(call.key, values_of, count_hit)
            if found is not None:
                return found
            frame = parent() if callable(parent) else parent
            self.stats.miss()
            try:
                trace = trace_function(
                    self.fun,
                    call,
                    frame,
                    name=self.name,
                    state_returns=self.state_returns,
                    axis_env=self._axis_env(),
                )
                # Stored before the key's lock is dropped: a thread arriving after
                # that finds the trace instead of tracing again.
                self._store(call.key, trace)
            finally:
                with self._lock:
                    self._pending.pop(call.key, None)
        values = values_of(trace)
        if values is None or trace.stale_state(values) is not None:
            raise StaleTrace
        return trace, values

    def find(
        self, key: Hashable, values_of: ValuesOf, count_hit: bool = True
    ) -> tuple[Trace, list] | None:
        """A kept trace for `key` that fits `values_of(trace)`, and those values."""
        for trace in self.variants(key):
            if trace.has_custom_rules and trace.rule_reads_before != rule_reads():
                continue  # Its rules may hold values read then: see `rule_reads`.
            values = values_of(trace)
            if values is not None and trace.stale_state(values) is None:
                self._touch(key, trace)
                if count_hit:
                    self.stats.hit()
                return trace, values
        return None

    def _touch(self, key: Hashable, trace: Trace) -> None:
        with self._lock:
            variants = self._cache.get(key)
            if variants is not None:
                self._cache.move_to_end(key)
                if variants[0] is not trace and trace in variants:
                    variants.remove(trace)
                    variants.insert(0, trace)
            self._last_key = key
            self._unkept = None

    def _store(self, key: Hashable, trace: Trace) -> None:
        self.stats.traced()
        with self._lock:
            self._last_key = key
            inside = not compat.is_top_level()
            if not trace.cacheable or (trace.has_custom_rules and inside):
                # Inside a trace, custom rules may keep that trace's tracers (see
                # `rule_reads`).
                self._unkept = Summary.of(key, trace)
                return
            self._unkept = None
            variants = self._cache.setdefault(key, [])
            variants.insert(0, trace)
            self.stats.evicted(len(variants[VARIANTS:]))
            del variants[VARIANTS:]
            self._cache.move_to_end(key)
            while len(self._cache) > CACHE_SIZE:
                self.stats.evicted(len(self._cache.popitem(last=False)[1]))

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
            self._last_key = MISSING
            self._unkept = None
        self.stats.reset()

    def sizes(self) -> tuple[int, int]:
        """`(keys, traces)` kept."""
        with self._lock:
            return len(self._cache), sum(len(v) for v in self._cache.values())

    # --------------------------------------------------------------------- calls

    def evaluate(
        self, trace: Trace, arg_leaves: list, values: list, jit_options: dict | None
    ) -> tuple[list, list, list]:
        """`(out leaves, updated values, new values)` of the trace, op by op (or
        staged into the current trace), or through `flat_jit` with `jit_options`."""
        if jit_options is None:
            return trace.split_outputs(trace.run(arg_leaves, values))
        return trace.split_outputs(flat_jit(trace, jit_options)(arg_leaves, values))

    def call_against(
        self,
        call: CallArgs,
        parent: "_context.Frame | Callable[[], _context.Frame]",
        values_of: ValuesOf,
        jit_options: dict | None = None,
        traced: Trace | None = None,
    ) -> tuple[Trace, list, list, list]:
        """Finds (or makes) the trace that fits the caller's state values
        (`values_of`), `traced` first, and evaluates it: `(trace, out leaves,
        updated, new values)`."""
        for _ in range(_RETRIES):
            try:
                trace, values = self._given_or_lookup(traced, call, parent, values_of)
                traced = None
                return trace, *self.evaluate(trace, call.leaves, values, jit_options)
            except StaleTrace:
                # The states changed shape between the trace and the call (another
                # thread wrote them): trace again against the values now there.
                continue
        raise UnstableStatesError(_KEEPS_CHANGING.format(name=self.name, n=_RETRIES))

    def _given_or_lookup(
        self,
        trace: Trace | None,
        call: CallArgs,
        parent: "_context.Frame | Callable[[], _context.Frame]",
        values_of: ValuesOf,
    ) -> tuple[Trace, list]:
        """`trace`, just made for `call`, if it fits `values_of(trace)`, else
        `lookup`. A trace that closes over tracers is not kept, and tracing it again
        would run the function twice (creating its states twice)."""
        if trace is not None:
            values = values_of(trace)
            if values is not None and trace.stale_state(values) is None:
                return trace, values
        return self.lookup(call, parent, values_of)

    @draws_atomically
    def call_in(
        self,
        frame: _context.Frame,
        call: CallArgs,
        jit_options: dict | None = None,
        traced: Trace | None = None,
    ) -> Any:
        """Calls the function against `frame`: reads the values it needs from there,
        evaluates the pure form (of `traced`, the trace just found for `call`, if it
        still fits), writes the results back and registers new states (under fresh
        handles). Returns the function's output."""

        def values_of(trace: Trace) -> list:
            return frame.read_many(trace.states) if trace.states else []

        if traced is None:
            traced = self.trace_for(call, frame)
        lock_keys(frame, traced.updated_states)
        trace, out, updated, new_values = self.call_against(
            call, frame, values_of, jit_options, traced
        )
        out, updated, fresh, new_values = trace.under_fresh_handles(
            out, updated, new_values
        )
        if updated or fresh:
            updates = dict(zip(trace.updated_states, updated))
            frame.commit(updates, list(zip(fresh, new_values)))
        return out


def _peek_values(frame: _context.Frame, trace: Trace) -> list | None:
    """The values of `trace.states` in `frame` (as a child trace would see them),
    recording nothing; `None` if one is missing."""
    values = [frame.peek(s) for s in trace.states]
    return None if any(v is MISSING for v in values) else values


def _summarise_keys(keys: list, limit: int = 3) -> str:
    if not keys:
        return "It has no trace yet."
    shown = "; ".join(_key_text(k) for k in keys[-limit:])
    return f"It has {len(keys)} trace(s); the most recent key(s): {shown}."


def _key_text(key: Any) -> str:
    """A cache key made by `ArgParser.parse`, readably: its static arguments and the
    types of its traced leaves (the JAX configuration and mapped axes it also holds
    are left out: hundreds of characters); any other key as its `repr`."""
    parsed = isinstance(key, tuple) and len(key) == 5
    if not (parsed and isinstance(key[2], jax.tree_util.PyTreeDef)):
        return repr(key)
    typed, typed_kw, treedef, signatures, _ = key
    leaves = ", ".join(_signature_text(sig) for sig in signatures) or "none"
    text = f"traced leaves ({leaves}) in {treedef}"
    static = [f"{i}={v!r}" for i, _, v, *_ in typed]
    static += [f"{k}={v!r}" for k, _, v, *_ in typed_kw]
    if static:
        text += f", static {', '.join(static)}"
    return f"[{text}, and JAX's configuration]"


def _signature_text(sig: tuple) -> str:
    if sig[0] == "static":  # a leaf hashed into the key: a handle, a string, ...
        return repr(sig[2])
    shape, dtype = sig[:2]
    weak = " (weak)" if len(sig) > 2 and sig[2] else ""
    return f"{shape_summary(shape, dtype)}{weak}"


def _bound(axis_name: Hashable) -> bool:
    """Whether a transform around this code binds the named axis."""
    try:
        jax.lax.axis_size(axis_name)
    except NameError:
        return False
    return True
