"""Type aliases and sentinels shared across eqstate."""

from typing import Any, TYPE_CHECKING, TypeAlias


if TYPE_CHECKING:
    from typing_extensions import TypeAliasType, TypeVar

    _Leaf = TypeVar("_Leaf", default=Any)
    # jaxtyping's `PyTree` is an unknown type to type checkers, so that strict pyright
    # reports every signature that uses it; this one is `Any`, bare or subscripted,
    # as jaxtyping means it to be.
    PyTree = TypeAliasType("PyTree", Any, type_params=(_Leaf,))
else:
    from jaxtyping import PyTree as PyTree


# A filter selects states: a State subclass, a handle, a tag, a predicate
# `(path, state) -> bool`, `...`, `None`/`False`, or a tuple/list of filters.
# `eqstate.filters.to_predicate` checks it and names what is wrong.
Filter: TypeAlias = Any

# `in_axes`/`out_axes` of the vmap family: an int, None, or a PyTree prefix of them.
AxisSpec: TypeAlias = Any


class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"

    def __bool__(self) -> bool:
        return False


Missing: TypeAlias = _Missing
"""The type of `MISSING`, for the decorator overloads of transforms."""

MISSING: Any = _Missing()
"""Marks an argument or a value that is absent (where `None` is a valid value)."""

# `jax.tree_util.PyTreeDef`, which type checkers see as a variable, not a class.
PyTreeDef: TypeAlias = Any
