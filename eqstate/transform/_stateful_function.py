"""StatefulFunction: traces a function that uses states into a pure jaxpr."""

import inspect
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, overload

import jax
import jax.extend.core as jex_core
import jax.tree_util as jtu
from jaxtyping import PyTree

from .. import _context, _jax_compat as compat
from .._custom_types import MISSING, PyTreeDef
from .._errors import StateValueError, UnknownCacheKeyError
from .._pretty_print import state_label, state_name, table, value_summary
from .._run import run
from .._state import expire, fresh_copy, State
from .._state_dict import StateDict
from ._cache_stats import CacheStats
from ._compiled import (
    CallArgs,
    Compiled,
    dynamic_mask,
    jitted,
    signature,
    StaleTrace,
    struct,
    TraceRecord,
    unflatten_each,
)
from ._dispatch import can_plan, JitDispatch


compat.hide_from_tracebacks(__file__)

# Argument keys kept per StatefulFunction, and compilations per key (for states of
# other shapes, e.g. in other threads); the least recently used are dropped first.
CACHE_SIZE = 128
VARIANTS = 8
# Retraces of one call whose states keep changing shape under it (other threads).
_RETRIES = 8
_KEEPS_CHANGING = (
    "The states of {name} changed shape {n} times while it was being traced and "
    "called: other threads keep writing values of new shapes to them. Give each "
    "thread its own states (e.g. with `eqstate.scope`), or synchronise the writes."
)


class StatefulFunction:
    """Traces a function that reads and writes states, reports which states it uses,
    and rewrites it into a pure `(state_vals, *args) -> (state_vals, out)` jaxpr.

    The function is traced once per *cache key* (static arguments, and the shapes,
    dtypes, weak types and tree structure of the other arguments). While tracing, a
    state's value becomes a jaxpr input the first time it is read or written, so a
    single trace finds every state. States created inside the function are *new
    states*: their values are trailing outputs, and every call hands the caller fresh
    handles for them (same kind, tag and name).

    Arguments are split as `jax.jit` would trace them, plus the leniency of
    `eqx.filter_jit`: array leaves and Python scalars are traced (so `f(1.0)` and
    `f(2.0)` share a trace), other leaves (strings, functions, ...) are static and
    part of the cache key. Outputs
    may hold non-array leaves (returned as they were while tracing) and the handles
    of new states, but not pre-existing handles.

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        count = es.ShortTermState(jnp.array(0), name="count")
        w = es.ParamState(jnp.ones(3), name="w")

        def f(x):
            count.value = count.value + 1
            return w.value * x

        sf = es.transform.StatefulFunction(f).make_jaxpr(jnp.ones(3))
        assert sf.get_states() == (count, w)
        assert sf.get_read_states() == (w,)
        assert sf.get_write_states() == (count,)
        out = sf(jnp.ones(3))  # reads and writes the world
        assert count.value == 1
        ```
    """

    def __init__(
        self,
        fun: Callable,
        static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (),
        axis_env: Sequence[tuple[Hashable, int]] | None = None,
        abstracted_axes: Any | None = None,
        state_returns: str | Sequence[str] = ("read", "write"),
        cache_type: str | None = None,
        name: str | None = None,
    ):
        """**Arguments:**

        - `fun`: the function to trace.
        - `static_argnums`: indices of positional arguments that are static: hashed
            into the cache key instead of traced, as in `jax.jit`.
        - `static_argnames`: names of keyword arguments that are static. A name that
            matches a positional parameter of `fun` makes it static too.
        - `axis_env`: `(axis_name, size)` pairs, so that collectives over those named
            axes can be traced (as in `jax.make_jaxpr`).
        - `abstracted_axes`: dynamic shapes. JAX 0.10 has no dynamic-shape tracing, so
            anything but `None` raises `NotImplementedError`.
        - `state_returns`: which states the pure form returns: `'write'` (those
            written), `'read'` (those only read), or both (every state touched).
            Writes to states that are not returned are dropped.
        - `cache_type`: `None` caches the jaxpr, which an eager call evaluates op by
            op; `'jit'` also compiles it with `jax.jit`, so that an eager call is a
            single dispatch.
        - `name`: a name for messages; defaults to `fun.__name__`.
        """
        if abstracted_axes is not None:
            raise NotImplementedError(
                "`abstracted_axes` needs dynamic-shape tracing, which JAX "
                f"{jax.__version__} does not have. Trace once per shape instead (leave "
                "`abstracted_axes=None`)."
            )
        if cache_type not in (None, "jit"):
            raise ValueError(f"`cache_type` must be None or 'jit', got {cache_type!r}.")
        returns = (state_returns,) if isinstance(state_returns, str) else state_returns
        returns = tuple(returns)
        if not returns or not set(returns) <= {"read", "write"}:
            raise ValueError(
                "`state_returns` must be 'read', 'write' or both, got "
                f"{state_returns!r}."
            )
        self.fun = fun
        self.name = name or getattr(fun, "__name__", type(fun).__name__)
        self.static_argnums = _as_tuple(static_argnums, int, "static_argnums")
        self.static_argnames = _as_tuple(static_argnames, str, "static_argnames")
        self.static_positions = tuple(
            dict.fromkeys(
                self.static_argnums + _positions_of(fun, self.static_argnames)
            )
        )
        self.axis_env = None if axis_env is None else tuple(axis_env)
        self.state_returns = returns
        self.cache_type = cache_type
        self._cache: OrderedDict[Hashable, list[Compiled]] = OrderedDict()
        self._pending: dict[Hashable, threading.RLock] = {}
        self._lock = threading.Lock()
        self._last_key: Hashable = MISSING
        self._dispatch = JitDispatch(self) if cache_type == "jit" else None
        self._stats = CacheStats()

    def __repr__(self) -> str:
        return f"StatefulFunction({self.name})"

    # ----------------------------------------------------------------- cache keys

    def parse_args(self, args: tuple, kwargs: dict) -> CallArgs:
        """Splits a call's arguments into its cache key and its traced leaves."""
        n = len(args)
        static = []
        for i in self.static_positions:
            if -n <= i < n:
                arg = _hashable(args[i], f"static argument {i}", self.name)
                static.append((i % n, arg))
            elif i in self.static_argnums:
                raise ValueError(
                    f"`static_argnums` holds {i}, but {self.name} was called with {n} "
                    "positional argument(s)."
                )
        static.sort(key=lambda pair: pair[0])
        static_index = {i for i, _ in static}
        static_kw = tuple(
            (k, _hashable(kwargs[k], f"static argument {k!r}", self.name))
            for k in sorted(kwargs)
            if k in self.static_argnames
        )
        dyn_args = tuple(a for i, a in enumerate(args) if i not in static_index)
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        leaves, treedef = jtu.tree_flatten((dyn_args, dyn_kwargs))
        mask = dynamic_mask((dyn_args, dyn_kwargs))
        sigs, dynamic_index, dynamic, template = [], [], [], []
        for i, (leaf, traced) in enumerate(zip(leaves, mask)):
            if traced:
                sigs.append(signature(leaf))
                dynamic_index.append(i)
                dynamic.append(leaf)
                template.append(None)
            else:
                # Handles are static leaves too, hashed by identity: the states they
                # name are read and written as if closed over.
                sigs.append(("static", _hashable(leaf, "an argument leaf", self.name)))
                template.append(leaf)
        key = (tuple(static), static_kw, treedef, tuple(sigs))
        return CallArgs(
            key, dynamic, treedef, template, dynamic_index, static, static_kw
        )

    def get_arg_cache_key(self, *args: Any, **kwargs: Any) -> Hashable:
        """The cache key of a call with these arguments: the static arguments (by
        value) and the shapes, dtypes, weak types and tree structure of the others.

        **Raises:**

        `TypeError` naming the argument if a static argument is unhashable or an
        argument holds a state handle; `ValueError` if `static_argnums` is out of
        range.
        """
        return self.parse_args(args, kwargs).key

    # ------------------------------------------------------------------- the cache

    def _resolve_key(self, cache_key: Hashable) -> Hashable:
        if cache_key == ():
            if self._last_key is MISSING:
                raise UnknownCacheKeyError(
                    f"{self.name} has not been compiled yet: call `make_jaxpr(*args)` "
                    "first."
                )
            return self._last_key
        return cache_key

    def compiled(self, cache_key: Hashable = ()) -> Compiled:
        """The compilation for `cache_key` (`()`: the most recent one). Of several
        compilations for one key (states of other shapes), the most recently used."""
        key = self._resolve_key(cache_key)
        with self._lock:
            variants = self._cache.get(key)
            known = list(self._cache)
        if not variants:
            raise UnknownCacheKeyError(
                f"{self.name} has no compilation for the cache key {key!r}. "
                f"{_summarise_keys(known)} Compile with `make_jaxpr(*args)`; "
                "`get_arg_cache_key(*args)` gives the key of a call."
            )
        return variants[0]

    def compile(self, call: CallArgs, parent: _context.Frame) -> Compiled:
        """The compilation for `call` that fits the current values of its states in
        `parent`, tracing against `parent` if there is none."""
        entry, _ = self.lookup(call, parent, lambda e: _peek_values(parent, e))
        return entry

    def lookup(
        self,
        call: CallArgs,
        parent: "_context.Frame | Callable[[], _context.Frame]",
        values_of: Callable[[Compiled], list | None],
    ) -> tuple[Compiled, list]:
        """The compilation for `call` whose states fit `values_of(entry)` (the
        caller's values of `entry.states`, or `None` if it cannot give them), and
        those values. On a miss it traces against `parent` (a frame, or a function
        making one). A compilation is only ever used with values of the structure,
        shapes and dtypes it was traced with: the cache keeps up to `VARIANTS` per
        argument key, for callers (e.g. threads) whose states differ in shape.

        **Raises:**

        `StaleTrace` if even a fresh trace does not fit the caller's values (its
        states changed shape meanwhile, or it wants values for other states).
        """
        found = self._find(call.key, values_of)
        if found is not None:
            return found
        with self._lock:
            key_lock = self._pending.setdefault(call.key, threading.RLock())
        # Concurrent first calls with the same key and shapes trace once.
        with key_lock:
            found = self._find(call.key, values_of)
            if found is not None:
                return found
            frame = parent() if callable(parent) else parent
            self._stats.miss()
            try:
                entry = self._trace(call, frame)
                # Stored before the key's lock is dropped: a thread arriving after
                # that finds the entry instead of tracing again.
                self._store(call.key, entry)
            finally:
                with self._lock:
                    self._pending.pop(call.key, None)
        values = values_of(entry)
        if values is None or entry.stale_state(values) is not None:
            raise StaleTrace
        return entry, values

    def _find(
        self, key: Hashable, values_of: Callable[[Compiled], list | None]
    ) -> tuple[Compiled, list] | None:
        with self._lock:
            variants = tuple(self._cache.get(key, ()))
        for entry in variants:
            values = values_of(entry)
            if values is not None and entry.stale_state(values) is None:
                self._touch(key, entry)
                self._stats.hit()
                return entry, values
        return None

    def _touch(self, key: Hashable, entry: Compiled) -> None:
        with self._lock:
            variants = self._cache.get(key)
            if variants is not None:
                self._cache.move_to_end(key)
                if variants[0] is not entry and entry in variants:
                    variants.remove(entry)
                    variants.insert(0, entry)
            self._last_key = key

    def _store(self, key: Hashable, entry: Compiled) -> None:
        self._stats.traced()
        with self._lock:
            self._last_key = key
            if not entry.cacheable:
                return
            variants = self._cache.setdefault(key, [])
            variants.insert(0, entry)
            self._stats.evicted(len(variants[VARIANTS:]))
            del variants[VARIANTS:]
            self._cache.move_to_end(key)
            while len(self._cache) > CACHE_SIZE:
                self._stats.evicted(len(self._cache.popitem(last=False)[1]))

    def clear_cache(self) -> None:
        """Drops every cached trace and compiled executable, and resets the counts of
        [`eqstate.transform.StatefulFunction.get_cache_stats`][]."""
        with self._lock:
            self._cache.clear()
            self._last_key = MISSING
        self._stats.reset()
        if self._dispatch is not None:
            self._dispatch.clear()

    # --------------------------------------------------------------------- tracing

    def _trace(self, call: CallArgs, parent: _context.Frame) -> Compiled:
        if compat.single_pass_enabled():
            result = self._trace_once(call, parent, known=None)
            assert isinstance(result, Compiled)
            return result
        # Public-API fallback: a first pass discovers the states, a second traces with
        # their values as inputs (repeated if a pass meets states the last one missed).
        known: list[State] = []
        while True:
            result = self._trace_once(call, parent, known=known)
            if isinstance(result, Compiled):
                return result
            known.extend(result)

    def _trace_once(
        self, call: CallArgs, parent: _context.Frame, known: list[State] | None
    ) -> Compiled | list[State]:
        """One trace. With `known` (the two-pass fallback), their values are inputs,
        and the states met but not known are returned instead of a compilation."""
        n_args = len(call.leaves)
        outer = [] if known is None else [parent.fetch(s) for s in known]
        outer_defs = [jtu.tree_structure(v) for v in outer]
        trace = TraceRecord(self.name, self.state_returns)

        def pure(*leaves):
            preloaded = None
            if known is not None:
                preloaded = dict(
                    zip(known, unflatten_each(outer_defs, leaves[n_args:]))
                )
            frame = trace.frame = _context.TraceFrame(parent, preloaded)
            args, kwargs = call.rebuild(leaves[:n_args])
            token = _context.enter(frame)
            try:
                out = self.fun(*args, **kwargs)
                return trace.outputs(frame, out)
            finally:
                _context.leave(token)
                # JAX checks for leaked tracers as soon as this trace ends.
                frame.release()

        in_leaves = list(call.leaves)
        for value in outer:
            in_leaves.extend(struct(signature(x)) for x in jtu.tree_leaves(value))
        try:
            jaxpr = jax.make_jaxpr(pure, axis_env=self.axis_env)(*in_leaves)
        finally:
            if trace.frame is not None:
                for state in trace.frame.new_states:
                    expire(state, self.name)
                trace.frame.release()
        frame = trace.frame
        assert frame is not None
        if known is not None and frame.missing:
            return list(dict.fromkeys(frame.missing))
        if known is None:
            states = tuple(frame.accessed)
            defs = tuple(trace.state_defs[s] for s in states)
        else:
            states, defs = tuple(known), tuple(outer_defs)
        return trace.compiled(jaxpr, states, defs)

    # ----------------------------------------------------------------- inspection

    def make_jaxpr(self, *args: Any, **kwargs: Any) -> "StatefulFunction":
        """Traces the function for these arguments (unless already cached), against
        the innermost context.

        **Returns:**

        `self`, so that `sf.make_jaxpr(x).get_jaxpr()` reads naturally.
        """
        self.compile(self.parse_args(args, kwargs), _context.current_frame())
        return self

    def compile_and_get_states_by_static_args(
        self, *args: Any, **kwargs: Any
    ) -> tuple[State, ...]:
        """Traces on a cache miss, then returns the states the call touches."""
        return self.compile(
            self.parse_args(args, kwargs), _context.current_frame()
        ).states

    def get_jaxpr(self, cache_key: Hashable = ()) -> jex_core.ClosedJaxpr:
        """The `ClosedJaxpr` of the pure form. Inputs: the traced argument leaves,
        then the leaves of every pre-existing state touched, in first-access order.
        Outputs: the output leaves, the leaves of the returned states (see
        `state_returns`), then the leaves of the new states.

        **Arguments:**

        - `cache_key`: a key from [`eqstate.transform.StatefulFunction.get_arg_cache_key`][],
            or `()` for the most recent compilation.

        **Raises:**

        `KeyError` (an [`eqstate.UnknownCacheKeyError`][]) for an unknown key.
        """
        return self.compiled(cache_key).jaxpr

    def get_out_shapes(self, cache_key: Hashable = ()) -> tuple[PyTree, tuple]:
        """`(out_shapes, state_shapes)`: `jax.ShapeDtypeStruct`s shaped like the
        output (new states' handles stay in place) and like the returned states'
        values."""
        entry = self.compiled(cache_key)
        avals = [v.aval for v in entry.jaxpr.jaxpr.outvars]
        structs = [struct((a.shape, a.dtype, a.weak_type)) for a in avals]
        out = entry.build_output(structs[: entry.n_out], entry.new_states)
        n_returned = sum(d.num_leaves for d in entry.returned_defs)
        returned = unflatten_each(
            entry.returned_defs, structs[entry.n_out : entry.n_out + n_returned]
        )
        return out, tuple(returned)

    def get_out_treedef(self, cache_key: Hashable = ()) -> PyTreeDef:
        """The tree structure of `(out, state_vals)` (see `get_out_shapes`)."""
        return jtu.tree_structure(self.get_out_shapes(cache_key))

    def get_states(self, cache_key: Hashable = ()) -> tuple[State, ...]:
        """Every pre-existing state the function touches, in first-access order."""
        return self.compiled(cache_key).states

    def get_read_states(self, cache_key: Hashable = ()) -> tuple[State, ...]:
        """The states the function only reads."""
        return self.compiled(cache_key).read_states

    def get_write_states(self, cache_key: Hashable = ()) -> tuple[State, ...]:
        """The states the function writes (a read followed by a write counts as a
        write)."""
        return self.compiled(cache_key).write_states

    def get_new_states(self, cache_key: Hashable = ()) -> tuple[State, ...]:
        """The states the function creates, as handles of the trace. Each call gives
        fresh handles in their place; these ones have no value outside the trace."""
        return self.compiled(cache_key).new_states

    def describe(self, *args: Any, **kwargs: Any) -> str:
        """A readable table of the states the function reads, writes and creates when
        called with these arguments (it is traced if needed; nothing runs).

        **Returns:**

        A string: one row per state (per leaf, for a state holding a PyTree), with its
        kind, name, shape, dtype and access (`read`, `write`, `read+write`, `new`).

        !!! Example

            ```python
            import eqstate as es
            import jax.numpy as jnp

            w = es.ParamState(jnp.ones((2, 3)), name="w")
            steps = es.ShortTermState(jnp.array(0), name="steps")

            def f(x):
                steps.value = steps.value + 1
                return w.value @ x

            print(es.transform.StatefulFunction(f).describe(jnp.ones(3)))
            ```

            prints

            ```
            f: reads 1, writes 1, creates 0 state(s)
            kind            name   shape   dtype    access
            --------------  -----  ------  -------  ----------
            ShortTermState  steps  ()      int32    read+write
            ParamState      w      (2, 3)  float32  read
            ```
        """
        entry = self.compile(self.parse_args(args, kwargs), _context.current_frame())
        written, read_written = set(entry.write_states), set(entry.read_written_states)
        rows, start = [], 0
        for state, treedef in zip(entry.states, entry.state_defs):
            sigs = entry.state_signatures[start : start + treedef.num_leaves]
            start += treedef.num_leaves
            access = "read"
            if state in written:
                access = "read+write" if state in read_written else "write"
            rows += _describe_rows(state, treedef, sigs, access)
        outvars = entry.jaxpr.jaxpr.outvars
        new_avals = outvars[len(outvars) - sum(d.num_leaves for d in entry.new_defs) :]
        start = 0
        for state, treedef in zip(entry.new_states, entry.new_defs):
            sigs = [
                (v.aval.shape, v.aval.dtype, v.aval.weak_type)
                for v in new_avals[start : start + treedef.num_leaves]
            ]
            start += treedef.num_leaves
            rows += _describe_rows(state, treedef, sigs, "new")
        title = (
            f"{self.name}: reads {len(entry.states) - len(written)}, writes "
            f"{len(written)}, creates {len(entry.new_states)} state(s)"
        )
        headers = ["kind", "name", "shape", "dtype", "access"]
        return f"{title}\n{table(headers, rows)}"

    def to_state_manager(self, cache_key: Hashable = ()) -> StateDict:
        """A [`eqstate.StateDict`][] of the touched states with their current values
        in the innermost context."""
        states = self.compiled(cache_key).states
        values = _context.current_frame().read_many(states) if states else []
        return StateDict._wrap(dict(zip(states, values)))

    # -------------------------------------------------------------- introspection

    def get_cache_stats(self) -> dict[str, Any]:
        """Statistics of the trace cache, to see why a function retraces.

        **Returns:**

        A dict with:

        - `keys`: the argument cache keys held (at most `maxsize`);
        - `entries`: the compilations held: up to `variants_per_key` per key, for
            states whose shapes differ between calls (e.g. in other threads);
        - `hits`: lookups answered by a held compilation;
        - `misses`: lookups that found none, so traced the function;
        - `traces`: traces that completed;
        - `evictions`: compilations dropped to make room;
        - `maxsize`, `variants_per_key`: the limits;
        - `compilation_cache`: `{'size', 'maxsize', 'hits', 'misses', 'hit_rate'}`
            (the hit rate in percent), the layout of brainstate's `get_cache_stats`.

        [`eqstate.transform.StatefulFunction.clear_cache`][] resets the counts. A
        function compiled by [`eqstate.transform.jit`][] looks up its trace only when
        JAX traces it (a first call, new shapes): its steady-state calls go straight
        to the compiled executable and are not counted.

        !!! Example

            ```python
            import eqstate as es
            import jax.numpy as jnp

            sf = es.transform.StatefulFunction(lambda x: x * 2)
            sf(jnp.ones(3))
            sf(jnp.zeros(3))  # same shapes: a hit
            sf(jnp.ones(4))  # new shapes: a miss and a trace
            stats = sf.get_cache_stats()
            assert (stats["hits"], stats["misses"], stats["traces"]) == (1, 2, 2)
            assert stats["keys"] == stats["entries"] == 2
            ```
        """
        with self._lock:
            keys = len(self._cache)
            entries = sum(len(v) for v in self._cache.values())
        counts = self._stats.counts()
        looked_up = counts["hits"] + counts["misses"]
        return {
            "keys": keys,
            "entries": entries,
            **counts,
            "maxsize": CACHE_SIZE,
            "variants_per_key": VARIANTS,
            "compilation_cache": {
                "size": keys,
                "maxsize": CACHE_SIZE,
                "hits": counts["hits"],
                "misses": counts["misses"],
                "hit_rate": 100.0 * counts["hits"] / looked_up if looked_up else 0.0,
            },
        }

    def validate_states(self, cache_key: Hashable = ()) -> bool:
        """Checks the current values of the states of a compilation against the
        structures, shapes and dtypes it was traced with (a state that changed would
        make the next call retrace).

        **Arguments:**

        - `cache_key`: as for [`eqstate.transform.StatefulFunction.get_jaxpr`][];
            `()` for the most recent compilation.

        **Returns:**

        `True` if every state still fits.

        **Raises:**

        [`eqstate.StateValueError`][] naming each state that changed, with its traced
        and current shapes, and each state the innermost context has no value for;
        `KeyError` (an [`eqstate.UnknownCacheKeyError`][]) for an unknown key.

        !!! Example

            ```python
            import eqstate as es
            import jax.numpy as jnp
            import pytest

            h = es.ShortTermState(jnp.zeros(3), name="h")
            sf = es.transform.StatefulFunction(lambda x: h.value + x)
            sf.make_jaxpr(1.0)
            assert sf.validate_states()
            with es.scope(es.StateDict({h: jnp.zeros(5)})):  # e.g. a new batch size
                with pytest.raises(ValueError, match="'h': traced with f32.3., now f32.5."):
                    sf.validate_states()
            ```
        """
        entry = self.compiled(cache_key)
        frame = _context.current_frame()
        problems, start = [], 0
        for state, treedef in zip(entry.states, entry.state_defs):
            sigs = list(entry.state_signatures[start : start + treedef.num_leaves])
            start += treedef.num_leaves
            value = frame.peek(state)
            if value is MISSING:
                problems.append(f"{state_label(state)}: has no value here")
                continue
            leaves, actual = jtu.tree_flatten(value)
            if actual == treedef and [signature(x) for x in leaves] == sigs:
                continue
            traced = value_summary(
                jtu.tree_unflatten(treedef, [struct(x) for x in sigs])
            )
            now = value_summary(value)
            if traced == now:  # only a weak type differs
                traced += " (strongly typed)" if not sigs[0][2] else " (weakly typed)"
            problems.append(f"{state_label(state)}: traced with {traced}, now {now}")
        if problems:
            listed = "\n".join(f"- {p}" for p in problems)
            raise StateValueError(
                f"The states of {self.name} no longer fit the compilation for this "
                f"cache key:\n{listed}\nThe next call will trace the function again "
                "for the new shapes; if they should not have changed, look for the "
                "writes that changed them."
            )
        return True

    @overload
    def debug_call(
        self, state_vals: StateDict, *args: Any, **kwargs: Any
    ) -> tuple[StateDict, Any]: ...

    @overload
    def debug_call(
        self, state_vals: Sequence[PyTree], *args: Any, **kwargs: Any
    ) -> tuple[tuple[PyTree, ...], Any]: ...

    def debug_call(
        self,
        state_vals: StateDict | Sequence[PyTree],
        *args: Any,
        **kwargs: Any,
    ) -> tuple[StateDict | tuple[PyTree, ...], Any]:
        """Like [`eqstate.transform.StatefulFunction.jaxpr_call`][], but runs the
        Python function itself, operation by operation, under `jax.disable_jit()`, so
        that `print`, `breakpoint()` and `float(x)` work inside it (and inside the
        eqstate loops and conditionals it calls). Nothing is written to any context.

        **Arguments:**

        - `state_vals`: a [`eqstate.StateDict`][] holding (at least) the states the
            function touches; or a sequence of values aligned with
            [`eqstate.transform.StatefulFunction.get_states`][], for which the
            function is traced first if it has not been (to know the order of its
            states): a function that cannot be traced yet (it calls `float(x)`)
            takes a `StateDict`.
        - `*args`, `**kwargs`: the function's arguments.

        **Returns:**

        `(new_state_vals, out)`, as `jaxpr_call` returns them.

        **Raises:**

        As `jaxpr_call`, and whatever the function raises.

        !!! Example

            ```python
            import eqstate as es
            import jax.numpy as jnp

            count = es.State(jnp.array(0), name="count")

            def f(x):
                count.value = count.value + 1
                print("count is", int(count.value))  # a concrete value here
                return x * 2

            sf = es.transform.StatefulFunction(f)
            new, out = sf.debug_call(es.StateDict({count: jnp.array(41)}), 1.0)
            assert new[count] == 42 and out == 2.0 and count.value == 0
            ```
        """
        if isinstance(state_vals, Mapping) and not isinstance(state_vals, StateDict):
            raise TypeError(
                f"`debug_call` takes a StateDict or a sequence of values, got a "
                f"{type(state_vals).__name__}. Wrap it: `eqstate.StateDict(values)`."
            )
        if isinstance(state_vals, StateDict):
            with jax.disable_jit():
                return run(self.fun, state_vals, *args, **kwargs)
        values = tuple(state_vals)
        call = self.parse_args(args, kwargs)
        found = self._find(
            call.key, lambda e: list(values) if len(values) == len(e.states) else None
        )
        entry = found[0] if found else self.compile(call, _context.current_frame())
        if entry.new_states:
            labels = ", ".join(state_label(s) for s in entry.new_states)
            raise ValueError(
                f"{self.name} creates states ({labels}), and a sequence of values has "
                "no place for them. Pass a StateDict to `debug_call` instead."
            )
        _check_sequence(self.name, entry, values)
        with jax.disable_jit():
            new, out = run(
                self.fun,
                StateDict._wrap(dict(zip(entry.states, values))),
                *args,
                **kwargs,
            )
        return tuple(new[s] for s in entry.states), out

    # ---------------------------------------------------------------------- calls

    def _evaluate(
        self, entry: Compiled, arg_leaves: list, values: list
    ) -> tuple[list, list, list]:
        if self.cache_type == "jit":
            options = self._dispatch.flat_options(self.name) if self._dispatch else None
            return entry.split_outputs(jitted(entry, options)(arg_leaves, values))
        return entry.split_outputs(entry.run(arg_leaves, values))

    def _call_against(
        self,
        call: CallArgs,
        parent: "_context.Frame | Callable[[], _context.Frame]",
        values_of: Callable[[Compiled], list | None],
    ) -> tuple[Compiled, list, list, list]:
        """Finds (or traces) the compilation that fits the caller's state values
        (`values_of`), and evaluates it."""
        for _ in range(_RETRIES):
            try:
                entry, values = self.lookup(call, parent, values_of)
                return entry, *self._evaluate(entry, call.leaves, values)
            except StaleTrace:
                # The states changed shape between the trace and the call (another
                # thread wrote them): trace again against the values now there.
                continue
        raise RuntimeError(_KEEPS_CHANGING.format(name=self.name, n=_RETRIES))

    @overload
    def jaxpr_call(
        self, state_vals: StateDict, *args: Any, **kwargs: Any
    ) -> tuple[StateDict, Any]: ...

    @overload
    def jaxpr_call(
        self, state_vals: Sequence[PyTree], *args: Any, **kwargs: Any
    ) -> tuple[tuple[PyTree, ...], Any]: ...

    def jaxpr_call(
        self,
        state_vals: StateDict | Sequence[PyTree],
        *args: Any,
        **kwargs: Any,
    ) -> tuple[StateDict | tuple[PyTree, ...], Any]:
        """Calls the pure form: no context is read or written.

        **Arguments:**

        - `state_vals`: either a [`eqstate.StateDict`][] holding (at least) the states
            the function touches, or a sequence of values aligned with
            [`eqstate.transform.StatefulFunction.get_states`][].
        - `*args`, `**kwargs`: the function's arguments.

        **Returns:**

        `(new_state_vals, out)`. With a `StateDict`, `new_state_vals` is the whole
        dictionary with the writes applied and new states added (under fresh
        handles). With a sequence, it is a tuple aligned like the input, entries that
        were only read passed through unchanged.

        **Raises:**

        With a `StateDict`, [`eqstate.StateNotFoundError`][] if it lacks a state the
        function touches (the dictionary is strict, also while tracing). With a
        sequence, [`eqstate.StateValueError`][] (a `ValueError`) if a value is
        `None` or its structure, shape or dtype differs from the trace's, and
        `ValueError` if the number of values is wrong or the function creates states
        (use a `StateDict` to receive them).
        """
        call = self.parse_args(args, kwargs)
        if isinstance(state_vals, StateDict):
            return self._call_with_dict(state_vals, call)
        if isinstance(state_vals, Mapping):
            raise TypeError(
                f"`jaxpr_call` takes a StateDict or a sequence of values, got a "
                f"{type(state_vals).__name__}. Wrap it: `eqstate.StateDict(values)`."
            )
        return self._call_with_sequence(tuple(state_vals), call)

    def _call_with_dict(self, sd: StateDict, call: CallArgs) -> tuple[StateDict, Any]:
        def values_of(entry: Compiled) -> list | None:
            # A compilation needing a state missing from `sd` does not fit: tracing
            # against the strict dictionary then names the missing state.
            if not all(s in sd for s in entry.states):
                return None
            return [sd[s] for s in entry.states]

        def strict_frame() -> _context.DictFrame:
            return _context.DictFrame(sd.items())

        entry, out, updated, new_values = self._call_against(
            call, strict_frame, values_of
        )
        result = dict(sd.items())
        result.update(zip(entry.updated_states, updated))
        fresh = [fresh_copy(s) for s in entry.new_states]
        result.update(zip(fresh, new_values))
        return StateDict._wrap(result), entry.build_output(out, fresh)

    def _call_with_sequence(self, values: tuple, call: CallArgs) -> tuple[tuple, Any]:
        frame = _context.current_frame()

        def values_of(entry: Compiled) -> list | None:
            return list(values) if len(values) == len(entry.states) else None

        found = self._find(call.key, values_of)
        entry = found[0] if found is not None else self.compile(call, frame)
        if entry.new_states:
            labels = ", ".join(state_label(s) for s in entry.new_states)
            raise ValueError(
                f"{self.name} creates states ({labels}), and a sequence of values has no "
                "place for them. Pass a StateDict to `jaxpr_call` instead: the returned "
                "dictionary holds the new states under fresh handles."
            )
        _check_sequence(self.name, entry, values)
        out, updated, _ = self._evaluate(entry, call.leaves, list(values))
        result = list(values)
        index = {s: i for i, s in enumerate(entry.states)}
        for state, value in zip(entry.updated_states, updated):
            result[index[state]] = value
        return tuple(result), entry.build_output(out, ())

    def jaxpr_call_auto(self, *args: Any, **kwargs: Any) -> Any:
        """Calls the function against the innermost context: reads the values it
        needs from there, calls the pure form, writes the results back and registers
        new states (under fresh handles).

        **Returns:**

        The function's output.
        """
        if self._dispatch is not None:
            return self._dispatch(args, kwargs)
        return self._call_auto_slow(args, kwargs)

    def _call_auto_slow(self, args: tuple, kwargs: dict) -> Any:
        frame = _context.current_frame()
        call = self.parse_args(args, kwargs)
        if self._dispatch is not None:
            entry = self.compile(call, frame)
            if can_plan(entry):
                done, out = self._dispatch.call_planned(
                    call, entry, frame, args, kwargs
                )
                if done:
                    return out

        def values_of(entry: Compiled) -> list:
            return frame.read_many(entry.states) if entry.states else []

        entry, out, updated, new_values = self._call_against(call, frame, values_of)
        fresh = [fresh_copy(s) for s in entry.new_states]
        if updated or fresh:
            updates = dict(zip(entry.updated_states, updated))
            frame.commit(updates, list(zip(fresh, new_values)))
        return entry.build_output(out, fresh)

    __call__ = jaxpr_call_auto


def _peek_values(frame: _context.Frame, entry: Compiled) -> list | None:
    """The values of `entry.states` in `frame` (as a child trace would see them),
    recording nothing; `None` if one is missing."""
    values = [frame.peek(s) for s in entry.states]
    return None if any(v is MISSING for v in values) else values


def _describe_rows(
    state: State, treedef: PyTreeDef, sigs: Sequence[tuple], access: str
) -> list[list[str]]:
    placeholder = jtu.tree_unflatten(treedef, [0] * treedef.num_leaves)
    paths = [jtu.keystr(p) for p, _ in jtu.tree_flatten_with_path(placeholder)[0]]
    return [
        [type(state).__name__, state_name(state) + path, str(shape), str(dtype), access]
        for path, (shape, dtype, _) in zip(paths, sigs)
    ]


def _check_sequence(name: str, entry: Compiled, values: tuple) -> None:
    if len(values) != len(entry.states):
        raise ValueError(
            f"{name} touches {len(entry.states)} state(s), but `jaxpr_call` got "
            f"{len(values)} value(s). Pass one value per state of `get_states()`, in "
            "that order."
        )
    for i, (state, value) in enumerate(zip(entry.states, values)):
        if value is None:
            raise StateValueError(
                f"The value at position {i} of `jaxpr_call`'s state values, for "
                f"{state_label(state)}, is None. Pass its current value."
            )
    stale = entry.stale_state(list(values))
    if stale is not None:
        i = entry.states.index(stale)
        start = sum(d.num_leaves for d in entry.state_defs[:i])
        sigs = entry.state_signatures[start : start + entry.state_defs[i].num_leaves]
        expected = jtu.tree_unflatten(entry.state_defs[i], [struct(s) for s in sigs])
        raise StateValueError(
            f"The value at position {i} of `jaxpr_call`'s state values, for "
            f"{state_label(stale)}, is {value_summary(values[i])}, but the function "
            f"was traced with {value_summary(expected)}."
        )


def _as_tuple(x: Any, kind: type, what: str) -> tuple:
    items = (x,) if isinstance(x, kind) else tuple(x)
    for item in items:
        if not isinstance(item, kind):
            raise TypeError(f"`{what}` must hold {kind.__name__}s, got {item!r}.")
    return items


def _positions_of(fun: Callable, names: tuple[str, ...]) -> tuple[int, ...]:
    if not names:
        return ()
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        return ()
    positional = (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )
    return tuple(
        i for i, p in enumerate(params) if p.kind in positional and p.name in names
    )


def _hashable(x: Any, what: str, where: str) -> Any:
    try:
        hash(x)
    except TypeError:
        raise TypeError(
            f"{where} got an unhashable {what}: {x!r} of type {type(x).__name__}. "
            "Static arguments (and non-array leaves of arguments) are part of the "
            "cache key, so they must be hashable. Make it a tuple or frozen "
            "dataclass, or pass it as an array so that it is traced."
        ) from None
    return x


def _leaf_path(tree: Any, index: int) -> tuple:
    return jtu.tree_flatten_with_path(tree)[0][index][0]


def _argument_name(path: tuple, static_index: set[int]) -> str:
    """`argument 2.w` for the path of a leaf in `(dynamic_args, dynamic_kwargs)`."""
    group, where, *rest = path
    if group.idx == 0:  # a positional argument: count the static ones back in
        positions = (i for i in range(where.idx + len(static_index) + 1))
        original = [i for i in positions if i not in static_index][where.idx]
        return f"{original}{jtu.keystr(tuple(rest))}"
    return f"{where.key!r}{jtu.keystr(tuple(rest))}"


def _summarise_keys(keys: list, limit: int = 3) -> str:
    if not keys:
        return "It has no compilation yet."
    shown = "; ".join(repr(k) for k in keys[-limit:])
    return f"It has {len(keys)} compilation(s); the most recent key(s): {shown}."


def make_jaxpr(
    fun: Callable,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    axis_env: Sequence[tuple[Hashable, int]] | None = None,
    state_returns: str | Sequence[str] = ("read", "write"),
    return_shape: bool = False,
) -> Callable[..., tuple]:
    """Like `jax.make_jaxpr`, for a function that uses states.

    **Arguments:**

    - `fun`, `static_argnums`, `static_argnames`, `axis_env`, `state_returns`: as
        for [`eqstate.transform.StatefulFunction`][].
    - `return_shape`: also return the output's shapes, as `jax.make_jaxpr` does.

    **Returns:**

    A function taking `fun`'s arguments and returning `(jaxpr, states)`: the
    `ClosedJaxpr` of the pure form and the states it takes as trailing inputs. With
    `return_shape`, `(jaxpr, states, out_shapes)`, where `out_shapes` is the output
    with `jax.ShapeDtypeStruct`s in place of arrays (see
    [`eqstate.transform.eval_shape`][] for the states' shapes).

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        w = es.ParamState(jnp.ones(2))
        jaxpr, states = es.transform.make_jaxpr(lambda x: w.value * x)(jnp.ones(2))
        assert states == (w,) and len(jaxpr.jaxpr.invars) == 2

        make = es.transform.make_jaxpr(lambda x: w.value * x, return_shape=True)
        jaxpr, states, out = make(jnp.ones(2))
        assert out.shape == (2,)
        ```
    """

    def make(*args: Any, **kwargs: Any) -> tuple:
        sf = StatefulFunction(
            fun,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            axis_env=axis_env,
            state_returns=state_returns,
        ).make_jaxpr(*args, **kwargs)
        if return_shape:
            return sf.get_jaxpr(), sf.get_states(), sf.get_out_shapes()[0]
        return sf.get_jaxpr(), sf.get_states()

    make.__name__ = make.__qualname__ = f"make_jaxpr({getattr(fun, '__name__', fun)})"
    return make
