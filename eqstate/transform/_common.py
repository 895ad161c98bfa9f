"""Helpers the transforms share: static leaves through JAX transforms, the states a
spec names, and PyTrees split into arrays and the rest."""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.core import Tracer

from .. import _jax_compat as compat
from .._filters import to_predicate
from .._shapes import shape_dtype
from .._state import is_state, State
from .._state_dict import StateDict
from .._write_checks import is_weak, to_array
from ._leaves import dynamic_mask, in_module, is_dynamic
from ._split_args import same_static, Static


compat.hide_from_tracebacks(__file__)


class ErrorsRaisedAs:
    """`with ErrorsRaisedAs(translate):` passes an exception raised in the block to
    `translate`, which raises a clearer one in its place, or returns to let it go
    on."""

    __slots__ = ("_translate",)

    def __init__(self, translate: Callable[[BaseException], None]):
        self._translate = translate

    def __enter__(self) -> None:
        pass

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: Any) -> None:
        if exc is not None:
            self._translate(exc)


def abstract(tree: Any) -> Any:
    """Replaces every array leaf with a `jax.ShapeDtypeStruct`."""

    return jtu.tree_map(lambda x: shape_dtype(x) if is_dynamic(x) else x, tree)


class _Static:
    """A leaf that is not traced (a state handle, a string, a module's `bool`
    field), held as a PyTree node with no children, so that it rides through JAX's
    transforms in the tree structure: `hide_static` / `show_static`."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __repr__(self) -> str:
        return f"Static({self.value!r})"


# The value rides in the tree structure wrapped in a `Static`: JAX compares the
# structures of `cond` branches with `==`, which must tell `True` from `1`.
jtu.register_pytree_node(
    _Static, lambda s: ((), Static(s.value)), lambda aux, _: _Static(aux.value)
)


def _is_static(x: Any) -> bool:
    return isinstance(x, _Static)


def hide_static(tree: Any) -> Any:
    """`tree` with every leaf that is not traced (see `is_traced`) wrapped so that JAX
    transforms (`jax.lax.scan` carries, `jax.lax.cond` operands, ...) take the tree as
    it is: only its arrays are leaves. `show_static` undoes it."""
    leaves, treedef = jtu.tree_flatten(tree)
    if all(is_dynamic(x) for x in leaves) and not any(in_module(tree)):
        return tree
    mask = dynamic_mask(tree)
    hidden = [x if traced else _Static(x) for x, traced in zip(leaves, mask)]
    return jtu.tree_unflatten(treedef, hidden)


def show_static(tree: Any) -> Any:
    """Undoes `hide_static`."""
    return jtu.tree_map(
        lambda x: x.value if _is_static(x) else x, tree, is_leaf=_is_static
    )


def changed_static(before: Any, after: Any) -> tuple[str, Any, Any] | None:
    """The first leaf hidden by `hide_static` in `before` or `after` (two hidden trees)
    that the other does not hold at its place: its path (as `jax.tree_util.keystr`
    writes it) and the two leaves, shown. `None` if there is none, or if the trees
    differ otherwise."""
    leaves_before, def_before = jtu.tree_flatten_with_path(before, is_leaf=_is_static)
    leaves_after, def_after = jtu.tree_flatten(after, is_leaf=_is_static)
    if def_before != def_after:
        return None
    for (path, a), b in zip(leaves_before, leaves_after):
        if not (_is_static(a) or _is_static(b)):
            continue
        if not (_is_static(a) and _is_static(b) and same_static(a.value, b.value)):
            return jtu.keystr(path), show_static(a), show_static(b)
    return None


def changed_type(
    before: Any, after: Any, *, weak_may_change: bool = False
) -> tuple[str | None, Any, Any] | None:
    """The first difference in type between two trees of arrays (or tracers, or
    `jax.ShapeDtypeStruct`s): `(None, structure before, structure after)` if their
    structures differ, else the path (as `jax.tree_util.keystr` writes it) of the
    first leaf whose shape or dtype differs, and the two leaves. With
    `weak_may_change`, a weakly typed leaf of `before` may come back in another dtype
    (JAX promotes a loop's weakly typed carry). `None` if there is none."""
    leaves_before, def_before = jtu.tree_flatten_with_path(before)
    leaves_after, def_after = jtu.tree_flatten(after)
    if def_before != def_after:
        return None, def_before, def_after
    for (path, a), b in zip(leaves_before, leaves_after):
        dtype_changed = jnp.result_type(a) != jnp.result_type(b)
        if jnp.shape(a) != jnp.shape(b) or (
            dtype_changed and not (weak_may_change and is_weak(a))
        ):
            return jtu.keystr(path), a, b
    return None


class _Traced:
    def __repr__(self) -> str:
        return "an array"


_TRACED = _Traced()


def static_skeleton(hidden: Any) -> Any:
    """A tree hidden by `hide_static`, each traced leaf replaced by one placeholder
    (shown as "an array"): what `changed_static` compares, holding no tracer."""
    return jtu.tree_map(
        lambda x: x if _is_static(x) else _TRACED, hidden, is_leaf=_is_static
    )


def merge_leading_axes(tree: Any) -> Any:
    """Every leaf of shape `(a, b, ...)` reshaped to `(a * b, ...)`: the outputs of a
    loop over chunks, as one loop would stack them (also when a trailing axis has
    size zero, which `reshape(-1, ...)` cannot infer)."""
    return jtu.tree_map(
        lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), tree
    )


def strong(tree: Any) -> Any:
    """Drops weak types, so that loop carries keep one type across iterations."""

    def to_strong(x):
        return jnp.asarray(x, dtype=x.dtype) if is_weak(x) else x

    return jtu.tree_map(to_strong, tree)


class WeakCarry:
    """Which leaves of the state values a loop or conditional carries are weakly typed.
    The carry drops weak types (`strong`), but a leaf weak on entry and in every value
    the bodies write to it is weak again where the bodies read it and at the end, as
    `jax.lax` keeps a weak carry: a state made from a Python scalar keeps promoting as
    one.

    **Arguments:**

    - `values`: the carried states' values on entry.
    """

    def __init__(self, values: Sequence[Any]):
        self.flags = [jtu.tree_map(is_weak, v) for v in values]

    def written(self, i: int, value: Any) -> None:
        """Records that a body writes `value` to the `i`-th carried state."""
        self.flags[i] = jtu.tree_map(
            lambda weak, x: weak and is_weak(x), self.flags[i], value
        )

    def restored(self, values: Sequence[Any]) -> list[Any]:
        """The carried states' `values`, weakly typed again where they stay weak."""

        def leaf(x: Any, weak: bool) -> Any:
            return compat.weakly_typed(x) if weak else x

        return [jtu.tree_map(leaf, v, f) for v, f in zip(values, self.flags)]


def select_states(
    spec: Any, candidates: Sequence[State]
) -> tuple[tuple[State, ...], bool]:
    """The states `spec` names among `candidates`.

    `spec` is either explicit (a handle, or a sequence or mapping of handles), or a
    filter. Returns the states and whether they were explicit (explicit states are
    kept, in their order, even if the function does not touch them).
    """
    if is_state(spec):
        return (spec,), True
    if isinstance(spec, StateDict):
        return spec.states, True
    if isinstance(spec, dict) and all(is_state(s) for s in spec.values()):
        return tuple(spec.values()), True
    if isinstance(spec, (tuple, list)) and spec and all(is_state(s) for s in spec):
        return tuple(dict.fromkeys(spec)), True
    predicate = to_predicate(spec)
    return tuple(s for s in candidates if predicate((), s)), False


def partition(tree: Any) -> tuple[list[Any], Callable[[Sequence[Any]], Any]]:
    """Splits a PyTree into its array leaves, which can cross a JAX transform, and a
    function that puts them back with the other leaves (handles, static values)."""
    leaves, treedef = jtu.tree_flatten(tree)
    # Traced as everywhere else (`is_traced`): a Module's Python scalars stay static.
    mask = dynamic_mask(tree)
    index = [i for i, traced in enumerate(mask) if traced]
    dynamic = [leaves[i] for i in index]
    # `rebuild` may outlive a trace (JAX caches the traced function), so it keeps only
    # the static leaves: the dynamic ones may be that trace's tracers.
    static = [None if traced else x for x, traced in zip(leaves, mask)]

    def rebuild(new_dynamic: Sequence[Any]) -> Any:
        full = list(static)
        for i, x in zip(index, new_dynamic):
            full[i] = x
        return jtu.tree_unflatten(treedef, full)

    return dynamic, rebuild


def predicate_axes(predicate: Any) -> frozenset:
    """Inside `jax.shard_map`, the mesh axes along which `predicate` (a conditional's
    index, a `while_loop`'s condition) differs between devices; else none."""
    if not compat.in_manual_axes():
        return frozenset()
    return compat.varying_axes(predicate)


def varying_along(tree: Any, axes: frozenset) -> Any:
    """`tree` (what a conditional or a `while_loop` gives: outputs, states' new values)
    with its arrays typed as varying along the mesh axes `axes` too (see
    `predicate_axes`). The branch taken, or the number of steps, may differ between
    devices there, and so may the values, which JAX types from the branches alone: a
    replicated state written there would be left differing between devices without
    the error that `check_vma` gives."""
    if not axes:
        return tree

    def varying(x: Any) -> Any:
        if not isinstance(x, (jax.Array, Tracer)):
            return x
        missing = tuple(a for a in axes if a not in compat.varying_axes(x))
        return compat.vary(x, missing)

    return jtu.tree_map(varying, tree)


def constrained_to(value: Any, sharding: jax.sharding.Sharding) -> Any:
    """`value` inside a trace, constrained to `sharding`: resharded along explicit mesh
    axes (whose splits are part of the type), constrained along the others."""
    mesh = getattr(sharding, "mesh", None)
    types = tuple(getattr(mesh, "axis_types", ()))
    explicit, auto = jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto
    if mesh is None or explicit not in types:
        return jax.lax.with_sharding_constraint(value, sharding)
    if auto not in types:
        # Explicit mesh axes put shardings in the types: `reshard` sets them.
        return jax.sharding.reshard(value, sharding)
    # A mesh of both kinds: `reshard` takes only the explicit axes, and
    # `with_sharding_constraint` only the others.
    kinds = dict(zip(mesh.axis_names, types))
    value = jax.sharding.reshard(value, _on_axes(sharding, kinds, explicit))
    return jax.lax.with_sharding_constraint(value, _on_axes(sharding, kinds, auto))


def _on_axes(sharding: Any, kinds: dict, kind: Any) -> jax.sharding.NamedSharding:
    """`sharding` (a `NamedSharding`) split along the mesh axes of `kind` alone."""

    def entry(names: Any) -> Any:
        names = names if isinstance(names, tuple) else (names,)
        kept = tuple(n for n in names if n is not None and kinds.get(n) == kind)
        return kept[0] if len(kept) == 1 else (kept or None)

    spec = jax.sharding.PartitionSpec(*(entry(e) for e in sharding.spec))
    return jax.sharding.NamedSharding(
        sharding.mesh, spec, memory_kind=sharding.memory_kind
    )


def copied_numpy(args: Any) -> Any:
    """`args` with every NumPy array leaf a `jax.Array` holding a copy. On the CPU,
    JAX may use a NumPy argument's buffer without copying it and read it after the
    transform has returned, so a state the eager AD transforms or `jax.checkpoint`
    write from it would change with the caller's array."""
    return jtu.tree_map(lambda x: to_array(x) if isinstance(x, np.ndarray) else x, args)


def as_arrays(values: Any) -> Any:
    """`values` with every leaf a `jax.Array`, as states hold them. Called eagerly,
    `jax.checkpoint`, `jax.grad` and `jax.jvp` return an output that is an input
    passed through, or a constant, as it is: a NumPy array of the caller's (which
    they could change in place afterwards), a Python or NumPy scalar (a `bool` would
    then negate as an `int`)."""

    def as_array(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return x
        if isinstance(x, (np.ndarray, np.generic)):  # NumPy's `float64` is a float.
            return to_array(x)
        # A Python number as the builtin one: weakly typed, as JAX types those.
        if isinstance(x, bool):
            return jnp.asarray(bool(x))
        if isinstance(x, int):
            return jnp.asarray(int(x))
        if isinstance(x, float):
            return jnp.asarray(float(x))
        if isinstance(x, complex):
            return jnp.asarray(complex(x))
        return jnp.asarray(x)

    return jax.tree_util.tree_map(as_array, values)
