"""StatefulFunction: traces a function that uses states into a pure jaxpr."""

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, overload

import jax
import jax.extend.core as jex_core
import jax.tree_util as jtu

from .. import _context, _jax_compat as compat
from .._arguments import given
from .._custom_types import PyTree, PyTreeDef
from .._errors import StateValueError
from .._pretty_print import first_and_more, shape_summary, state_label
from .._run import run
from .._state import State
from .._state_dict import state_dict_of, StateDict
from . import _function_traces
from ._call_args import ArgParser, CallArgs
from ._dispatch import JitDispatch
from ._function_traces import FunctionTraces
from ._leaves import signature
from ._report import (
    check_sequence,
    fits_but_for_weak_types,
    misfits,
    refuse_ints_too_large,
    refuse_new_states,
    states_table,
)
from ._trace import out_shapes, StaleTrace, Trace


compat.hide_from_tracebacks(__file__)

_NO_PLACE = (
    "A sequence of values has no place for them: pass a StateDict to `{method}` "
    "instead (the returned dictionary holds the new states under fresh handles)."
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
    part of the cache key. Outputs may hold non-array leaves (returned as they were
    while tracing), handles that existed before the call (a module holding them,
    say: the caller gets the same handles back) and the handles of new states
    (fresh ones at each call).

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
        fun: Callable[..., Any],
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
            into the cache key instead of traced, as in `jax.jit`. The parameter at
            a (non-negative) index is static when passed by keyword too; one left at
            its default is not an argument. An index beyond the parameters of `fun`
            raises `ValueError` (any index fits a `fun` taking `*args`).
        - `static_argnames`: names of keyword arguments that are static. A name that
            matches a positional parameter of `fun` makes it static when passed by
            position too. A name no parameter has raises `ValueError` (any name
            fits a `fun` taking `**kwargs`).
        - `axis_env`: `(axis_name, size)` pairs, so that collectives over those named
            axes can be traced (as in `jax.make_jaxpr`). A call made inside a
            transform that binds one of these names (a `jax.vmap` with that
            `axis_name`, a `shard_map` over that mesh axis) is traced with that
            transform's axis instead, whatever its size.
        - `abstracted_axes`: dynamic shapes. JAX 0.10 has no dynamic-shape tracing, so
            anything but `None` raises `NotImplementedError`.
        - `state_returns`: which states the pure form returns: `'write'` (those
            written), `'read'` (those only read), or both (every state touched).
            With `'read'` alone, the pure form drops the writes, so calling a
            function that writes a state (other than one it creates) raises
            `ValueError`; its `get_*` methods describe that pure form.
        - `cache_type`: `None` caches the jaxpr, which an eager call evaluates op by
            op; `'jit'` also compiles it with `jax.jit`, so that an eager call is a
            single dispatch. Either way, the arrays it returns and writes to states
            are `jax.Array`s, as from `jax.jit`, which may read a NumPy argument
            after the call returns: change one in place only once the results are
            ready.
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
        parser = ArgParser(fun, self.name, static_argnums, static_argnames)
        self.static_argnums = parser.static_argnums
        self.static_argnames = parser.static_argnames
        self.axis_env = None if axis_env is None else tuple(axis_env)
        self.state_returns = returns
        self.cache_type = cache_type
        self._traces = FunctionTraces(
            fun, self.name, parser, returns, self.axis_env, axes_around_win=True
        )
        # With `cache_type='jit'`, eager calls go through `jit`'s plans.
        self._dispatch = JitDispatch(self._traces) if cache_type == "jit" else None

    def __repr__(self) -> str:
        return f"StatefulFunction({self.name})"

    def get_arg_cache_key(self, *args: Any, **kwargs: Any) -> Hashable:
        """The cache key of a call with these arguments: the static arguments (by
        value) and the shapes, dtypes, weak types and tree structure of the others.

        **Raises:**

        `TypeError` naming the argument if a static argument (or a leaf that is
        not an array) is unhashable.
        """
        return self._traces.parse(args, kwargs).key

    def clear_cache(self) -> None:
        """Drops every cached trace and compiled executable, and resets the counts of
        [`eqstate.transform.StatefulFunction.get_cache_stats`][]."""
        if self._dispatch is not None:
            self._dispatch.clear()  # its plans, and the traces
        else:
            self._traces.clear()

    # ----------------------------------------------------------------- inspection

    def make_jaxpr(self, *args: Any, **kwargs: Any) -> "StatefulFunction":
        """Traces the function for these arguments (unless already cached), against
        the innermost context.

        **Returns:**

        `self`, so that `sf.make_jaxpr(x).get_jaxpr()` reads naturally.
        """
        self._trace_for(args, kwargs)
        return self

    def compile_and_get_states_by_static_args(
        self, *args: Any, **kwargs: Any
    ) -> tuple[State, ...]:
        """Traces on a cache miss, then returns the states the call touches."""
        return self._trace_for(args, kwargs).states

    def get_jaxpr(self, cache_key: Hashable = ()) -> jex_core.ClosedJaxpr:
        """The `ClosedJaxpr` of the pure form. Inputs: the traced argument leaves,
        then the leaves of every pre-existing state touched, in first-access order.
        Outputs: the output leaves, the leaves of the returned states (see
        `state_returns`), then the leaves of the new states.

        **Arguments:**

        - `cache_key`: a key from [`eqstate.transform.StatefulFunction.get_arg_cache_key`][],
            or `()` for the most recently used trace.

        **Raises:**

        `KeyError` (an [`eqstate.UnknownCacheKeyError`][]) for an unknown key, or if
        that trace was made inside a JAX transform and not kept, because it closes
        over the transform's tracers or uses custom derivative rules (`jax.nn.relu`)
        there: the other `get_*` methods describe it all the same, and
        [`eqstate.transform.make_jaxpr`][] returns its jaxpr.
        """
        return self._traces.by_key(cache_key).jaxpr

    def get_out_shapes(
        self, cache_key: Hashable = ()
    ) -> tuple[PyTree, tuple[PyTree, ...]]:
        """`(out_shapes, state_shapes)`: `jax.ShapeDtypeStruct`s shaped like the
        output (new states' handles stay in place) and like the returned states'
        values."""
        described = self._traces.described(cache_key)
        if isinstance(described, Trace):
            return out_shapes(described)
        return described.out_shapes

    def get_out_treedef(self, cache_key: Hashable = ()) -> PyTreeDef:
        """The tree structure of `(out, state_vals)` as `get_out_shapes` gives them:
        `out` as the function returns it, `state_vals` the values of the states the
        pure form returns (see `state_returns`).

        It is not the jaxpr's flat outputs: the jaxpr outputs only the traced leaves
        of `out` (no strings, no handles of new states), and then the new states'
        values, which the treedef leaves out. Nor is it what `jaxpr_call` returns:
        `(state_vals, out)`, with a value for every state of `get_states()`,
        whatever `state_returns` says (a state it leaves out keeps its value).
        """
        return jtu.tree_structure(self.get_out_shapes(cache_key))

    def get_states(self, cache_key: Hashable = ()) -> tuple[State, ...]:
        """Every pre-existing state the function touches, in first-access order."""
        return self._traces.described(cache_key).states

    @property
    def states(self) -> tuple[State, ...]:
        """The states of the most recently used trace: `get_states()`, the read and
        written states of the reference API's `states`.

        **Raises:**

        `KeyError` (an [`eqstate.UnknownCacheKeyError`][]) before the first trace.
        """
        return self.get_states()

    def get_read_states(self, cache_key: Hashable = ()) -> tuple[State, ...]:
        """The states the function only reads."""
        return self._traces.described(cache_key).read_states

    def get_write_states(self, cache_key: Hashable = ()) -> tuple[State, ...]:
        """The states the function writes (a read followed by a write counts as a
        write)."""
        return self._traces.described(cache_key).write_states

    def get_new_states(self, cache_key: Hashable = ()) -> tuple[State, ...]:
        """The states the function creates, as handles of the trace. Each call gives
        fresh handles in their place; these ones have no value outside the trace."""
        return self._traces.described(cache_key).new_states

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
        return states_table(self.name, self._trace_for(args, kwargs))

    def to_state_manager(self, cache_key: Hashable = ()) -> StateDict:
        """A [`eqstate.StateDict`][] of the touched states with their current values
        in the innermost context."""
        states = self._traces.described(cache_key).states
        values = _context.current_frame().read_many(states) if states else []
        return state_dict_of(dict(zip(states, values)))

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
        call of a function compiled by [`eqstate.transform.jit`][] that goes straight
        to a compiled executable reused a trace: it counts as a hit.

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
        keys, entries = self._traces.sizes()
        counts = self._traces.stats.counts()
        looked_up = counts["hits"] + counts["misses"]
        return {
            "keys": keys,
            "entries": entries,
            **counts,
            "maxsize": _function_traces.CACHE_SIZE,
            "variants_per_key": _function_traces.VARIANTS,
            "compilation_cache": {
                "size": keys,
                "maxsize": _function_traces.CACHE_SIZE,
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
            `()` for the most recently used trace.

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
        trace = self._traces.by_key(cache_key)
        problems = misfits(trace, _context.current_frame())
        if problems:
            listed = "\n".join(f"- {p}" for p in problems)
            raise StateValueError(
                f"The states of {self.name} no longer fit the trace for this "
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
        state_vals = _state_values(state_vals, "debug_call")
        if isinstance(state_vals, StateDict):
            if "write" not in self.state_returns:
                # Found as `jaxpr_call` finds it (not run), so that both refuse alike.
                call = self._traces.parse(args, kwargs)
                trace, _ = self._traces.lookup(call, *_against_dict(state_vals))
                self._refuse_lost_writes(trace)
            with jax.disable_jit():
                return run(self.fun, state_vals, *args, **kwargs)
        call = self._traces.parse(args, kwargs)
        trace, aligned, values = self._trace_for_sequence(call, state_vals)
        self._refuse_lost_writes(trace)
        refuse_new_states(trace, self.name, _NO_PLACE.format(method="debug_call"))
        check_sequence(self.name, trace, values, "debug_call")
        with jax.disable_jit():
            new, out = run(
                self.fun,
                state_dict_of(dict(zip(trace.states, values))),
                *args,
                **kwargs,
            )
        return tuple(new[s] for s in aligned), out

    # ---------------------------------------------------------------------- calls

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
            [`eqstate.transform.StatefulFunction.get_states`][] of the call's cache
            key (its most recently used trace). If another trace of that key fits
            the values (states of other shapes, which the function may touch in
            another order), the call uses it, with each value given to its state;
            with a `StateDict` of other shapes, the function is traced again (an
            error from that trace carries a note naming the states whose values
            changed).
        - `*args`, `**kwargs`: the function's arguments.

        **Returns:**

        `(new_state_vals, out)`. With a `StateDict`, `new_state_vals` is the whole
        dictionary with the writes applied and new states added (under fresh
        handles). With a sequence, it is a tuple aligned like the input, entries that
        were only read passed through unchanged. Either way, a value may differ from
        the state's current value in weak type (as a write may): the function is
        then traced again for it.

        **Raises:**

        With a `StateDict`, [`eqstate.StateNotFoundError`][] if it lacks a state the
        function touches (the dictionary is strict, also while tracing). With a
        sequence, [`eqstate.StateValueError`][] (a `ValueError`) if a value is
        `None` or its structure, shape or dtype differs from the trace's, and
        `ValueError` if the number of values is wrong, and
        [`eqstate.NewStateError`][] (a `ValueError`) if the function creates states
        (use a `StateDict` to receive them).
        """
        state_vals = _state_values(state_vals, "jaxpr_call")
        call = self._traces.parse(args, kwargs)
        if isinstance(state_vals, StateDict):
            return self._call_with_dict(state_vals, call)
        return self._call_with_sequence(state_vals, call)

    def _call_with_dict(self, sd: StateDict, call: CallArgs) -> tuple[StateDict, Any]:
        try:
            trace, out, updated, new_values = self._traces.call_against(
                call, *_against_dict(sd), self._jit_options()
            )
        except Exception as exc:
            self._note_other_shapes(exc, sd, call)
            raise
        self._refuse_lost_writes(trace)
        out, updated, fresh, new_values = trace.under_fresh_handles(
            out, list(updated), list(new_values)
        )
        result = dict(sd.items())
        result.update(zip(trace.updated_states, updated))
        result.update(zip(fresh, new_values))
        return state_dict_of(result), out

    def _note_other_shapes(self, exc: Exception, sd: StateDict, call: CallArgs) -> None:
        """Notes on `exc`, raised by a call with `sd`, the states that `sd` gives
        values of other shapes or dtypes than this call's last trace saw: the
        function was traced again for those, and that trace may be what failed."""
        latest = self._traces.latest(call.key)
        if latest is None:
            return
        changed = []
        for state in latest.states:
            if state not in sd:
                continue
            before = [sig[:2] for sig in latest.leaf_signatures(state)]
            now = [signature(x)[:2] for x in jtu.tree_leaves(sd[state])]
            if now != before:
                changed.append(
                    f"{state_label(state)} gets {_shapes_text(now)}, where the trace "
                    f"had {_shapes_text(before)}"
                )
        if changed:
            exc.add_note(
                f"`jaxpr_call` traced {self.name} again because the StateDict gives "
                f"states values of other shapes or dtypes than its last trace for "
                f"these arguments saw: {'; '.join(changed)}. If those values are not "
                "meant for this function, check how the StateDict was built."
            )

    def _call_with_sequence(self, values: tuple, call: CallArgs) -> tuple[tuple, Any]:
        refuse_ints_too_large(values)
        trace, aligned, values = self._trace_for_sequence(call, values)
        self._refuse_lost_writes(trace)
        refuse_new_states(trace, self.name, _NO_PLACE.format(method="jaxpr_call"))
        if not check_sequence(self.name, trace, values, "jaxpr_call"):
            trace = self._retrace_for_weak_types(call, trace, values)
        out, updated, _ = self._traces.evaluate(
            trace, call.leaves, list(values), self._jit_options()
        )
        result = dict(zip(trace.states, values))
        result.update(zip(trace.updated_states, updated))
        return tuple(result[s] for s in aligned), trace.build_output(out, ())

    def jaxpr_call_auto(self, *args: Any, **kwargs: Any) -> Any:
        """Calls the function against the innermost context: reads the values it
        needs from there, calls the pure form, writes the results back and registers
        new states (under fresh handles).

        **Returns:**

        The function's output.
        """
        if "write" not in self.state_returns:
            self._refuse_lost_writes(self._trace_for(args, kwargs))
        if self._dispatch is not None:
            return self._dispatch(*args, **kwargs)
        call = self._traces.parse(args, kwargs)
        return self._traces.call_in(_context.current_frame(), call)

    __call__ = jaxpr_call_auto

    def _refuse_lost_writes(self, trace: Trace) -> None:
        """Raises `ValueError` if a call would drop writes: the function writes
        states that `state_returns` (without `'write'`) leaves out of the pure form."""
        if "write" in self.state_returns or not trace.write_states:
            return
        raise ValueError(
            f"{self.name} writes {first_and_more(map(state_label, trace.write_states))}"
            ", but its pure form returns only the states it reads "
            "(`state_returns='read'`), so a call would lose the writes. Make it "
            "with `state_returns=('read', 'write')` (the default) to call it; "
            "`get_jaxpr` and the other `get_*` methods work as it is."
        )

    def _trace_for(self, args: tuple, kwargs: dict) -> Trace:
        """The trace of a call against the innermost context (made on a miss)."""
        call = self._traces.parse(args, kwargs)
        return self._traces.trace_for(call, _context.current_frame())

    def _trace_for_sequence(
        self, call: CallArgs, values: tuple
    ) -> tuple[Trace, tuple[State, ...], tuple]:
        """The trace to call with `values`, the states they are aligned with (those
        of `get_states()` for the call's key: its most recently used trace), and the
        values in the order of the trace's states. Of the key's traces (states of
        other shapes may touch other states, or the same ones in another order), the
        one that fits the values. Without any, a new trace against the innermost
        context gives the states and their order."""
        latest = self._traces.latest(call.key)
        if latest is not None:
            aligned = latest.states
            if len(values) != len(aligned):
                return latest, aligned, values  # `check_sequence` names the count.
            by_state = dict(zip(aligned, values))

            def values_of(t: Trace) -> list | None:
                if len(t.states) != len(aligned) or not all(
                    s in by_state for s in t.states
                ):
                    return None
                return [by_state[s] for s in t.states]

            found = self._traces.find(call.key, values_of)
            if found is not None:
                return found[0], aligned, tuple(found[1])
            # A trace that the values fit but for weak types: the caller traces
            # again for them. Else `check_sequence` names what differs from
            # `latest`'s values.
            for trace in self._traces.variants(call.key):
                near = values_of(trace)
                if near is not None and fits_but_for_weak_types(trace, near):
                    return trace, aligned, tuple(near)
            return latest, aligned, values
        try:
            trace = self._traces.trace_for(call, _context.current_frame())
        except Exception as exc:
            exc.add_note(
                f"`jaxpr_call` traced {self.name} with the current values of its "
                "states in the innermost context, to learn which states it uses and "
                "in which order (a sequence of values does not say). If the values "
                "passed have other shapes or dtypes than those, pass a StateDict "
                "`{state: value}` instead."
            )
            raise
        return trace, trace.states, values

    def _retrace_for_weak_types(
        self, call: CallArgs, trace: Trace, values: tuple
    ) -> Trace:
        """A trace for `values`, which differ from those `trace` was made with only
        in weak types, as the StateDict form of `jaxpr_call` makes one."""
        states = trace.states

        def values_of(t: Trace) -> list | None:
            return list(values) if t.states == states else None

        def strict_frame() -> _context.DictFrame:
            return _context.DictFrame(zip(states, values))

        try:
            return self._traces.lookup(call, strict_frame, values_of)[0]
        except StaleTrace:
            raise StateValueError(
                f"{self.name} touches other states when traced with these weakly or "
                "strongly typed values, so they cannot be passed as a sequence "
                "aligned with `get_states()`. Pass a StateDict instead."
            ) from None

    def _jit_options(self) -> dict | None:
        # The options of the flat `jax.jit` that a trace keeps: those of the plans
        # calls go through (`jit`'s own, for its `stateful_function`).
        return None if self._dispatch is None else self._dispatch.flat_options()


def traces_of(sf: StatefulFunction) -> FunctionTraces:
    """The traces behind `sf`, for transforms that call its pure form themselves."""
    return sf._traces


def trace_of_call(sf: StatefulFunction, args: tuple, kwargs: dict) -> Trace:
    """The trace of `sf` for a call, made on a miss. Unlike `make_jaxpr` then
    `by_key`, this also gives a trace that is not kept (it closes over tracers)."""
    return sf._trace_for(args, kwargs)


def calls_through(sf: StatefulFunction, dispatch: JitDispatch) -> None:
    """Sends the eager calls of `sf` (made with `cache_type='jit'`) through
    `dispatch`'s plans, and gives its flat `jax.jit` the same options: `jit` shares
    its plans with its `stateful_function`."""
    sf._dispatch = dispatch


def _shapes_text(signatures: list[tuple]) -> str:
    """Leaf `(shape, dtype)` pairs as `f32[4,2]`, joined."""
    texts = [shape_summary(shape, dtype) for shape, dtype in signatures]
    return ", ".join(texts) if texts else "no array"


def _state_values(state_vals: Any, method: str) -> StateDict | tuple:
    """`state_vals` as `jaxpr_call` and `debug_call` take them: a StateDict, or a
    sequence of values made a tuple. `TypeError` for anything else."""
    if isinstance(state_vals, StateDict):
        return state_vals
    if isinstance(state_vals, Mapping):
        fix = "Wrap it: `eqstate.StateDict(values)`."
    elif isinstance(state_vals, Iterable) and not isinstance(state_vals, str):
        return tuple(state_vals)
    else:
        fix = "Pass `[value, ...]`, one per state of `get_states()`, in that order."
    raise TypeError(
        f"`{method}` takes a StateDict or a sequence of values, "
        f"{given(state_vals)}. {fix}"
    )


def _against_dict(sd: StateDict) -> tuple[Callable, Callable]:
    """`(parent, values_of)` for `FunctionTraces.lookup` and `call_against`: the
    trace that fits the values in `sd`, traced against `sd` on a miss."""

    def strict_frame() -> _context.DictFrame:
        return _context.DictFrame(sd.items())

    def values_of(trace: Trace) -> list | None:
        # A trace needing a state missing from `sd` does not fit: tracing against
        # the strict dictionary then names the missing state.
        if not all(s in sd for s in trace.states):
            return None
        return [sd[s] for s in trace.states]

    return strict_frame, values_of


def make_jaxpr(
    fun: Callable[..., Any],
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    axis_env: Sequence[tuple[Hashable, int]] | None = None,
    state_returns: str | Sequence[str] = ("read", "write"),
    return_shape: bool = False,
) -> Callable[..., tuple[Any, ...]]:
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
        )
        # The trace itself: one made inside a transform may not be kept.
        trace = sf._trace_for(args, kwargs)
        if return_shape:
            return trace.jaxpr, trace.states, out_shapes(trace)[0]
        return trace.jaxpr, trace.states

    make.__name__ = make.__qualname__ = f"make_jaxpr({getattr(fun, '__name__', fun)})"
    return make
