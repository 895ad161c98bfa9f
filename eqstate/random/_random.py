"""The default random state and samplers that read and advance it.

A sampler given no `key` splits the default key, draws with the drawn half, and only
then writes the other half back: a sampler that refuses its arguments (JAX's checks,
and the clearer ones made here first) leaves the default key as it was.
"""

import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.core import Tracer
from jaxtyping import Array, ArrayLike, Float, Int, Key, PRNGKeyArray

from .._context import current_frame
from .._state import (
    draws_atomically,
    lazy_world_state,
    lock_keys,
    RandomState,
    split_and_advance,
)


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


@draws_atomically
def _draw(key: PRNGKeyArray | None, sample: Callable[[Any], Any]) -> Any:
    """`sample(key)`; without a key, with one split from the default random state,
    which advances only once `sample` has succeeded."""
    if key is not None:
        return sample(key)
    frame = current_frame()
    lock_keys(frame, (DEFAULT,))  # Threads drawing at once draw different numbers.
    successor, drawn = split_and_advance(frame.read(DEFAULT), None)
    out = sample(drawn)
    DEFAULT.value = successor
    return out


def _shape(shape: Any, sampler: str) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, int) or np.ndim(shape) == 0 else shape
    try:
        dims = tuple(operator.index(n) for n in dims)  # pyright: ignore[reportGeneralTypeIssues]
    except TypeError:
        raise TypeError(
            f"`eqstate.random.{sampler}`: `shape` must be an integer or a sequence of "
            f"integers, got {shape!r}."
        ) from None
    if any(n < 0 for n in dims):
        raise ValueError(
            f"`eqstate.random.{sampler}`: `shape` must not have negative sizes, got "
            f"{shape!r}."
        )
    return dims


def _maybe_shape(shape: Any, sampler: str) -> tuple[int, ...] | None:
    return None if shape is None else _shape(shape, sampler)


def _check_fits(
    sampler: str, shape: tuple[int, ...] | None, **params: ArrayLike
) -> None:
    """Each parameter must broadcast to `shape` (when given), as JAX requires."""
    if shape is None:
        return
    for name, value in params.items():
        got = np.shape(value)
        try:
            fits = np.broadcast_shapes(got, shape) == shape
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(
                f"`eqstate.random.{sampler}`: `{name}` of shape {got} does not "
                f"broadcast to `shape` {shape}. Give `{name}` a shape that broadcasts "
                "to it, or leave `shape` out to take the parameters' shape."
            )


def _check_axis(sampler: str, axis: int, name: str, x: ArrayLike) -> None:
    ndim = np.ndim(x)
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"`eqstate.random.{sampler}`: `axis={axis}` is out of range for `{name}` "
            f"of shape {np.shape(x)}."
        )


def normal(
    shape: _Shape = (), dtype: Any = float, *, key: PRNGKeyArray | None = None
) -> Float[Array, "..."]:
    """Standard normal samples, as `jax.random.normal` (`key` defaults to one split
    from the default random state). NumPy's `normal(loc, scale, size)` is
    `loc + scale * normal(size)`."""
    dims = _shape(shape, "normal")
    return _draw(key, lambda k: jax.random.normal(k, dims, dtype))


def randn(
    *shape: int, dtype: Any = float, key: PRNGKeyArray | None = None
) -> Float[Array, "..."]:
    """Standard normal samples of shape `shape`, given as separate integers as in
    NumPy and brainstate: `randn(3, 4)` is `normal((3, 4))`.

    !!! Example

        ```python
        import eqstate as es

        es.random.seed(0)
        x = es.random.randn(3, 4)
        es.random.seed(0)
        assert x.shape == (3, 4) and (x == es.random.normal((3, 4))).all()
        ```
    """
    return normal(_shape(shape, "randn"), dtype, key=key)


def rand(
    *shape: int, dtype: Any = float, key: PRNGKeyArray | None = None
) -> Float[Array, "..."]:
    """Uniform samples in `[0, 1)` of shape `shape`, given as separate integers as
    in NumPy and brainstate: `rand(3, 4)` is `uniform((3, 4))`."""
    return uniform(_shape(shape, "rand"), dtype, key=key)


_NUMPY_STYLE = (
    "`eqstate.random.uniform` takes the arguments of `jax.random.uniform` (shape, "
    "dtype, minval, maxval), not those of NumPy's and brainstate's `uniform(low, "
    "high, size)`: got shape={shape!r}, dtype={dtype!r}. Write "
    "`eqstate.random.uniform(size, minval=low, maxval=high)`."
)


def _refuse_numpy_style(shape: Any, dtype: Any) -> None:
    """Raises `TypeError` naming the eqstate call for NumPy's and brainstate's
    `uniform(low, high, size)`: a float where the shape goes, or a number where the
    dtype goes."""
    if isinstance(shape, (float, np.floating)) or (
        isinstance(dtype, (int, float, np.number)) and not isinstance(dtype, bool)
    ):
        raise TypeError(_NUMPY_STYLE.format(shape=shape, dtype=dtype))


def uniform(
    shape: _Shape = (),
    dtype: Any = float,
    minval: ArrayLike = 0.0,
    maxval: ArrayLike = 1.0,
    *,
    key: PRNGKeyArray | None = None,
) -> Float[Array, "..."]:
    """Uniform samples in `[minval, maxval)`, as `jax.random.uniform`. NumPy's and
    brainstate's `uniform(low, high, size)` is `uniform(size, minval=low,
    maxval=high)`: called so, this raises `TypeError` saying that."""
    _refuse_numpy_style(shape, dtype)
    dims = _shape(shape, "uniform")
    _check_fits("uniform", dims, minval=minval, maxval=maxval)
    return _draw(key, lambda k: jax.random.uniform(k, dims, dtype, minval, maxval))


def randint(
    shape: _Shape,
    minval: ArrayLike,
    maxval: ArrayLike,
    dtype: Any = int,
    *,
    key: PRNGKeyArray | None = None,
) -> Int[Array, "..."]:
    """Integers in `[minval, maxval)`, as `jax.random.randint`."""
    dims = _shape(shape, "randint")
    _check_fits("randint", dims, minval=minval, maxval=maxval)
    return _draw(key, lambda k: jax.random.randint(k, dims, minval, maxval, dtype))


def bernoulli(
    p: ArrayLike = 0.5, shape: _Shape | None = None, *, key: PRNGKeyArray | None = None
) -> Array:
    """Booleans that are `True` with probability `p`, as `jax.random.bernoulli`. A
    dropout mask keeping each unit with probability `1 - rate` is
    `bernoulli(1 - rate, x.shape)`."""
    dims = _maybe_shape(shape, "bernoulli")
    _check_fits("bernoulli", dims, p=p)
    return _draw(key, lambda k: jax.random.bernoulli(k, p, dims))


def categorical(
    logits: ArrayLike,
    axis: int = -1,
    shape: _Shape | None = None,
    *,
    key: PRNGKeyArray | None = None,
) -> Int[Array, "..."]:
    """Samples from a categorical distribution, as `jax.random.categorical`."""
    dims = _maybe_shape(shape, "categorical")
    _check_axis("categorical", axis, "logits", logits)
    return _draw(key, lambda k: jax.random.categorical(k, logits, axis, dims))


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
    dims = _shape(shape, "choice")
    if np.ndim(a) > 0:
        _check_axis("choice", axis, "a", a)
    return _draw(key, lambda k: jax.random.choice(k, a, dims, replace, p, axis))


def permutation(
    x: int | ArrayLike,
    axis: int = 0,
    independent: bool = False,
    *,
    key: PRNGKeyArray | None = None,
) -> Array:
    """A random permutation, as `jax.random.permutation`."""
    if np.ndim(x) > 0:
        _check_axis("permutation", axis, "x", x)
    return _draw(key, lambda k: jax.random.permutation(k, x, axis, independent))


def truncated_normal(
    lower: ArrayLike,
    upper: ArrayLike,
    shape: _Shape | None = None,
    dtype: Any = float,
    *,
    key: PRNGKeyArray | None = None,
) -> Float[Array, "..."]:
    """Normal samples truncated to `[lower, upper]`, as `jax.random.truncated_normal`."""
    dims = _maybe_shape(shape, "truncated_normal")
    _check_fits("truncated_normal", dims, lower=lower, upper=upper)
    return _draw(
        key, lambda k: jax.random.truncated_normal(k, lower, upper, dims, dtype)
    )


def gamma(
    a: ArrayLike,
    shape: _Shape | None = None,
    dtype: Any = float,
    *,
    key: PRNGKeyArray | None = None,
) -> Float[Array, "..."]:
    """Gamma samples with shape parameter `a`, as `jax.random.gamma`."""
    dims = _maybe_shape(shape, "gamma")
    _check_fits("gamma", dims, a=a)
    return _draw(key, lambda k: jax.random.gamma(k, a, dims, dtype))


def exponential(
    shape: _Shape = (), dtype: Any = float, *, key: PRNGKeyArray | None = None
) -> Float[Array, "..."]:
    """Exponential samples, as `jax.random.exponential`."""
    dims = _shape(shape, "exponential")
    return _draw(key, lambda k: jax.random.exponential(k, dims, dtype))


def dropout_mask(
    rate: float | Float[ArrayLike, ""],
    shape: _Shape,
    *,
    key: PRNGKeyArray | None = None,
) -> Array:
    """A boolean mask keeping each unit with probability `1 - rate` (a Bernoulli mask,
    as used by dropout).

    **Arguments:**

    - `rate`: the probability of dropping each unit, in `[0, 1)`: a Python float or a
        scalar array. A traced rate (under `jit`) cannot be checked, as in
        [`eqstate.nn.Dropout`][]; one outside `[0, 1)` drops every unit (`rate >= 1`)
        or none (`rate < 0`).
    - `shape`: the shape of the mask.
    - `key`: a key to draw from. By default one is split from the default random
        state, which advances. (Keyword only argument.)

    **Returns:**

    A boolean array of shape `shape`, `True` where a unit is kept.

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
    if not isinstance(rate, Tracer) and not 0.0 <= float(rate) < 1.0:  # pyright: ignore[reportArgumentType]
        raise ValueError(f"The dropout `rate` must be in [0, 1), got {rate}.")
    _shape(shape, "dropout_mask")
    return bernoulli(1.0 - rate, shape, key=key)
