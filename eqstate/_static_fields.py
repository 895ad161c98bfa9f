"""Handles kept in the static fields of Equinox modules, where flattening a PyTree
never reaches them."""

import dataclasses
from typing import Any

import equinox as eqx
import jax.tree_util as jtu

from ._custom_types import PyTree
from ._pretty_print import state_label
from ._state import is_state


def _is_node(x: Any) -> bool:
    return isinstance(x, eqx.Module) or is_state(x)


def refuse_static_handles(pytree: PyTree, path: tuple = ()) -> None:
    """Raises `ValueError` naming the first handle held by a field marked
    `eqx.field(static=True)` of a module in `pytree` (at `path`): every function that
    finds a model's states by flattening it (`states_of`, checkpoints, `clone`) would
    miss it."""
    for sub, leaf in jtu.tree_leaves_with_path(pytree, is_leaf=_is_node):
        if not isinstance(leaf, eqx.Module):
            continue
        for field in dataclasses.fields(leaf):
            value = getattr(leaf, field.name, None)
            where = (*path, *sub, jtu.GetAttrKey(field.name))
            if field.metadata.get("static", False):
                _refuse_handles_in(value, where, f"{type(leaf).__name__}.{field.name}")
            else:
                refuse_static_handles(value, where)


def _refuse_handles_in(value: Any, path: tuple, field: str) -> None:
    handles = [x for x in jtu.tree_leaves(value, is_leaf=is_state) if is_state(x)]
    if handles:
        raise ValueError(
            f"{state_label(handles[0])} is held by `{field}` (at "
            f"`{jtu.keystr(path)}`), a field marked `eqx.field(static=True)`. eqstate "
            "finds a model's states by flattening it, which skips static fields: "
            "`states_of`, `values_of`, checkpoints and `clone` would leave it out. "
            "Remove `static=True`: transforms already treat a handle as a static "
            "leaf."
        )
