"""The default random state and samplers that read and advance it."""

from collections.abc import Sequence
from typing import Any

import jax
from jaxtyping import Array, ArrayLike, Float, Int, Key, PRNGKeyArray

from .._state import lazy_world_state, RandomState


# Its key is made on first use: making it at import would start JAX's backend, and
# `jax.distributed.initialize()` must run before that.
DEFAULT = lazy_world_state(RandomState, lambda: jax.random.key(0), name="default_rng")
"""The world's default random state: every sampler of `eqstate.random` draws from it
unless given a `key`."""

_Shape = Sequence[int] | int


def seed(seed_or_key: int | ArrayLike = 0) -> None:
    """Resets the default random state from an integer seed (or a typed key). Like any
    write, under a transform this writes the value of the innermost context.

    !!! Example

        ```python
        import eqstate as es

        es.random.seed(3)
        a = es.random.normal((2,))
        es.random.seed(3)
        assert (es.random.normal((2,)) == a).all()
        ```
    """
    DEFAULT.seed(seed_or_key)


def get_key() -> PRNGKeyArray:
    """The current key of the default random state."""
    return DEFAULT.value


def set_key(key: PRNGKeyArray) -> None:
    """Replaces the key of the default random state."""
    DEFAULT.value = key


def split_key(n: int | None = None) -> Key[Array, "..."]:
    """Advances the default random state and returns a fresh key (or `n` fresh keys,
    stacked)."""
    return DEFAULT.split_key(n)


def _key(key: PRNGKeyArray | None) -> PRNGKeyArray:
    return split_key() if key is None else key


def _shape(shape: _Shape) -> tuple[int, ...]:
    return (shape,) if isinstance(shape, int) else tuple(shape)


def _maybe_shape(shape: _Shape | None) -> tuple[int, ...] | None:
    return None if shape is None else _shape(shape)


def normal(
    shape: _Shape = (), dtype: Any = float, *, key: PRNGKeyArray | None = None
) -> Float[Array, "..."]:
    """Standard normal samples, as `jax.random.normal` (`key` defaults to one split
    from the default random state)."""
    return jax.random.normal(_key(key), _shape(shape), dtype)


def uniform(
    shape: _Shape = (),
    dtype: Any = float,
    minval: ArrayLike = 0.0,
    maxval: ArrayLike = 1.0,
    *,
    key: PRNGKeyArray | None = None,
) -> Float[Array, "..."]:
    """Uniform samples in `[minval, maxval)`, as `jax.random.uniform`."""
    return jax.random.uniform(_key(key), _shape(shape), dtype, minval, maxval)


def randint(
    shape: _Shape,
    minval: ArrayLike,
    maxval: ArrayLike,
    dtype: Any = int,
    *,
    key: PRNGKeyArray | None = None,
) -> Int[Array, "..."]:
    """Integers in `[minval, maxval)`, as `jax.random.randint`."""
    return jax.random.randint(_key(key), _shape(shape), minval, maxval, dtype)


def bernoulli(
    p: ArrayLike = 0.5, shape: _Shape | None = None, *, key: PRNGKeyArray | None = None
) -> Array:
    """Booleans that are `True` with probability `p`, as `jax.random.bernoulli`. A
    dropout mask keeping each unit with probability `1 - rate` is
    `bernoulli(1 - rate, x.shape)`."""
    return jax.random.bernoulli(_key(key), p, _maybe_shape(shape))


def categorical(
    logits: ArrayLike,
    axis: int = -1,
    shape: _Shape | None = None,
    *,
    key: PRNGKeyArray | None = None,
) -> Int[Array, "..."]:
    """Samples from a categorical distribution, as `jax.random.categorical`."""
    return jax.random.categorical(_key(key), logits, axis, _maybe_shape(shape))


def choice(
    a: int | ArrayLike,
    shape: _Shape = (),
    replace: bool = True,
    p: ArrayLike | None = None,
    axis: int = 0,
    *,
    key: PRNGKeyArray | None = None,
) -> Array:
    """Random elements of `a`, as `jax.random.choice`."""
    return jax.random.choice(_key(key), a, _shape(shape), replace, p, axis)


def permutation(
    x: int | ArrayLike,
    axis: int = 0,
    independent: bool = False,
    *,
    key: PRNGKeyArray | None = None,
) -> Array:
    """A random permutation, as `jax.random.permutation`."""
    return jax.random.permutation(_key(key), x, axis, independent)


def truncated_normal(
    lower: ArrayLike,
    upper: ArrayLike,
    shape: _Shape | None = None,
    dtype: Any = float,
    *,
    key: PRNGKeyArray | None = None,
) -> Float[Array, "..."]:
    """Normal samples truncated to `[lower, upper]`, as `jax.random.truncated_normal`."""
    return jax.random.truncated_normal(
        _key(key), lower, upper, _maybe_shape(shape), dtype
    )


def gamma(
    a: ArrayLike,
    shape: _Shape | None = None,
    dtype: Any = float,
    *,
    key: PRNGKeyArray | None = None,
) -> Float[Array, "..."]:
    """Gamma samples with shape parameter `a`, as `jax.random.gamma`."""
    return jax.random.gamma(_key(key), a, _maybe_shape(shape), dtype)


def exponential(
    shape: _Shape = (), dtype: Any = float, *, key: PRNGKeyArray | None = None
) -> Float[Array, "..."]:
    """Exponential samples, as `jax.random.exponential`."""
    return jax.random.exponential(_key(key), _shape(shape), dtype)


def dropout_mask(
    rate: float, shape: _Shape, *, key: PRNGKeyArray | None = None
) -> Array:
    """A boolean mask keeping each unit with probability `1 - rate` (a Bernoulli mask,
    as used by dropout).

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        x = jnp.ones(1000)
        mask = es.random.dropout_mask(0.25, x.shape)
        y = jnp.where(mask, x / 0.75, 0.0)
        assert 0.65 < mask.mean() < 0.85
        ```
    """
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"The dropout `rate` must be in [0, 1), got {rate}.")
    return bernoulli(1.0 - rate, shape, key=key)
