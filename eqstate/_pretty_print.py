"""Helpers every `repr` and error message uses to describe arrays and states."""

from typing import Any

import jax
import jax.tree_util as jtu

from ._custom_types import MISSING


_DTYPE_ABBREVIATIONS = {
    "float": "f",
    "bfloat": "bf",
    "int": "i",
    "uint": "u",
    "complex": "c",
    "bool": "bool",
}


def dtype_summary(dtype: Any) -> str:
    """`float32` -> `f32`, `bfloat16` -> `bf16`, `key<fry>` -> `key<fry>`."""
    name = str(dtype)
    for long, short in _DTYPE_ABBREVIATIONS.items():
        if name.startswith(long) and name[len(long) :].isdigit():
            return short + name[len(long) :]
    return name


def array_summary(x: Any) -> str:
    """`f32[3,4]` for an array or tracer, `repr(x)` for anything else."""
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None:
        return repr(x)
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return f"key<{jax.random.key_impl(x)}>[{','.join(map(str, shape))}]"
    return f"{dtype_summary(dtype)}[{','.join(map(str, shape))}]"


def value_summary(value: Any) -> str:
    """A one-line summary of a PyTree of arrays: `f32[3]` or `{'a': f32[3], ...}`."""
    leaves, treedef = jtu.tree_flatten(value)
    if treedef.num_leaves == 1 and treedef.num_nodes == 1:
        return array_summary(leaves[0])
    return str(
        jtu.tree_unflatten(treedef, [_Summary(array_summary(x)) for x in leaves])
    )


class _Summary:
    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def state_label(state: Any, value: Any = MISSING) -> str:
    """Names a state in messages: `ParamState 'w'`, or `ParamState 'w' (f32[3])` when its
    value is known. Unnamed states show their tag, or their identity."""
    kind = type(state).__name__
    name = getattr(state, "name", None)
    tag = getattr(state, "tag", None)
    if name is not None:
        label = f"{kind} {name!r}"
    elif tag is not None:
        label = f"{kind} tagged {tag!r}"
    else:
        label = f"unnamed {kind} at {id(state):#x}"
    if value is not MISSING:
        label += f" ({value_summary(value)})"
    return label
