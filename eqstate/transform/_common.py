"""What every transform does: trace the function to find its states, then evaluate
its pure form inside the JAX transform, then write the results back."""

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import jax.tree_util as jtu

from .. import _context, _jax_compat as compat
from .._filters import to_predicate
from .._pretty_print import state_label
from .._shapes import shape_dtype
from .._state import fresh_copy, is_state, State
from .._state_dict import StateDict
from ._compiled import Compiled, dynamic_mask, in_module, is_dynamic, StaleTrace
from ._stateful_function import StatefulFunction


compat.hide_from_tracebacks(__file__)


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


jtu.register_pytree_node(
    _Static, lambda s: ((), s.value), lambda value, _: _Static(value)
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


def strong(tree: Any) -> Any:
    """Drops weak types, so that loop carries keep one type across iterations."""

    def to_strong(x):
        weak = getattr(getattr(x, "aval", x), "weak_type", False)
        return jnp.asarray(x, dtype=x.dtype) if weak else x

    return jtu.tree_map(to_strong, tree)


class Traced:
    """A function traced for one call: its states, and their values in the calling
    frame. `call` then evaluates it inside a JAX transform with other values."""

    def __init__(
        self,
        fun: Callable,
        args: tuple,
        kwargs: dict | None = None,
        *,
        name: str | None = None,
        static_argnums: Sequence[int] = (),
        parent: "_context.Frame | None" = None,
        sf: StatefulFunction | None = None,
        discover_in: "_context.Frame | None" = None,
    ):
        if sf is None:
            sf = StatefulFunction(
                fun,
                static_argnums=tuple(static_argnums),
                state_returns="write",
                name=name,
            )
        self.sf = sf
        self.frame = parent if parent is not None else _context.current_frame()
        call = self.sf.parse_args(args, kwargs or {})
        # The states are seen as they are inside the transform (`vmap` strips their
        # batch axes); their values come from the calling frame.
        entry = self.sf.compile(
            call, self.frame if discover_in is None else discover_in
        )
        self.values = self.frame.read_many(entry.states)
        self.entry: Compiled = entry
        self.key = call.key

    @property
    def states(self) -> tuple[State, ...]:
        return self.entry.states

    @property
    def written(self) -> tuple[State, ...]:
        return self.entry.updated_states

    def refuse_new_states(self, where: str) -> None:
        if self.entry.new_states:
            labels = ", ".join(state_label(s) for s in self.entry.new_states)
            raise ValueError(
                f"{where} creates states ({labels}). States cannot be created inside "
                "it, because each call or iteration would create another set. Create "
                "them before, outside the transformed function."
            )

    def call(
        self, values: Sequence[Any], args: tuple, kwargs: dict | None = None
    ) -> tuple[Any, dict[State, Any], list[tuple[State, Any]]]:
        """Evaluates the function on `args` with `values` for `self.states`.

        **Returns:**

        `(out, updates, new)`: the output (new states' handles replaced by fresh
        ones), the values of the written states, and `(fresh handle, value)` pairs.
        """
        call = self.sf.parse_args(args, kwargs or {})
        values = list(values)
        states = self.entry.states
        # The discovery trace serves when it fits, even if it could not be cached
        # (it closes over tracers of an enclosing trace).
        if call.key == self.key and self.entry.stale_state(values) is None:
            entry = self.entry
        else:
            # The values inside the transform may differ from the outer ones (a batch
            # axis removed, a weak type dropped for a loop carry): trace against them.
            def values_of(entry: Compiled) -> list | None:
                return values if entry.states == states else None

            def inner() -> _context.Frame:
                return _context.DictFrame(zip(states, values))

            try:
                entry, _ = self.sf.lookup(call, inner, values_of)
            except StaleTrace:
                entry = None
        if entry is None or entry.states != states:
            raise RuntimeError(
                f"{self.sf.name} touched different states when traced inside the "
                "transform than before it. Its states must not depend on the values "
                "of its arguments."
            )
        out_leaves, updated, new_values = entry.split_outputs(
            entry.run(call.leaves, values)
        )
        fresh = [fresh_copy(s) for s in entry.new_states]
        out = entry.build_output(out_leaves, fresh)
        return (
            out,
            dict(zip(entry.updated_states, updated)),
            list(zip(fresh, new_values)),
        )

    def commit(
        self, updates: dict[State, Any], new: Sequence[tuple[State, Any]] = ()
    ) -> None:
        if updates or new:
            self.frame.commit(updates, list(new))


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
    index = [i for i, x in enumerate(leaves) if is_dynamic(x)]
    dynamic = [leaves[i] for i in index]
    # `rebuild` may outlive a trace (JAX caches the traced function), so it keeps only
    # the static leaves: the dynamic ones may be that trace's tracers.
    static = [None if is_dynamic(x) else x for x in leaves]

    def rebuild(new_dynamic: Sequence[Any]) -> Any:
        full = list(static)
        for i, x in zip(index, new_dynamic):
            full[i] = x
        return jtu.tree_unflatten(treedef, full)

    return dynamic, rebuild
