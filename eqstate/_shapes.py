"""The one way eqstate builds `jax.ShapeDtypeStruct`s."""

from typing import Any

import jax


def shape_dtype(x: Any, shape: tuple[int, ...] | None = None) -> jax.ShapeDtypeStruct:
    """The `jax.ShapeDtypeStruct` of `x` (an array, tracer, Python scalar or struct),
    keeping its weak type: a weakly typed stand-in that became strong would give a
    different trace cache key, and so a second trace.

    **Arguments:**

    - `x`: the value to describe.
    - `shape`: a shape to use instead of `x`'s (e.g. `x`'s without a mapped axis).

    **Returns:**

    `x` itself if it is a struct and `shape` is not given (keeping its sharding), else a
    new struct with `x`'s dtype and weak type.
    """
    if isinstance(x, jax.ShapeDtypeStruct):
        if shape is None:
            return x
        aval = x
    else:
        aval = jax.typeof(x)
    return jax.ShapeDtypeStruct(
        aval.shape if shape is None else shape, aval.dtype, weak_type=aval.weak_type
    )
