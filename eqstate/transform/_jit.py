"""jit: `jax.jit` for functions that read and write states."""

import functools as ft
import inspect
from collections.abc import Callable, Hashable, Sequence
from typing import (
    Any,
    Generic,
    overload,
    ParamSpec,
    TYPE_CHECKING,
    TypedDict,
    TypeVar,
    Unpack,
)

import jax

from .. import _jax_compat as compat
from .._custom_types import MISSING, Missing
from ._decorator import decorator_form
from ._dispatch import JitDispatch
from ._stateful_function import (
    calls_through,
    out_shapes,
    StatefulFunction,
    trace_of_call,
    traces_of,
)


compat.hide_from_tracebacks(__file__)

_P = ParamSpec("_P")
_T = TypeVar("_T")


class JittedFunction(JitDispatch, Generic[_P, _T]):
    """A function compiled by [`eqstate.transform.jit`][]. Call it like the original
    function (its type keeps the signature); `lower`, `eval_shape` and
    `clear_cache` mirror `jax.jit`'s."""

    def __init__(self, fun: Callable[_P, _T], sf: StatefulFunction, **options: Any):
        super().__init__(traces_of(sf), **options)
        self.fun = fun
        self.stateful_function = sf
        ft.update_wrapper(self, fun, updated=())

    if TYPE_CHECKING:  # The call itself is `JitDispatch.__call__`.

        def __call__(  # pyright: ignore[reportIncompatibleMethodOverride]
            self, *args: _P.args, **kwargs: _P.kwargs
        ) -> _T: ...

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        return ft.partial(self, instance)

    def __repr__(self) -> str:
        return f"jit({self.stateful_function.name})"

    def lower(self, *args: _P.args, **kwargs: _P.kwargs) -> jax.stages.Lowered:
        """`jax.stages.Lowered` of the call with these arguments (the state values
        are the current ones), as `jax.jit(f).lower` gives."""
        return self.lower_call(args, kwargs)

    def eval_shape(self, *args: _P.args, **kwargs: _P.kwargs) -> Any:
        """The output's shapes and dtypes, as `jax.ShapeDtypeStruct`s, without
        computing anything or touching any value."""
        return out_shapes(trace_of_call(self.stateful_function, args, kwargs))[0]

    def clear_cache(self) -> None:
        """Drops every trace and compiled executable."""
        self.clear()

    def get_cache_stats(self) -> dict[str, Any]:
        """Statistics of the trace cache, as
        [`eqstate.transform.StatefulFunction.get_cache_stats`][] gives them: every
        call that reused a trace is a hit."""
        return self.stateful_function.get_cache_stats()

    def validate_states(self, cache_key: Hashable = ()) -> bool:
        """As [`eqstate.transform.StatefulFunction.validate_states`][]: checks the
        states' current shapes against a compilation, naming each that changed."""
        return self.stateful_function.validate_states(cache_key)

    def debug_call(self, state_vals: Any, *args: Any, **kwargs: Any) -> Any:
        """As [`eqstate.transform.StatefulFunction.debug_call`][]: runs the Python
        function itself under `jax.disable_jit()` against `state_vals`, so that
        `print` and `breakpoint()` work inside it, and returns
        `(new_state_vals, out)` without writing anything.

        !!! Example

            ```python
            import eqstate as es
            import jax.numpy as jnp

            count = es.State(jnp.array(0), name="count")

            @es.transform.jit
            def step(x):
                count.value = count.value + 1
                print("x is", float(x))  # concrete under debug_call
                return x * 2

            assert isinstance(step, es.transform.JittedFunction)
            new, out = step.debug_call(es.StateDict({count: jnp.array(1)}), 3.0)
            assert new[count] == 2 and out == 6.0 and count.value == 0
            ```
        """
        return self.stateful_function.debug_call(state_vals, *args, **kwargs)


def _check_like_jax(fun: Any, options: dict[str, Any]) -> None:
    """Raises what `jax.jit` raises for these options on this function (a generator
    function, an argument number beyond its signature, a name it does not take, ...),
    at the same time: when the function is wrapped."""
    names = ("static_argnums", "static_argnames", "donate_argnums", "in_shardings")
    # Options left at their defaults are not passed: `jax.jit` infers them (e.g. the
    # static names from the static positions) only when they are absent.
    given = {k: options[k] for k in names if options[k] not in (None, ())}
    if given or not callable(fun) or inspect.isgeneratorfunction(fun):
        jax.jit(fun, **given)  # Skipped otherwise: it costs as much as a call.


class _JitOptions(TypedDict, total=False):
    static_argnums: int | Sequence[int]
    static_argnames: str | Sequence[str]
    donate_states: bool
    donate_argnums: int | Sequence[int]
    in_shardings: Any
    out_shardings: Any
    state_shardings: Any
    keep_unused: bool
    device: Any
    backend: str | None
    inline: bool
    compiler_options: dict[str, Any] | None


@overload
def jit(
    fun: Callable[_P, _T], **options: Unpack[_JitOptions]
) -> JittedFunction[_P, _T]: ...


@overload
def jit(
    fun: Missing = MISSING, **options: Unpack[_JitOptions]
) -> Callable[[Callable[_P, _T]], JittedFunction[_P, _T]]: ...


def _jax_jit_options(options: dict[str, Any]) -> dict[str, Any]:
    """The `jax.jit` options of `jit`'s for the function's own arguments and output,
    as `JitDispatch` takes them: unset ones left out, and `out_shardings` for the
    output only (the jitted body returns `(out, written values)`)."""
    names = ("keep_unused", "inline", "compiler_options")
    jit_kwargs: dict[str, Any] = {k: options[k] for k in names}
    for name in ("device", "backend", "in_shardings"):
        if options[name] is not None:
            jit_kwargs[name] = options[name]
    donated = options["donate_argnums"]
    donated = (donated,) if isinstance(donated, int) else tuple(donated)
    if donated:
        jit_kwargs["donate_argnums"] = donated
    if options["out_shardings"] is not None:
        jit_kwargs["out_shardings"] = (options["out_shardings"], None)
    return jit_kwargs


@decorator_form
def jit(
    fun: Any = MISSING,
    *,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_states: bool = False,
    donate_argnums: int | Sequence[int] = (),
    in_shardings: Any = None,
    out_shardings: Any = None,
    state_shardings: Any = None,
    keep_unused: bool = False,
    device: Any = None,
    backend: str | None = None,
    inline: bool = False,
    compiler_options: dict[str, Any] | None = None,
) -> Any:
    """Compiles `fun` with `jax.jit`, carrying every state it reads or writes.

    The states are found by tracing `fun` once per cache key (see
    [`eqstate.transform.StatefulFunction`][]). A call then reads their values from
    the innermost context, hands them with the arguments to one `jax.jit`-compiled
    function (JAX's C++ dispatch does the PyTree work, and the call does not block on
    the result), and writes the new values of the written states back. Read-only
    states are inputs only. A state whose shape changed since compilation makes JAX
    retrace, and eqstate retraces with it, so a stale trace is never used.

    States created inside `fun` get fresh handles on every call (its output may
    return them, e.g. a model built by a jitted constructor); a `StateDict` in the
    output or in a state's value (an optimiser's state) is keyed by them too.

    **Arguments:**

    - `fun`: the function to compile. If omitted, `jit` returns a decorator.
    - `static_argnums`, `static_argnames`: as in `jax.jit`, except that a static
        argument is static whether passed by position or by keyword, also when both
        options are given (`jax.jit` then infers neither from the other); see
        [`eqstate.transform.StatefulFunction`][].
    - `donate_states`: donate the buffers of the values of the written states to
        each call, which reuses them for the new values (updated in place), as
        `jax.jit`'s `donate_argnums` does for arguments; for any value (arrays,
        tuples, `StateDict`s, optimiser states, keys, stacked ensembles). The rule is
        `jax.jit`'s: a donated value is the call's, so an array taken from such a
        state before the call (`old = s.value`, a `values_of(...)` snapshot, the
        same array given to another state; for a key, `jax.random.key_data` of
        it) is deleted by it. Keep `jnp.copy(s.value)` of what must outlive the
        call; a thread reading such states takes turns with the calls, as writers
        do. Where donating would lose a value that eqstate holds or needs, a call
        does not donate, and warns once per function and reason naming the
        states: in a `scope` or `run` (their dictionary's values may be the
        world's), while `jax.debug_nans` or `jax.debug_infs` is on (JAX runs a
        failing call again with its inputs), and in every call of a function
        holding a callback that can raise (`eqx.error_if`, `jax.debug.callback`:
        a failed call must leave readable values). A value that is also another
        input of the call (another state's, an argument) is copied, and the copy
        donated. Inside another transform the outer `jit` donates, as in JAX.
    - `donate_argnums`: as in `jax.jit`; an argument holding handles (a model) has
        its arrays donated, and its states as `donate_states` says.
    - `state_shardings`: where state values go, as a `jax.sharding.Sharding` for all,
        `{filter: Sharding}`, or `(state, value) -> Sharding | None`: the compiled
        function constrains those states to their sharding on input, and their new
        values on output (on explicit mesh axes it moves them there with
        `jax.sharding.reshard`, which changes their type, as in JAX; a mesh may mix
        explicit and auto axes, and a dimension split over axes of both kinds
        comes out split over its explicit axes first). A sharding
        whose PartitionSpec has more entries than a state's value has axes raises
        `ValueError` naming the state (an uneven split is legal, as in `jax.jit`).
        Written states
        not named here keep the sharding each of their leaves had when the function
        was first called with them (not applied to a leaf of fewer axes than it
        splits: a value of another rank), also when that call was inside another
        transform (`grad`, `scan`, an outer `jit`; call `clear_cache()` after
        re-sharding them): the sharding of their value in the context that holds it
        for that call (the world, or the dictionary of an `eqstate.scope` or
        `eqstate.run`). Where that value is itself traced (`eqstate.run` inside
        `jax.jit`), the new value is left unconstrained until a call sees a concrete
        one. Inside `shard_map`, where each device holds its shard, neither applies.
    - `in_shardings`, `out_shardings`, `keep_unused`, `device`, `backend`, `inline`,
        `compiler_options`: as in `jax.jit`, for the arguments and the output of
        `fun`.

    **Returns:**

    A [`eqstate.transform.JittedFunction`][] with the signature of `fun`.

    !!! Note "Failures"

        A call that raises (while tracing, or when XLA refuses to run it: a shape
        error, most out-of-memory errors) writes nothing: every state keeps its
        value. With `donate_states`, though, XLA may refuse a call for want of
        memory after it took the donated buffers (the CPU does; a TPU keeps them):
        those values are lost, and the error names their states. Restore them (e.g. from a
        checkpoint), or leave donation off for a call that may not fit. A call
        does not wait for its result, so a failure that XLA reports only while the
        computation runs (on some platforms, a callback raising) surfaces when a
        new value is first used, and the states then hold those failed values:
        eqstate cannot undo that without blocking on every call;
        `jax.block_until_ready(es.values_of(model))` at a checkpoint surfaces such
        failures.

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        count = es.ShortTermState(jnp.array(0))

        @es.transform.jit
        def step(x):
            count.value = count.value + 1
            return x * 2

        step(1.0)
        step(2.0)
        assert count.value == 2
        ```
    """
    options: dict[str, Any] = dict(
        static_argnums=static_argnums,
        static_argnames=static_argnames,
        donate_states=donate_states,
        donate_argnums=donate_argnums,
        in_shardings=in_shardings,
        out_shardings=out_shardings,
        state_shardings=state_shardings,
        keep_unused=keep_unused,
        device=device,
        backend=backend,
        inline=inline,
        compiler_options=compiler_options,
    )
    _check_like_jax(fun, options)
    sf = StatefulFunction(
        fun,
        static_argnums=static_argnums,
        static_argnames=static_argnames,
        state_returns="write",
        cache_type="jit",
    )
    jitted = JittedFunction(
        fun,
        sf,
        donate_states=donate_states,
        jit_kwargs=_jax_jit_options(options),
        state_shardings=state_shardings,
    )
    calls_through(sf, jitted)
    return jitted
