"""shard_map: `jax.shard_map` over a function that uses states."""

import functools as ft
from collections.abc import Callable, Mapping, Sequence
from typing import Any, overload, ParamSpec, TypeVar

import jax
import jax.tree_util as jtu
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .. import _context, _jax_compat as compat
from .._clone import shared_by_members, why_shared
from .._custom_types import MISSING, Missing
from .._errors import BatchAxisError, StateNotFoundError, UnstableStatesError
from .._multi_process import device_put
from .._pretty_print import state_label
from .._run import run
from .._shapes import is_key, shape_dtype
from .._sharding import check_divisible, spec_rule
from .._state import draws_atomically, State
from .._state_dict import state_dict_of
from ._common import constrained_to, hide_static, show_static
from ._decorator import decorator_form
from ._discovery import Discovery, traces_for
from ._equinox_errors import with_equinox_errors
from ._function_traces import FunctionTraces
from ._view import View
from ._vmap import placeholder


compat.hide_from_tracebacks(__file__)

_P = ParamSpec("_P")
_T = TypeVar("_T")


def _axes_of(spec: PartitionSpec) -> set:
    axes: set = set()
    for entry in spec:
        if entry is not None:
            axes.update(entry if isinstance(entry, tuple) else (entry,))
    return axes


def _local(x: Any, spec: Any, mesh: Mesh) -> Any:
    """The per-device abstract value of `x`, split by `spec` on `mesh`."""
    if spec is None or not hasattr(x, "shape"):
        return x
    shape = list(x.shape)
    for dim, entry in enumerate(spec):
        if entry is None:
            continue
        for name in entry if isinstance(entry, tuple) else (entry,):
            shape[dim] //= mesh.shape[name]
    return shape_dtype(x, tuple(shape))


class _ShardView(View):
    """What the function sees of the calling frame inside `shard_map`: each state's
    value split by its PartitionSpec. Only used inside `jax.shard_map` (see
    `_inside_shard_map`)."""

    __slots__ = ("mesh", "specs")

    def __init__(self, parent: _context.Frame, specs: Callable, mesh: Mesh):
        super().__init__(parent)
        self.specs, self.mesh = specs, mesh

    def fetch(self, state):
        value = self.parent.fetch(state)
        spec = self.specs(state, value)
        check_divisible(state, value, self.mesh, spec)
        return self._shard(value, spec)

    def peek(self, state):
        value = self.parent.peek(state)
        if value is MISSING:
            return value
        return self._shard(value, self.specs(state, value))

    def _shard(self, value: Any, spec: PartitionSpec) -> Any:
        """A stand-in for one device's shard of `value`, typed as the body sees it:
        varying across devices along the mesh axes that `spec` splits it over (so
        that, e.g., a loop carry of it may take per-device values)."""
        axes = tuple(a for a in self.mesh.axis_names if a in _axes_of(spec))
        return jtu.tree_map(
            lambda x: compat.vary(placeholder(_local(x, spec, self.mesh)), axes), value
        )


def _state_spec_rule(state_specs: Any) -> Callable[[State, Any], PartitionSpec]:
    """`state_specs` as a function of `(state, value)`; unmatched states, and
    states shared by an ensemble's members (`shared_by_members`) unless a function
    splits them, are replicated."""
    _refuse_named_shared(state_specs)
    rule = spec_rule(PartitionSpec() if state_specs is None else state_specs)
    a_function_decides = callable(state_specs)

    def spec_of(state: State, value: Any) -> PartitionSpec:
        if shared_by_members(state) and not a_function_decides:
            # Shared by every lane of an ensemble, so one spec for all (`P("ens")`
            # for members stacked on axis 0) must not split it.
            return PartitionSpec()
        spec = rule(state, value)
        if spec is None:
            return PartitionSpec()
        if not isinstance(spec, PartitionSpec):
            raise TypeError(
                f"`state_specs` gives {state_label(state, value)} {spec!r}, but it "
                "takes one PartitionSpec per state, which splits every leaf of its "
                "value alike. Hold leaves that split differently in states of their "
                "own."
            )
        return spec

    return spec_of


def _refuse_named_shared(state_specs: Any) -> None:
    """Raises `ValueError` for a state shared by an ensemble's members (see
    `shared_by_members`) named as a key of `state_specs` with a spec that splits it:
    it is never split by a `PartitionSpec` or a filter."""
    if not isinstance(state_specs, Mapping):
        return
    for key, spec in state_specs.items():
        splits = spec is not None and any(axes is not None for axes in spec)
        if isinstance(key, State) and shared_by_members(key) and splits:
            raise ValueError(
                f"`state_specs` gives {state_label(key)} {spec!r}, but "
                f"{why_shared(key)}, so it is never split by a spec. Make it another "
                "kind of state if it holds one value per shard, or decide per state "
                "with a function `(state, value) -> PartitionSpec`."
            )


def _per_argument_specs(in_specs: Any, args: tuple, name: str) -> tuple:
    """One spec per argument: `in_specs` itself (a tuple or list), or its one
    PartitionSpec (or `None`) for every argument, as `jax.shard_map` takes it."""
    if not isinstance(in_specs, (tuple, list)):
        return (in_specs,) * len(args)
    if len(in_specs) != len(args):
        raise ValueError(
            f"`in_specs` of the `shard_map` of {name} has {len(in_specs)} entries, "
            f"but it is called with {len(args)} positional arguments: give one "
            "PartitionSpec (or pytree of them) per argument, or one PartitionSpec "
            "for all."
        )
    return tuple(in_specs)


def _placed(values: list, specs: list[PartitionSpec], mesh: Mesh) -> list:
    """`values` moved to their sharding on `mesh`: inside a trace, constrained to it
    (`jax.shard_map` takes a value split along explicit mesh axes only as its
    `in_specs` split it)."""
    if compat.in_manual_axes():  # Inside another `shard_map`: each device's shard.
        return list(values)
    if not compat.is_top_level():
        return [
            jtu.tree_map(ft.partial(constrained_to, sharding=NamedSharding(mesh, s)), v)
            for v, s in zip(values, specs)
        ]
    # Not `jax.device_put`: it cannot put a PRNG key (a random state's value) on
    # devices of other processes.
    return [device_put(v, NamedSharding(mesh, s)) for v, s in zip(values, specs)]


def _check_replicated_write(state: State, value: Any, spec: PartitionSpec) -> None:
    """Raises `BatchAxisError` if `value`, written to `state` inside `shard_map`,
    differs across devices along a mesh axis where `spec` keeps one copy."""
    varying = set().union(*(compat.varying_axes(x) for x in jtu.tree_leaves(value)))
    differs = varying - _axes_of(spec)
    if differs:
        keys = any(is_key(x) for x in jtu.tree_leaves(value))
        fix = (
            "Write a key that is the same on every device (split the state's own "
            "key, before folding in `jax.lax.axis_index`)"
            if keys
            else "Reduce it first (e.g. `jax.lax.pmean(value, axis)`)"
        )
        raise BatchAxisError(
            f"{state_label(state)} is written inside `shard_map` with a value that "
            f"differs across devices along mesh axes {sorted(differs)}, but its "
            f"PartitionSpec {spec} keeps one copy there. {fix}, or split it with "
            "`state_specs`."
        )


_UNSTABLE = (
    "{name} touched other states when run on each device inside `shard_map` than "
    "when it was traced to find its states, just before: its Python code changed "
    "between the two (it reads a flag or a counter that changes, or its states depend "
    "on the values of its arguments). `shard_map` runs the function's Python twice "
    "per call; make both runs read and write the same states."
)


def _refuse_other_writes(
    name: str, states_in: Any, states_out: Any, written: Sequence[State]
) -> None:
    """Raises `UnstableStatesError` if the run on each device wrote a state that the
    trace finding the states did not (its new value would be dropped), or created
    one. A state it did not write keeps its very input value."""
    known = set(written)
    for state, value in states_out.items():
        if state in known:
            continue
        if state not in states_in or value is not states_in[state]:
            raise UnstableStatesError(_UNSTABLE.format(name=name))


def _per_device_body(
    fun: Callable,
    name: str,
    states: Sequence[State],
    written: Sequence[State],
    state_spec: dict[State, PartitionSpec],
    check_vma: bool,
) -> Callable:
    """What each device runs: `fun` on its shard of the states and arguments,
    returning its output and the new values of the `written` states."""

    def body(state_values, *args):
        # `fun` runs again here rather than its jaxpr being evaluated: shard_map
        # types every value as varying or not across devices, and only tracing
        # under it inserts the conversions that typing needs.
        states_in = state_dict_of(dict(zip(states, state_values)))
        try:
            states_out, out = run(fun, states_in, *show_static(args))
        except StateNotFoundError as exc:
            # Every state it read when its states were found is in `states_in`.
            raise UnstableStatesError(_UNSTABLE.format(name=name)) from exc
        _refuse_other_writes(name, states_in, states_out, written)
        new = [states_out[s] for s in written]
        if check_vma:
            for state, value in zip(written, new):
                _check_replicated_write(state, value, state_spec[state])
        return hide_static(out), new

    return body


def _inside_shard_map(
    mesh: Mesh, specs: tuple, check_vma: bool
) -> Callable[[Callable[..., None], tuple], None]:
    """A `trace_in` for `Discovery`: it traces inside `jax.shard_map` itself, under
    `jax.eval_shape` (nothing runs), so that the function is traced where its mesh
    axes are manual and its values are typed as varying across devices or not, as in
    the body: `jax.lax.pcast`, collectives and loop carries trace as they will there."""

    def trace_in(discover: Callable[..., None], args: tuple) -> None:
        def body(*local_args: Any) -> tuple:
            discover(*show_static(local_args))
            return ()

        jax.eval_shape(
            jax.shard_map(
                body, mesh=mesh, in_specs=specs, out_specs=(), check_vma=check_vma
            ),
            *args,
        )

    return trace_in


@draws_atomically
def _call_sharded(
    fun: Callable,
    traces: FunctionTraces,
    args: tuple,
    *,
    mesh: Mesh,
    in_specs: Any,
    out_specs: Any,
    spec_of: Callable[[State, Any], PartitionSpec],
    check_vma: bool,
) -> Any:
    """One call of a `shard_map` function: find its states on one device's shard,
    then run it under `jax.shard_map` and write back the states it wrote."""
    specs = _per_argument_specs(in_specs, args, traces.name)
    args = hide_static(args)  # a model's handles ride in the tree structure
    traced = Discovery(
        fun,
        args,
        # Not a trace kept from an earlier call in the same enclosing trace: the
        # function's Python runs again on each device (see `_per_device_body`), and
        # may have changed since (a flag it reads), so its states are found again.
        traces=traces.emptied(),
        discover_in=_ShardView(_context.current_frame(), spec_of, mesh),
        trace_in=_inside_shard_map(mesh, specs, check_vma),
    )
    traced.refuse_new_states("`shard_map`")
    states, written = traced.states, traced.written
    state_spec = {s: spec_of(s, v) for s, v in zip(states, traced.values)}
    values = _placed(traced.values, [state_spec[s] for s in states], mesh)
    sharded = jax.shard_map(
        _per_device_body(fun, traces.name, states, written, state_spec, check_vma),
        mesh=mesh,
        in_specs=([state_spec[s] for s in states], *specs),
        out_specs=(out_specs, [state_spec[s] for s in written]),
        check_vma=check_vma,
    )
    out, new_values = with_equinox_errors(
        lambda values, args: sharded(values, *args), values, args
    )
    traced.commit(dict(zip(written, new_values)))
    return show_static(out)


# A state's spec: one for all, by handle, or a function `(state, value) -> spec`.
_StateSpecs = (
    PartitionSpec
    | Mapping[Any, PartitionSpec]
    | Callable[[State, Any], PartitionSpec | None]
    | None
)


@overload
def shard_map(
    fun: Callable[_P, _T],
    *,
    mesh: Mesh,
    in_specs: Any,
    out_specs: Any,
    state_specs: _StateSpecs = None,
    check_vma: bool = True,
) -> Callable[_P, _T]: ...


@overload
def shard_map(
    fun: Missing = MISSING,
    *,
    mesh: Mesh,
    in_specs: Any,
    out_specs: Any,
    state_specs: _StateSpecs = None,
    check_vma: bool = True,
) -> Callable[[Callable[_P, _T]], Callable[_P, _T]]: ...


@decorator_form
def shard_map(
    fun: Any = MISSING,
    *,
    mesh: Mesh,
    in_specs: Any,
    out_specs: Any,
    state_specs: _StateSpecs = None,
    check_vma: bool = True,
) -> Any:
    """Like `jax.shard_map`, for a function that reads and writes states: each device
    runs `fun` on its shard of the arguments and of the states.

    **Arguments:**

    - `fun`: the function. If omitted, `shard_map` returns a decorator.
    - `mesh`, `in_specs`, `out_specs`, `check_vma`: as in `jax.shard_map`: `in_specs`
        is a tuple with one entry per positional argument, or one PartitionSpec for
        all. The function takes positional arguments only.
    - `state_specs`: how each state is split across the mesh: a `PartitionSpec` for
        all, `{filter: PartitionSpec}` (first match), or `(state, value) ->
        PartitionSpec | None`. Unmatched states are replicated (`PartitionSpec()`),
        and so are [`eqstate.NonBatchState`][]s and the states `vmap_new_states`
        replicated (tagged [`eqstate.transform.INIT_NO_BATCHING`][] or selected by
        its `state_to_exclude`), which a `PartitionSpec` or a filter never splits
        (as `vmap` never maps them); only a function can split one.
        State values are moved to their sharding before the call (inside `jit`,
        constrained to it), and written states come back with it.

    **Returns:**

    A function with the signature of `fun`. (`fun` is traced twice per call, both
    times inside `jax.shard_map`: once to find its states, once to run; also when
    called several times inside one enclosing trace, so each call sees the states its
    Python uses then.)

    **Raises:**

    - `ValueError` naming the state if a replicated state is written with a value
        that differs across devices (reduce it first, e.g. with `jax.lax.pmean`),
        also under an eqstate `cond`, `switch` or `while_loop` whose predicate
        differs across devices.
        Only with `check_vma=True` (the default): with `check_vma=False` JAX does
        not record which values differ across devices, so nothing is checked, and
        such a state then holds a different value on each device under a replicated
        sharding, as `jax.shard_map` returns it: what later reads see is undefined
        (each device computes with its own copy). Reduce it first.
    - `ValueError` if `state_specs` maps the handle of a `NonBatchState`, or of a
        state `vmap_new_states` replicated, to a spec that splits it.
    - `ValueError` if `in_specs` has not one entry per positional argument, or if a
        `PartitionSpec` (of `in_specs` or `state_specs`) names an axis not in `mesh`.
    - `TypeError` if called with keyword arguments.
    - `UnstableStatesError` if the two traces of one call read or write different
        states (the function's Python changed between them).

    !!! Example

        ```python
        import eqstate as es
        import jax
        import jax.numpy as jnp
        from jax.sharding import AxisType, PartitionSpec as P

        n = len(jax.devices())
        mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
        seen = es.State(jnp.array(0.0), name="seen")

        @es.transform.shard_map(mesh=mesh, in_specs=(P("data"),), out_specs=P("data"))
        def double(x):
            seen.value = seen.value + jax.lax.psum(x.sum(), "data")
            return 2 * x

        y = double(jnp.arange(2.0 * n))
        assert (y == 2 * jnp.arange(2.0 * n)).all() and seen.value == jnp.arange(2.0 * n).sum()
        ```
    """
    spec_of = _state_spec_rule(state_specs)
    traces = traces_for(fun, getattr(fun, "__name__", None))

    @ft.wraps(fun)
    def sharded(*args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(
                f"The `shard_map` of {traces.name} takes positional arguments only "
                f"(as `jax.shard_map`), one per entry of `in_specs`; got keyword "
                f"arguments {sorted(kwargs)}. Pass them by position."
            )
        return _call_sharded(
            fun, traces, args, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
            spec_of=spec_of, check_vma=check_vma,
        )  # fmt: skip

    return sharded
