"""The one way eqstate builds `jax.ShapeDtypeStruct`s, and tells typed PRNG keys
apart."""

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from . import _jax_compat as compat


def shape_dtype(x: Any, shape: tuple[int, ...] | None = None) -> jax.ShapeDtypeStruct:
    """The `jax.ShapeDtypeStruct` of `x` (an array, tracer, Python scalar or struct),
    keeping its weak type (a weakly typed stand-in that became strong would give a
    different trace cache key, and so a second trace) and, inside `jax.shard_map`,
    the mesh axes it varies along (an invariant stand-in would not mix with varying
    values).

    **Arguments:**

    - `x`: the value to describe.
    - `shape`: a shape to use instead of `x`'s (e.g. `x`'s without a mapped axis).

    **Returns:**

    `x` itself if it is a struct and `shape` is not given (keeping its sharding), else a
    new struct with `x`'s dtype, weak type and varying axes, and its sharding where
    its type holds one (with `shape`: its mesh, unsplit).
    """
    if isinstance(x, jax.ShapeDtypeStruct) and shape is None:
        return x
    aval = jax.typeof(x)
    beyond = compat.type_beyond_shape(aval)
    if shape is not None and beyond is not None and beyond[0] is not None:
        # The spec was for the other shape; the mesh (its manual axes) still holds.
        beyond = (NamedSharding(beyond[0].mesh, PartitionSpec()), beyond[1])
    new_shape = aval.shape if shape is None else shape
    return compat.struct(new_shape, aval.dtype, aval.weak_type, beyond)


def is_key(x: Any) -> bool:
    """Whether `x` (an array, tracer or `jax.ShapeDtypeStruct`) holds typed PRNG
    keys."""
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def key_impl_of(keys: Any) -> tuple[Any, jax.ShapeDtypeStruct]:
    """The PRNG implementation of `keys` (typed keys: an array, a tracer or a
    `jax.ShapeDtypeStruct`, which has no data to ask), and the type of their data
    (`jax.random.key_data(keys)`)."""
    found = []

    def probe(x: Any) -> Any:
        found.append(jax.random.key_impl(x))
        return jax.random.key_data(x)

    data = jax.eval_shape(probe, shape_dtype(keys))
    return found[0], data
