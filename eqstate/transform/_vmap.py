"""vmap: `jax.vmap` over a function that uses pre-existing states."""

import dataclasses
import functools as ft
import operator
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import (
    Any,
    overload,
    ParamSpec,
    SupportsIndex,
    TypedDict,
    TypeVar,
    Unpack,
)

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.sharding import PartitionSpec

from .. import _context, _jax_compat as compat
from .._clone import shared_by_members, stacked_by_its_last_build, why_shared
from .._custom_types import AxisSpec, Filter, MISSING, Missing
from .._errors import BatchAxisError, StateValueError
from .._filters import to_predicate
from .._pretty_print import state_label, value_summary
from .._shapes import is_key, key_impl_of, shape_dtype
from .._state import draws_atomically, RandomState, split_and_advance, State
from .._state_dict import StateDict
from ._decorator import decorator_form
from ._discovery import Discovery, kept_or_fresh, traces_for
from ._equinox_errors import EQUINOX_ERRORS
from ._function_traces import FunctionTraces
from ._view import View


compat.hide_from_tracebacks(__file__)

_P = ParamSpec("_P")
_T = TypeVar("_T")


_UNDECLARED_BATCHED_WRITE = (
    "{label} is written inside `vmap` with a batched value, one that may differ "
    "across the mapped axis (it depends on a mapped argument or state, or is chosen "
    "by a `cond` or `while_loop` whose predicate does), but it is not declared in "
    "`in_states`, so it holds one value for every lane and a batched write cannot "
    "be stored without losing lanes. Declare it to give it a batch axis (its value "
    "must then have one): `vmap(f, in_states={{0: state}})`, or write a value that "
    "does not depend on the mapped arguments."
)

_NOTHING_MAPPED = (
    "Cannot infer the size of the mapped axis: no argument is mapped, and the "
    "function reads or writes none of the states declared in `in_states` (a declared "
    "state is mapped only if the function uses it). Pass `axis_size`."
)


def per_argument_axes(in_axes: AxisSpec, n_args: int) -> tuple:
    """`in_axes` as one (prefix) entry per positional argument, as `jax.vmap` reads it."""
    _check_axis_leaves(in_axes)
    if in_axes is None or isinstance(in_axes, int):
        return (in_axes,) * n_args
    if isinstance(in_axes, (list, tuple)):
        if len(in_axes) != n_args:
            raise ValueError(
                f"`in_axes` has {len(in_axes)} entries, but the function was called "
                f"with {n_args} positional argument(s). Give one entry per argument, "
                "or a single int or None for all of them."
            )
        return tuple(in_axes)
    raise TypeError(
        f"`in_axes` must be an int, None, or a tuple/list with one entry per "
        f"argument, got {in_axes!r}."
    )


def _check_axis_leaves(in_axes: AxisSpec) -> None:
    """Raises `TypeError` unless every leaf of `in_axes` is an int (`None` entries are
    empty subtrees)."""
    for leaf in jtu.tree_leaves(in_axes):
        if not isinstance(leaf, int):
            raise TypeError(
                f"`in_axes` holds {leaf!r}, but it takes ints and None, alone, one per "
                "argument or as a pytree prefix of an argument, as in `jax.vmap`. "
                "`eqx.filter_vmap`'s axes (`eqx.if_array`, callables) are not "
                "supported: only the arrays of a mapped argument are mapped anyway, "
                "so write `eqx.if_array(0)` as `0`."
            )


def checked_axis_size(axis_size: Any) -> int | None:
    """`axis_size` as a Python int (any integer `operator.index` takes, as
    `jax.vmap` does), or `None`. Raises `ValueError` unless it is `None` or a
    positive integer (not a `bool`, which JAX refuses later, as a shape)."""
    if axis_size is None:
        return None
    try:
        size = operator.index(axis_size)
    except TypeError:
        size = None
    if size is None or isinstance(axis_size, bool) or size <= 0:
        raise ValueError(f"`axis_size` must be a positive integer, got {axis_size!r}.")
    return size


def axis_size_of(
    axes: tuple,
    args: tuple,
    axis_size: int | None,
    extra: dict[str, int] | None = None,
    *,
    kwargs: dict | None = None,
    required: bool = True,
) -> Any:
    """The size of the mapped axis, shared by `axis_size` (if given, already checked,
    or inferred: it may be 0), every mapped argument (the arrays of `kwargs` along
    axis 0), and every entry of `extra` (e.g. mapped states)."""
    sizes: dict[str, int] = {} if axis_size is None else {"axis_size": axis_size}
    sizes.update(extra or {})
    for axis, subtree, where in _mapped_parts(axes, args, kwargs):
        sizes.update(_sizes_along(axis, subtree, where))
    return _the_one_size(sizes, required)


def _mapped_parts(
    axes: tuple, args: tuple, kwargs: dict | None = None
) -> Iterator[tuple[int, Any, str]]:
    """`(axis, subtree, where)` for each part of a call's arguments that `vmap` maps:
    those the prefixes `axes` map (see `mapped_subtrees`), and every keyword argument,
    along axis 0, as in `jax.vmap`; `where` names the argument."""
    for i, (axis, arg) in enumerate(zip(axes, args)):
        for a, subtree in mapped_subtrees(axis, arg):
            yield a, subtree, f"argument {i}"
    for name, arg in (kwargs or {}).items():
        yield 0, arg, f"keyword argument {name!r}"


def _sizes_along(axis: int, subtree: Any, where: str) -> dict[str, int]:
    """The length of axis `axis` of every array in `subtree`, by its path."""
    sizes: dict[str, int] = {}
    for path, leaf in jtu.tree_leaves_with_path(subtree):
        shape = getattr(leaf, "shape", None)
        if shape is None:
            continue
        if not -len(shape) <= axis < len(shape):
            keyword = where.startswith("keyword")
            raise ValueError(
                f"`{'vmap' if keyword else 'in_axes'}` maps {where}"
                f"{jtu.keystr(path)} along axis {axis}, but it has shape "
                f"{tuple(shape)}, without that axis. Give it the mapped axis, or "
                + (
                    "pass it positionally with `None` as its entry of `in_axes` "
                    "(keyword arguments are mapped along axis 0, as in `jax.vmap`), "
                    "or close over it."
                    if keyword
                    else "broadcast it to every lane with `None` as its entry of "
                    "`in_axes`."
                )
            )
        sizes[f"{where}{jtu.keystr(path)}"] = shape[axis]
    return sizes


def _refuse_mapped_numbers(axes: tuple, args: tuple) -> None:
    """Raises `ValueError`, as `jax.vmap` does, if `in_axes` maps a Python number
    given as an argument or in a list, tuple or dict (a field of a Module, such as a
    layer's `inference` flag, reaches every lane as it is)."""
    for a, subtree, where in _mapped_parts(axes, args):
        for path, leaf in jtu.tree_leaves_with_path(subtree, is_leaf=_is_module):
            if isinstance(leaf, (bool, int, float, complex)):
                raise ValueError(
                    f"`in_axes` maps {where}{jtu.keystr(path)} along axis {a}, but it "
                    f"is a Python {type(leaf).__name__} ({leaf!r}), which has no axes "
                    "(as in `jax.vmap`). Broadcast it to every lane with `None` as its "
                    "entry of `in_axes` (e.g. `in_axes=(0, None)`), or pass an array "
                    "holding one value per lane."
                )


def _is_module(x: Any) -> bool:
    return isinstance(x, eqx.Module)


def mapped_subtrees(axis: Any, arg: Any) -> list[tuple[int, Any]]:
    """`(axis, subtree)` for each part of `arg` that the prefix `axis` maps."""
    axes, treedef = jtu.tree_flatten(axis, is_leaf=lambda x: x is None)
    return [
        (a, sub) for a, sub in zip(axes, treedef.flatten_up_to(arg)) if a is not None
    ]


def _the_one_size(sizes: dict[str, int], required: bool) -> int | None:
    """The size all of `sizes` agree on (`None` if there are none and it is not
    `required`)."""
    if not sizes:
        if not required:
            return None
        raise ValueError(
            "Cannot infer the size of the mapped axis: no argument (or state) is mapped. "
            "Pass `axis_size`."
        )
    if len(set(sizes.values())) > 1:
        shown = ", ".join(f"{k}: {v}" for k, v in sizes.items())
        raise ValueError(f"The mapped axis has inconsistent sizes ({shown}).")
    return next(iter(sizes.values()))


def arrays_only(axes: AxisSpec) -> AxisSpec:
    """Makes every int of an axis spec apply to array leaves only (`eqx.if_array`), so
    that non-array leaves, such as handles, pass through `eqx.filter_vmap` as they
    are."""
    return jtu.tree_map(
        lambda a: eqx.if_array(a) if isinstance(a, int) else a,
        axes,
        is_leaf=lambda x: x is None,
    )


def parse_state_axes(spec: Any, what: str) -> list[tuple[int, Callable]]:
    """`{axis: filter}` (or a bare filter, for axis 0) as `(axis, predicate)` pairs."""
    if spec is None:
        return []
    if isinstance(spec, StateDict):
        spec = spec.states
    if isinstance(spec, dict) and all(_is_axis(k) for k in spec):
        pairs = []
        for axis, filter in spec.items():
            if isinstance(filter, StateDict):
                filter = filter.states
            pairs.append((axis, to_predicate(filter)))
        return pairs
    if isinstance(spec, dict):
        raise TypeError(
            f"`{what}` must map integer axes to filters, like `{{0: eqstate.ParamState}}`, "
            f"got keys {list(spec)!r}."
        )
    return [(0, to_predicate(spec))]


def _is_axis(key: Any) -> bool:
    return isinstance(key, int) and not isinstance(key, bool)


def _refuse_named_shared(in_states: Any) -> None:
    """Raises `ValueError` for a state shared by the members of an ensemble (see
    `shared_by_members`) given alone as a filter of `in_states`: it is never mapped,
    so asking for it is a mistake (one selected among others, by a filter or with the
    states of an ensemble, is left unmapped)."""
    specs = in_states.values() if isinstance(in_states, dict) else [in_states]
    for spec in specs:
        if isinstance(spec, State) and shared_by_members(spec):
            raise ValueError(
                f"`in_states` names {state_label(spec)}, but {why_shared(spec)}, so "
                "it is never given a batch axis: every lane sees its whole value. "
                "Leave it out of `in_states`."
            )


def axis_of(state: State, pairs: list[tuple[int, Callable]]) -> int | None:
    if shared_by_members(state):
        return None  # Never given a batch axis, even where a filter selects it.
    return next((axis for axis, p in pairs if p((), state)), None)


class _LaneView(View):
    """What the function sees of the calling frame inside `vmap`: mapped states lose
    their batch axis. The states it was asked for are added to `fetched`."""

    __slots__ = ("axes", "fetched")

    def __init__(
        self,
        parent: _context.Frame,
        axes: Callable[[State], int | None],
        fetched: set[State],
    ):
        super().__init__(parent)
        self.axes = axes
        self.fetched = fetched

    def fetch(self, state):
        self.fetched.add(state)
        value = self.parent.fetch(state)
        axis = self.axes(state)
        if axis is None:
            return value
        return jtu.tree_map(lambda x: _lane_of(state, x, axis), value)

    def peek(self, state):
        value = self.parent.peek(state)
        axis = self.axes(state)
        if value is MISSING or axis is None:
            return value
        return jtu.tree_map(lambda x: _lane_struct(state, x, axis), value)


def _lane_struct(state: State, x: Any, axis: int) -> jax.ShapeDtypeStruct:
    shape = jnp.shape(x)
    if not -len(shape) <= axis < len(shape):
        raise ValueError(
            f"`in_states` maps {state_label(state, x)} along axis {axis}, which it does "
            "not have. A mapped state's value needs the batch axis."
        )
    return shape_dtype(x, _without_axis(shape, axis))


def _without_axis(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    axis %= len(shape)
    return shape[:axis] + shape[axis + 1 :]


def _lane_of(state: State, x: Any, axis: int) -> Any:
    lane = _lane_struct(state, x, axis)
    # Single-pass tracing only needs the type; the two-pass fallback runs the function
    # on its first pass, so it needs a value.
    return lane if compat.single_pass_enabled() else placeholder(lane)


def with_impl_of(keys: Any, key: Any) -> Any:
    """`key` (of any shape), or keys of the same shape drawn from it in the PRNG
    implementation of `keys` if that is another."""
    if not isinstance(keys, jax.ShapeDtypeStruct):
        # Most states keep the default implementation: no need to trace `key_impl_of`.
        if jax.random.key_impl(keys) == jax.random.key_impl(key):
            return key
    impl, data = key_impl_of(keys)
    if impl == jax.random.key_impl(key):
        return key
    data_shape = data.shape[len(keys.shape) :]

    def data_of(one: Any) -> Any:
        return jax.random.bits(one, data_shape, jnp.uint32)

    bits = jax.vmap(data_of)(key.reshape(-1)).reshape(key.shape + data_shape)
    return jax.random.wrap_key_data(bits, impl=impl)


def placeholder(struct: jax.ShapeDtypeStruct) -> jax.Array:
    """An array of type `struct`, weak type included (zeros, or keys made from
    zeros)."""
    if is_key(struct):
        impl, data = key_impl_of(struct)
        return jax.random.wrap_key_data(jnp.zeros(data.shape, data.dtype), impl=impl)
    if struct.weak_type:
        # A weak type comes only from a Python scalar: broadcasting one keeps it.
        for zero in (0.0, 0, 0j):
            weak = jnp.asarray(zero)
            if weak.dtype == struct.dtype:
                return jnp.broadcast_to(weak, struct.shape)
    return jnp.zeros(struct.shape, struct.dtype)


class VmapOptions(TypedDict, total=False):
    in_axes: AxisSpec
    out_axes: AxisSpec
    axis_name: Hashable | None
    axis_size: SupportsIndex | None
    spmd_axis_name: Hashable | tuple[Hashable, ...] | None
    in_states: Filter | dict[int, Filter] | None
    out_states: Filter | dict[int, Filter] | None


# The mapped function keeps the signature and output type of `fun`: arrays gain or
# lose an axis, which their types do not show (as in `jax.vmap`).
@overload
def vmap(fun: Callable[_P, _T], **options: Unpack[VmapOptions]) -> Callable[_P, _T]: ...


@overload
def vmap(
    fun: Missing = MISSING, **options: Unpack[VmapOptions]
) -> Callable[[Callable[_P, _T]], Callable[_P, _T]]: ...


@decorator_form
def vmap(
    fun: Any = MISSING,
    *,
    in_axes: AxisSpec = 0,
    out_axes: AxisSpec = 0,
    axis_name: Hashable | None = None,
    axis_size: SupportsIndex | None = None,
    spmd_axis_name: Hashable | tuple[Hashable, ...] | None = None,
    in_states: Filter | dict[int, Filter] | None = None,
    out_states: Filter | dict[int, Filter] | None = None,
) -> Any:
    """Vectorises `fun` over its arguments and over the pre-existing states declared
    in `in_states`, like `jax.vmap`.

    Declared states are mapped: their values have a batch axis, each lane sees one
    slice, and their new values are stacked back. Every other state is broadcast: all
    lanes see the same value, and writing it with a value that differs across lanes
    raises [`eqstate.BatchAxisError`][] naming it. Random states read inside are split
    per lane (so every lane draws different numbers) and their outer key advances
    once; one holding a batch of keys must be declared to be drawn from (each lane
    then draws from its own key), else the draw raises `BatchAxisError`. States
    cannot be created inside `vmap`: use [`eqstate.transform.vmap_new_states`][].

    **Arguments:**

    - `fun`: the function to vectorise. If omitted, `vmap` returns a decorator.
    - `in_axes`, `out_axes`, `axis_name`, `axis_size`, `spmd_axis_name`: as in
        `jax.vmap` (the arrays in keyword arguments of the call are mapped along axis 0).
        A Python number that `in_axes` maps raises `ValueError`, as in `jax.vmap`,
        except in a field of an `eqx.Module` (a layer's `inference` flag), which
        reaches every lane as it is. Python scalars whose axis is `None` reach `fun`
        as they are, as in
        `jax.vmap` (also inside an argument whose other leaves are mapped, e.g.
        `in_axes=({"x": 0, "n": None},)`), and so do those in keyword arguments:
        `range(n)` and `if flag:` work on them, and each new value traces `fun`
        again.
    - `in_states`: the states to map, as `{axis: filter}` (a bare filter means axis
        0); filters as in [`eqstate.filters`][], e.g. `{0: ensemble_states}`. Only
        the matching states the function reads or writes are mapped (and give the
        axis size): with no mapped argument and none of them used, pass `axis_size`.
        [`eqstate.NonBatchState`][]s, and the states `vmap_new_states` replicated
        (tagged [`eqstate.transform.INIT_NO_BATCHING`][] or selected by its
        `state_to_exclude`), are never mapped, even where a filter selects them
        (`es.states_of(ensemble)`): every lane sees their whole value, as every
        member of the ensemble shares it. One named alone (`in_states={0: shared}`)
        raises `ValueError`. `in_axes` maps the arrays of an argument, never the
        states its handles name: an ensemble passed with `in_axes=0` whose states,
        stacked by `vmap_new_states`, `in_states` leaves out raises `ValueError`
        (every lane would see every member's value).
    - `out_states`: the axis of mapped states in the output, as `{axis: filter}`;
        by default their input axis. A state must keep its shape.

    **Returns:**

    A function with the signature of `fun`.

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        w = es.ParamState(jnp.arange(6.0).reshape(3, 2))  # 3 ensemble members
        scale = es.State(jnp.array(10.0))                 # shared

        @es.transform.vmap(in_states={0: w})
        def predict(x):
            return scale.value * (w.value @ x)

        assert predict(jnp.ones((3, 2))).shape == (3,)
        ```
    """
    axis_size = checked_axis_size(axis_size)
    _refuse_named_shared(in_states)
    mapped_axis = ft.partial(axis_of, pairs=parse_state_axes(in_states, "in_states"))
    out_pairs = parse_state_axes(out_states, "out_states")
    traces_of = _traces_by_size(fun, axis_name)

    @ft.wraps(fun)
    @draws_atomically
    def vmapped(*args: Any, **kwargs: Any) -> Any:
        axes = per_argument_axes(in_axes, len(args))
        traces_of_size = ft.partial(traces_of, axes=axes)
        fetched: set[State] = set()
        try:
            traced = _discover_lane(
                fun, traces_of_size, args, kwargs, axes, mapped_axis, fetched,
                axis_size=axis_size, axis_name=axis_name,
            )  # fmt: skip
        except Exception:
            # Likely the cause, if there is one: a lane saw a whole stacked value
            # (of a state it read before it failed).
            size = axis_size_of(axes, args, axis_size, kwargs=kwargs, required=False)
            peek = _context.current_frame().peek
            read = lambda s: peek(s) if s in fetched else MISSING  # noqa: E731
            _refuse_stacked_handles_left_whole(
                axes, args, kwargs, read, mapped_axis, size
            )
            raise
        return _call_vmapped(
            traced, args, kwargs, axes, mapped_axis, out_pairs,
            out_axes=out_axes, axis_name=axis_name, axis_size=axis_size,
            spmd_axis_name=spmd_axis_name,
        )  # fmt: skip

    return vmapped


def _traces_by_size(
    fun: Callable, axis_name: Hashable | None
) -> Callable[..., FunctionTraces]:
    """The discovery traces of `fun` for a given axis size and mapped arguments. With
    `axis_name`, a trace needs the axis (and its size) in scope, so each size has its
    own; without, one serves all. Python scalars that `in_axes` does not map (and
    those in keyword arguments) are static, as `jax.vmap` passes them to the function
    as they are (see `ArgParser`)."""
    name = getattr(fun, "__name__", None)
    traces: dict[tuple, FunctionTraces] = {}

    def traces_of_size(size: int | None, axes: tuple) -> FunctionTraces:
        size = size if axis_name is not None else None
        key = (size, _hashable_axes(axes))
        if key not in traces:
            axis_env = None if size is None else [(axis_name, size)]
            traces[key] = traces_for(
                fun, name, axis_env=axis_env, transformed_axes=axes
            )
        return kept_or_fresh(traces[key])

    return traces_of_size


def _hashable_axes(axes: tuple) -> tuple:
    """`axes` (prefix trees of ints and `None`, perhaps holding dicts) as a key."""
    leaves, treedef = jtu.tree_flatten(axes, is_leaf=lambda x: x is None)
    return tuple(leaves), treedef


def _discover_lane(
    fun: Callable,
    traces_of_size: Callable[[int | None], FunctionTraces],
    args: tuple,
    kwargs: dict,
    axes: tuple,
    mapped_axis: Callable[[State], int | None],
    fetched: set[State],
    *,
    axis_size: int | None,
    axis_name: Hashable | None,
) -> Discovery:
    """`fun` traced on one lane of its arguments and mapped states, to find the
    states it uses (those it reads are added to `fetched` as it reads them)."""
    frame = _context.current_frame()
    # None if only states are mapped: their values give the size. Computed first,
    # as it checks that every mapped argument has its mapped axis.
    _refuse_mapped_numbers(axes, args)
    size = axis_size_of(axes, args, axis_size, kwargs=kwargs, required=False)
    lane_args = tuple(_lane_args(a, ax) for a, ax in zip(args, axes))
    lane_kwargs = {k: _lane_args(v, 0) for k, v in kwargs.items()}

    def discover(size: int | None) -> Discovery:
        return Discovery(
            fun,
            lane_args,
            lane_kwargs,
            traces=traces_of_size(size),
            discover_in=_LaneView(frame, mapped_axis, fetched),
        )

    if size is None and axis_name is not None:
        # Only states are mapped, so their values give the size: find them with
        # a stand-in size, then trace again with the real one.
        first = discover(1)
        size = _lane_count(axes, args, kwargs, None, _state_sizes(first, mapped_axis))
    traced = discover(size)
    traced.refuse_new_states("`vmap` (use `vmap_new_states` to create states)")
    return traced


def _lane_args(tree: Any, axis: Any) -> Any:
    """The per-lane abstract values of an argument mapped with `axis` (a prefix)."""

    def strip(a: Any, sub: Any) -> Any:
        if a is None:
            return sub

        def one(x: Any) -> Any:
            # Only arrays are mapped (`eqx.filter_vmap` below): a handle, or a Python
            # scalar such as a layer's `inference` flag, reaches every lane as it is.
            if not (eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)):
                return x
            return shape_dtype(x, _without_axis(x.shape, a))

        return jtu.tree_map(one, sub)

    return jtu.tree_map(strip, axis, tree, is_leaf=lambda x: x is None)


@dataclasses.dataclass(frozen=True)
class _StateRoles:
    """How `vmap` treats each state a call uses."""

    mapped: dict[State, int]  # declared in `in_states`, with their batch axis
    randoms: Sequence[State]  # broadcast random keys, split per lane
    mapped_written: Sequence[State]
    broadcast_written: Sequence[State]  # must be written alike in every lane


def _state_roles(
    traced: Discovery, values: dict[State, Any], mapped_axis: Callable
) -> _StateRoles:
    states = traced.states
    mapped = {s: a for s in states if (a := mapped_axis(s)) is not None}
    randoms = [
        s
        for s in states
        if isinstance(s, RandomState) and s not in mapped and jnp.ndim(values[s]) == 0
    ]
    written = set(traced.written)
    return _StateRoles(
        mapped=mapped,
        randoms=randoms,
        mapped_written=[s for s in states if s in mapped and s in written],
        broadcast_written=[
            s for s in states if s in written and s not in mapped and s not in randoms
        ],
    )


def split_like_mapped(lane_keys: Any, axes: tuple, args: tuple) -> Any:
    """`lane_keys` (mapped on axis 0), split over the mesh axes that the mapped axis
    of the first mapped array is split over in its type (explicit mesh axes), since
    `jax.vmap` needs every mapped axis split alike; as they are otherwise."""
    if not jtu.tree_leaves(lane_keys):
        return lane_keys  # no random state: no walk over the arguments
    found = _first_mapped_array(axes, args)
    if found is None:
        return lane_keys
    axis, leaf = found
    sharding = getattr(jax.typeof(leaf), "sharding", None)
    spec = getattr(sharding, "spec", ())
    axis %= len(leaf.shape)
    if sharding is None or axis >= len(spec) or spec[axis] is None:
        return lane_keys
    split = jax.sharding.NamedSharding(
        _mesh_of(leaf, sharding), PartitionSpec(spec[axis])
    )
    return jtu.tree_map(lambda k: jax.sharding.reshard(k, split), lane_keys)


def _first_mapped_array(axes: tuple, args: tuple) -> tuple[int, Any] | None:
    """`(axis, leaf)` of the first array leaf of `args` that `axes` maps, if any."""
    for axis_tree, arg in zip(axes, args):
        for axis, sub in mapped_subtrees(axis_tree, arg):
            for leaf in jtu.tree_leaves(sub):
                if hasattr(leaf, "shape"):
                    return axis, leaf
    return None


def _split_keys(keys: list, size: int) -> tuple[list, list]:
    """Each key's successor, and `size` keys split from it, one per lane."""
    outer_keys, lane_keys = [], []
    for key in keys:
        outer_key, keys_per_lane = split_and_advance(key, size)
        outer_keys.append(outer_key)
        lane_keys.append(keys_per_lane)
    return outer_keys, lane_keys


def _lane_function(
    traced: Discovery, values: dict[State, Any], roles: _StateRoles
) -> Callable:
    """One lane of the call: `traced` evaluated on the lane's slice of the mapped
    states, its random keys and its arguments."""

    def lane(mapped_values, keys, args, kwargs):
        current = dict(values)
        current.update(zip(roles.mapped, mapped_values))
        current.update(zip(roles.randoms, keys))
        out, updates, _ = traced.evaluate(
            [current[s] for s in traced.states], args, kwargs
        )
        for s in roles.broadcast_written:
            _check_written_alike(s, updates[s])
        return (
            out,
            [updates[s] for s in roles.mapped_written],
            [updates[s] for s in roles.broadcast_written],
            [written_alike(updates.get(s)) for s in roles.randoms],
            [written_per_lane(updates.get(s)) for s in roles.randoms],
        )

    return lane


def written_alike(value: Any) -> Any:
    """`value`, a random key written in a lane, if it is the same in every lane by
    construction (a reseed), else `None`."""
    if value is None or _differs_across_lanes(value):
        return None
    return value


def written_per_lane(value: Any) -> Any:
    """`value`, a random key written in a lane, if it may differ across lanes, else
    `None`. Keys advanced by draws from the lane's own key differ; a reseed under a
    batched predicate (`cond`, `while_loop`) is batched, yet equal in every lane."""
    if value is None or not _differs_across_lanes(value):
        return None
    return value


def key_after_lanes(alike: Any, per_lane: Any, outer_key: Any, size: int) -> Any:
    """The value a random state split per lane takes after the lanes ran: the key
    every lane wrote alike (`alike`, or the rows of `per_lane` if they are all
    equal, which only a reseed makes), else `outer_key`, its outer successor. One
    lane's key is its own, so `per_lane` is kept only from two lanes on."""
    if alike is not None:
        return alike
    if per_lane is None or size < 2:
        return outer_key
    per_lane = _unsplit(per_lane)
    data = jax.random.key_data(per_lane)
    return jax.lax.select(jnp.all(data == data[:1]), per_lane[0], outer_key)


def _unsplit(x: Any) -> Any:
    """`x`, replicated if its type splits it over explicit mesh axes (on which JAX
    refuses to index it without saying where the result goes)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    if sharding is None or all(entry is None for entry in sharding.spec):
        return x
    replicated = jax.sharding.NamedSharding(_mesh_of(x, sharding), PartitionSpec())
    return jax.sharding.reshard(x, replicated)


def _mesh_of(x: Any, type_sharding: Any) -> Any:
    """The mesh of `x`: its concrete sharding's (its devices), else its type's. A
    bare `PartitionSpec` would need a mesh set around the call."""
    return getattr(getattr(x, "sharding", None), "mesh", type_sharding.mesh)


def _differs_across_lanes(value: Any) -> bool:
    """Whether a value made in a lane holds a leaf batched by this `vmap`."""
    return any(compat.is_batched_here(x) for x in jtu.tree_leaves(value))


def _check_written_alike(state: State, value: Any) -> None:
    """Raises `BatchAxisError` if `value`, written to a broadcast state, differs
    across lanes."""
    if _differs_across_lanes(value):
        raise BatchAxisError(_UNDECLARED_BATCHED_WRITE.format(label=state_label(state)))


def _out_state_axes(roles: _StateRoles, out_pairs: list, values: dict) -> list[int]:
    """The output axis of each written mapped state: from `out_states`, else its
    input axis. Raises `ValueError` for an axis out of range for the state's value."""
    axes = []
    for state in roles.mapped_written:
        axis = axis_of(state, out_pairs)
        if axis is None:
            axis = roles.mapped[state]
        for leaf in jtu.tree_leaves(values[state]):
            if not -leaf.ndim <= axis < leaf.ndim:
                raise ValueError(
                    f"`out_states` puts the mapped axis of "
                    f"{state_label(state, values[state])} at {axis}, but its value "
                    f"has {leaf.ndim} axes: pass an axis from {-leaf.ndim} to "
                    f"{leaf.ndim - 1}."
                )
        axes.append(axis)
    return axes


def _call_vmapped(
    traced: Discovery,
    args: tuple,
    kwargs: dict,
    axes: tuple,
    mapped_axis: Callable[[State], int | None],
    out_pairs: list,
    *,
    out_axes: AxisSpec,
    axis_name: Hashable | None,
    axis_size: int | None,
    spmd_axis_name: Hashable | tuple[Hashable, ...] | None,
) -> Any:
    """`traced` run under `eqx.filter_vmap`, its states' new values written back."""
    values = dict(zip(traced.states, traced.values))
    roles = _state_roles(traced, values, mapped_axis)
    if traced.trace.has_custom_rules:
        _context.mapped_in_rules([*roles.mapped, *roles.randoms])
    sizes = _state_sizes(traced, mapped_axis)
    size = _lane_count(axes, args, kwargs, axis_size, sizes)
    used = lambda s: values.get(s, MISSING)  # noqa: E731
    _refuse_stacked_handles_left_whole(axes, args, kwargs, used, mapped_axis, size)
    outer_keys, lane_keys = _split_keys([values[s] for s in roles.randoms], size)
    lane_keys = split_like_mapped(lane_keys, axes, args)
    with EQUINOX_ERRORS:
        out, new_mapped, new_broadcast, alike, per_lane = eqx.filter_vmap(  # pyright: ignore[reportCallIssue]
            _lane_function(traced, values, roles),
            in_axes=(
                list(roles.mapped.values()),
                0,
                arrays_only(axes),
                eqx.if_array(0),
            ),
            out_axes=(
                arrays_only(out_axes),
                _out_state_axes(roles, out_pairs, values),
                None,
                None,
                0,
            ),
            axis_name=axis_name,
            axis_size=size,
            spmd_axis_name=spmd_axis_name,
        )([values[s] for s in roles.mapped], lane_keys, args, kwargs)
    updates = dict(zip(roles.broadcast_written, new_broadcast))
    for state, value in zip(roles.mapped_written, new_mapped):
        _check_same_shape(state, values[state], value)
        updates[state] = value
    for state, outer_key, same, keys in zip(roles.randoms, outer_keys, alike, per_lane):
        updates[state] = key_after_lanes(same, keys, outer_key, size)
    traced.commit(updates)
    return out


def _refuse_stacked_handles_left_whole(
    axes: tuple,
    args: tuple,
    kwargs: dict,
    value_of: Callable[[State], Any],
    mapped_axis: Callable[[State], int | None],
    size: int | None,
) -> None:
    """Raises `ValueError` for a handle in a mapped argument whose state has a value
    (`value_of`, else `MISSING`), that `in_states` does not map, that
    `vmap_new_states` stacked, and whose value has the mapped axis with `size`
    entries: an ensemble passed with `in_axes=0` as to `eqx.filter_vmap`, whose states
    would reach every lane whole. (A state made otherwise, or tied whole into every
    member, may be meant to be shared.)"""
    if size is None:
        return
    for axis, subtree, where in _mapped_parts(axes, args, kwargs):
        for path, leaf in jtu.tree_leaves_with_path(subtree):
            if (
                not isinstance(leaf, State)
                or mapped_axis(leaf) is not None
                or not stacked_by_its_last_build(leaf)
            ):
                continue
            value = value_of(leaf)
            if value is MISSING:
                continue
            leaves = jtu.tree_leaves(value)
            if leaves and all(_has_axis_of_size(x, axis, size) for x in leaves):
                raise ValueError(
                    _STACKED_HANDLE_LEFT_WHOLE.format(
                        where=f"{where}{jtu.keystr(path)}",
                        label=state_label(leaf, value),
                        axis=axis,
                        size=size,
                    )
                )


def _has_axis_of_size(x: Any, axis: int, size: int) -> bool:
    shape = jnp.shape(x)
    return -len(shape) <= axis < len(shape) and shape[axis] == size


_STACKED_HANDLE_LEFT_WHOLE = (
    "`vmap` maps {where}, which holds {label}: its value has an axis {axis} of size "
    "{size}, as if stacked like the mapped arrays, but a state is mapped only if "
    "`in_states` selects it, so every lane would see its whole value. Map it with "
    "`in_states` (e.g. `in_states={{{axis}: es.states_of(model)}}` for all of a "
    "model's states), or, if every lane must see it whole, make it a `NonBatchState` "
    "or pass it outside the mapped argument."
)


def _lane_count(
    axes: tuple,
    args: tuple,
    kwargs: dict,
    axis_size: int | None,
    state_sizes: dict[str, int],
) -> int:
    """The size of the mapped axis, from `axis_size`, the mapped arguments and the
    mapped states the function uses."""
    size = axis_size_of(
        axes, args, axis_size, state_sizes, kwargs=kwargs, required=False
    )
    if size is None:
        raise ValueError(_NOTHING_MAPPED)
    return size


def _state_sizes(traced: Discovery, mapped_axis: Callable) -> dict[str, int]:
    """The length of the mapped axis of every leaf of the mapped states, by state
    and path in its value."""
    sizes = {}
    for state, value in zip(traced.states, traced.values):
        axis = mapped_axis(state)
        if axis is not None:
            label = state_label(state, value)
            for path, leaf in jtu.tree_leaves_with_path(value):
                sizes[f"{label}{jtu.keystr(path)}"] = jnp.shape(leaf)[axis]
    return sizes


def _check_same_shape(state: State, old: Any, new: Any) -> None:
    if [x.shape for x in jtu.tree_leaves(old)] != [
        x.shape for x in jtu.tree_leaves(new)
    ]:
        raise StateValueError(
            f"`out_states` would change the shape of {state_label(state, old)} to "
            f"{value_summary(new)}. A mapped state keeps its shape: give it the same "
            "axis in `out_states` as in `in_states`."
        )
