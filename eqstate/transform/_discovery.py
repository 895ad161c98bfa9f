"""How most transforms run a function that uses states: a *discovery* trace finds its
states and their values in the calling frame; inside the JAX transform, the trace is
evaluated with the values passed in explicitly; the written values come out of the
transform and are committed to the calling frame."""

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from .. import _context, _jax_compat as compat
from .._errors import UnstableStatesError
from .._state import lock_keys, State
from ._call_args import ArgParser, CallArgs
from ._function_traces import FunctionTraces
from ._report import refuse_new_states
from ._trace import StaleTrace, Trace


compat.hide_from_tracebacks(__file__)


def traces_for(
    fun: Callable,
    name: str | None = None,
    static_argnums: Sequence[int] = (),
    axis_env: Sequence[tuple[Hashable, int]] | None = None,
    transformed_argnums: Sequence[int] | None = None,
    transformed_axes: tuple | None = None,
) -> FunctionTraces:
    """A trace cache for `fun` that returns the states it writes, for a transform
    that calls it many times (`grad`, `checkpoint`, `vmap`): inside an enclosing
    trace, each call reuses the traces of the last (see `kept_or_fresh`). `axis_env`
    puts named axes in scope while tracing; `transformed_argnums`,
    `transformed_axes`: see `ArgParser`."""
    label: str = name or getattr(fun, "__name__", type(fun).__name__)
    parser = ArgParser(
        fun,
        label,
        tuple(static_argnums),
        transformed_argnums=transformed_argnums,
        transformed_axes=transformed_axes,
    )
    env = None if axis_env is None else tuple(axis_env)
    return FunctionTraces(fun, label, parser, ("write",), env)


def kept_or_fresh(traces: FunctionTraces) -> FunctionTraces:
    """The trace cache a transformed function's call uses: inside an enclosing trace,
    one kept across the calls made in that very trace (a Python loop calling `grad`
    ten times traces its function once); otherwise a new, empty one. Like JAX's own
    transforms, a call at top level, or in another trace (another jitted function, a
    retrace after `clear_cache()` or for new shapes), runs the function's Python
    again, so that the arrays and flags it reads from globals or closures, and the
    states it finds there, are the current ones (a kept trace holds the first ones).
    """
    if compat.is_top_level():
        return traces.emptied()
    return traces.kept_for(compat.current_trace())


class Discovery:
    """A function traced for one call: its states, and their values in the calling
    frame. `evaluate` then runs it inside a JAX transform with other values.

    **Arguments:**

    - `fun`, `args`, `kwargs`: the function and the call.
    - `name`, `static_argnums`: for a new trace cache (see `traces_for`).
    - `parent`: the frame that gives the values and takes the writes (default: the
        innermost one).
    - `traces`: a trace cache to use instead of a new one.
    - `discover_in`: the frame to trace against, if not `parent` (`vmap` passes a view
        of it with the batch axes stripped).
    - `trace_in`: where the trace is made, if not here: `trace_in(discover, args)`
        calls `discover` with the arguments as the transform's body sees them, in the
        context the body runs in (`shard_map` calls it inside `jax.shard_map`).
    """

    def __init__(
        self,
        fun: Callable,
        args: tuple,
        kwargs: dict | None = None,
        *,
        name: str | None = None,
        static_argnums: Sequence[int] = (),
        parent: "_context.Frame | None" = None,
        traces: FunctionTraces | None = None,
        discover_in: "_context.Frame | None" = None,
        trace_in: "Callable[[Callable[..., None], tuple], None] | None" = None,
    ):
        self.traces = traces or traces_for(fun, name, static_argnums)
        self.name = self.traces.name
        self.frame = parent if parent is not None else _context.current_frame()
        found: list[tuple[Hashable, Trace]] = []

        def discover(*body_args: Any) -> None:
            call = self.traces.parse(body_args, kwargs or {})
            # The states are seen as they are inside the transform (`vmap` strips
            # their batch axes); their values come from the calling frame.
            found.append(
                (call.key, self.traces.trace_for(call, discover_in or self.frame))
            )

        if trace_in is None:
            discover(*args)
        else:
            trace_in(discover, args)
        [(self.key, trace)] = found
        lock_keys(self.frame, trace.updated_states)
        # Read here, not where the trace was made: a value read inside `trace_in`'s
        # context could be a tracer of it.
        self.values = self.frame.read_many(trace.states)
        self.trace: Trace = trace

    @property
    def states(self) -> tuple[State, ...]:
        return self.trace.states

    @property
    def written(self) -> tuple[State, ...]:
        return self.trace.updated_states

    def refuse_new_states(self, where: str) -> None:
        """Raises `NewStateError` if the function creates states inside `where`."""
        refuse_new_states(
            self.trace,
            where,
            "States cannot be created inside it, because each call or iteration "
            "would create another set. Create them before, outside the transformed "
            "function.",
        )

    def evaluate(
        self,
        values: Sequence[Any],
        args: tuple,
        kwargs: dict | None = None,
        python_scalars: bool = False,
    ) -> tuple[Any, dict[State, Any], list[tuple[State, Any]]]:
        """Evaluates the function on `args` with `values` for `self.states`. With
        `python_scalars`, the Python scalars in the output come back as they are.

        **Returns:**

        `(out, updates, new)`: the output (new states' handles replaced by fresh
        ones), the values of the written states, and `(fresh handle, value)` pairs.

        **Raises:**

        `UnstableStatesError` if the function touches other states when traced with
        these arguments and values than it did in the discovery trace.
        """
        call = self.traces.parse(args, kwargs or {})
        values = list(values)
        trace = self._trace_inside(values, call)
        out_leaves, updated, new_values = trace.split_outputs(
            trace.run(call.leaves, values)
        )
        out, updated, fresh, new_values = trace.under_fresh_handles(
            out_leaves, updated, new_values, python_scalars
        )
        return (
            out,
            dict(zip(trace.updated_states, updated)),
            list(zip(fresh, new_values)),
        )

    def _trace_inside(self, values: list, call: CallArgs) -> Trace:
        states = self.trace.states
        # The discovery trace serves when it fits, even if it could not be cached (it
        # closes over tracers of an enclosing trace).
        if call.key == self.key and self.trace.stale_state(values) is None:
            return self.trace
        # The values inside the transform may differ from the outer ones (a batch axis
        # removed, a weak type dropped for a loop carry): trace against them.

        def values_of(trace: Trace) -> list | None:
            return values if trace.states == states else None

        def inner() -> _context.Frame:
            return _context.DictFrame(zip(states, values))

        try:
            trace, _ = self.traces.lookup(call, inner, values_of)
        except StaleTrace:  # `values_of` refuses a trace of other states
            raise UnstableStatesError(
                f"{self.name} touched different states when traced inside the "
                "transform than before it. Its states must not depend on the values "
                "of its arguments."
            ) from None
        return trace

    def commit(
        self, updates: dict[State, Any], new: Sequence[tuple[State, Any]] = ()
    ) -> None:
        """Writes the function's updates and new states to the calling frame."""
        if updates or new:
            self.frame.commit(updates, list(new))
