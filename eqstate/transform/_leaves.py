"""How eqstate sees the leaves of arguments and outputs: traced or static, and their
abstract signatures."""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np

from .. import _jax_compat as compat
from .._custom_types import PyTreeDef


_SCALAR_TYPES = (bool, int, float, complex, np.generic)
# The concrete array class, for a fast path in `signature`. Found without making an
# array: that would start JAX's backend on import, and `jax.distributed.initialize()`
# must run before. (If it is not found, `signature` takes its general path.)
ArrayImpl = next(
    (c for c in jax.Array.__subclasses__() if c.__name__ == "ArrayImpl"), None
)


def is_dynamic(x: Any) -> bool:
    """Whether an argument or output leaf is traced: arrays, Python scalars, and
    `jax.ShapeDtypeStruct`s (which stand for arrays when only tracing)."""
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct, *_SCALAR_TYPES))


def _is_array(x: Any) -> bool:
    # NumPy scalars count as arrays, as in `eqx.is_array`: traced and differentiated.
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def _is_module(x: Any) -> bool:
    return isinstance(x, eqx.Module)


def in_module(tree: Any) -> list[bool]:
    """Whether each leaf of `tree` (in `jax.tree_util` order) is inside an
    `eqx.Module`. It depends only on the tree's structure."""
    found = []
    for item in jtu.tree_leaves(tree, is_leaf=_is_module):
        if _is_module(item):
            found.extend(True for _ in jtu.tree_leaves(item))
        else:
            found.append(False)
    return found


def is_traced(x: Any, module_field: bool) -> bool:
    """Whether an argument or output leaf is traced. Arrays are; so are Python
    scalars, as in `jax.jit`, except the fields of an `eqx.Module` (a layer's
    `inference: bool`, a rate), which are static as in `eqx.filter_jit` (NumPy
    scalars are arrays there, as in Equinox). Everything
    else (state handles, strings, functions) is static."""
    return _is_array(x) if module_field else is_dynamic(x)


def dynamic_mask(tree: Any) -> list[bool]:
    """`is_traced` of each leaf of `tree`."""
    leaves = jtu.tree_leaves(tree)
    return [is_traced(x, m) for x, m in zip(leaves, in_module(tree))]


def signature(x: Any) -> tuple:
    """`(shape, dtype, weak_type, beyond)` of an array, tracer, scalar or
    ShapeDtypeStruct, `beyond` what else its type says (see
    `_jax_compat.type_beyond_shape`): a trace made for a value varying across
    devices, or with an explicit sharding, must not serve another."""
    if type(x) is ArrayImpl:
        return (x.shape, x.dtype, x.weak_type, _array_type_beyond_shape(x))
    return aval_signature(jax.typeof(x))


def _array_type_beyond_shape(x: Any) -> Any:
    """`type_beyond_shape` of an array, cheaply for the usual one: an array varies
    across no devices, and only a `NamedSharding` can put mesh axes in its type
    (`x.aval` costs microseconds to build)."""
    if type(x.sharding) is not jax.sharding.NamedSharding:
        return None
    return compat.type_beyond_shape(x.aval)


def aval_signature(aval: Any) -> tuple:
    """`signature` of a value of type `aval`."""
    beyond = compat.type_beyond_shape(aval)
    return (aval.shape, aval.dtype, aval.weak_type, beyond)


def struct(sig: tuple) -> jax.ShapeDtypeStruct:
    return compat.struct(*sig)


def flatten_each(values: Sequence[Any]) -> list[Any]:
    return [leaf for v in values for leaf in jtu.tree_leaves(v)]


def unflatten_each(defs: Sequence[PyTreeDef], leaves: Sequence[Any]) -> list[Any]:
    values, start = [], 0
    for treedef in defs:
        stop = start + treedef.num_leaves
        values.append(jtu.tree_unflatten(treedef, leaves[start:stop]))
        start = stop
    return values


def is_single_leaf(treedef: PyTreeDef) -> bool:
    return treedef.num_leaves == 1 and treedef.num_nodes == 1
